"""ClusterClient: local training, train_select, evaluation and fault injection on real digits data."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.client import SimulatedClientFailure
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.experiment import experiment_data, initial_weights, make_client
from fedcluster_flwr.algorithms.base.selection import TRAIN_SELECT
from fedcluster_flwr.training import get_weights


def config(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


def packed(blocks):
    """Flower's flat list of arrays for ``blocks``, as the client receives it, and its layout."""
    parameters, layout = protocol.pack_parameters(blocks)
    return protocol.parameters_to_arrays(parameters), layout


def fit(client, task, rnd, *models, layout=None):
    """Send ``models`` as the ``models`` block of a ``task`` instruction in round ``rnd``."""
    arrays, packed_layout = packed({protocol.MODELS: list(models)})
    return client.fit(arrays, protocol.instruction_config(task, rnd, layout or packed_layout, {}))


def evaluate(client, weights):
    arrays, layout = packed({protocol.MODELS: [weights]})
    return client.evaluate(arrays, protocol.instruction_config(protocol.EVALUATE, 1, layout, {}))


@pytest.fixture(scope="module")
def cfg():
    return config("client.epochs=3", "simulation.fail_fit={2: [4]}")


def test_properties_identify_the_partition(cfg):
    client = make_client(cfg, 3, cfg.partition.num_clients)
    props = client.get_properties({})
    assert props == {"partition_id": 3, "num_partitions": cfg.partition.num_clients}
    _, partition = experiment_data(cfg)
    assert client.num_train == len(partition.train_indices[3])
    assert len(client.data.y_test) == len(partition.test_indices[3])


def test_fit_trains_and_lowers_the_training_loss(cfg):
    client = make_client(cfg, 0, cfg.partition.num_clients)
    start = initial_weights(cfg)
    weights, num_examples, metrics = fit(client, protocol.TRAIN, 1, start)
    assert [w.shape for w in weights] == [w.shape for w in start]
    assert num_examples == client.num_train
    assert list(metrics) == ["train_loss"]
    loss_before, _, _ = evaluate(client, start)
    loss_after, _, result = evaluate(client, weights)
    assert loss_after < loss_before
    assert 0.0 <= result["accuracy"] <= 1.0


def test_fit_is_reproducible_for_a_round_and_differs_across_rounds(cfg):
    client = make_client(cfg, 1, cfg.partition.num_clients)
    start = initial_weights(cfg)
    first, _, _ = fit(client, protocol.TRAIN, 5, start)
    again, _, _ = fit(client, protocol.TRAIN, 5, start)
    other, _, _ = fit(client, protocol.TRAIN, 6, start)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_train_select_picks_the_model_with_the_lowest_training_loss(cfg):
    client = make_client(cfg, 0, cfg.partition.num_clients)
    untrained = initial_weights(cfg)
    trained = untrained
    for rnd in range(1, 4):
        trained, _, _ = fit(client, protocol.TRAIN, rnd, trained)
    weights, _, metrics = fit(client, TRAIN_SELECT, 9, untrained, trained, untrained)
    assert metrics["selected"] == 1
    assert metrics["loss_1"] < metrics["loss_0"] == pytest.approx(metrics["loss_2"])
    assert [w.shape for w in weights] == [w.shape for w in untrained]


def test_wrongly_packed_parameters_are_refused(cfg):
    client = make_client(cfg, 0, cfg.partition.num_clients)
    n = len(initial_weights(cfg))
    with pytest.raises(protocol.ProtocolError, match=f"layout 'models=2x{n}' needs more than the {n} arrays"):
        fit(client, TRAIN_SELECT, 1, initial_weights(cfg), layout=f"models=2x{n}")


def test_unknown_task_is_refused(cfg):
    client = make_client(cfg, 0, cfg.partition.num_clients)
    arrays, layout = packed({protocol.MODELS: [initial_weights(cfg)]})
    with pytest.raises(protocol.ProtocolError, match="task 'dance' is unknown; this client handles train, evaluate, ") as err:
        client.fit(arrays, {protocol.TASK_KEY: "dance", protocol.ROUND_KEY: 1, protocol.LAYOUT_KEY: layout})
    assert "gossip_train" in str(err.value)  # the families were loaded before it said so


def test_a_client_loads_the_families_for_a_task_it_has_no_handler_for_yet():
    """No import-order trap: in a fresh process the client module alone registers only the two
    tasks every family uses; a client built by experiment.make_client that receives another task
    loads the families (the registry) and takes that task to its own instruction check (here: what
    the empty instruction lacks), as it does every task the families registered."""
    code = (
        "import json\n"
        "import fedcluster_flwr.client\n"
        "from fedcluster_flwr import registry\n"
        "before = list(registry.HANDLERS)\n"
        "from fedcluster_flwr.config import load_config\n"
        "from fedcluster_flwr.experiment import make_client\n"
        "from fedcluster_flwr.protocol import LAYOUT_KEY, ROUND_KEY, TASK_KEY, ProtocolError\n"
        f"config, _ = load_config({str(DEFAULT_CONFIG)!r})\n"
        "client = make_client(config, 0, config.partition.num_clients)\n"
        "answers = {}\n"
        "for name in ['gossip_train', *registry.HANDLERS]:\n"
        "    try:\n"
        "        client.fit([], {TASK_KEY: name, ROUND_KEY: 1, LAYOUT_KEY: ''})\n"
        "    except ProtocolError as err:\n"
        "        answers[name] = str(err)\n"
        "print(json.dumps({'before': before, 'tasks': list(registry.HANDLERS), 'answers': answers}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == ["train", "evaluate"]
    assert {"train_select", "select", "gram_eigen", "relevance", "gossip_train"} <= set(result["tasks"])
    for name in result["tasks"]:
        assert result["answers"][name].startswith(f"task {name!r}: missing ["), result["answers"][name]

def test_fault_injection_raises_only_in_its_rounds(cfg):
    client = make_client(cfg, 2, cfg.partition.num_clients)
    with pytest.raises(SimulatedClientFailure):
        fit(client, protocol.TRAIN, 4, initial_weights(cfg))
    fit(client, protocol.TRAIN, 3, initial_weights(cfg))


def test_label_swapped_clients_see_their_group_labels(cfg):
    """Group 1 swaps labels 2 and 3: its client's test labels are relabelled accordingly."""
    pool, partition = experiment_data(cfg)
    pid = int(np.flatnonzero(partition.true_clusters == 1)[0])
    client = make_client(cfg, pid, cfg.partition.num_clients)
    original = pool.labels[partition.test_indices[pid]]
    seen = client.data.y_test.numpy()
    swap = {2: 3, 3: 2}
    assert seen.tolist() == [swap.get(int(y), int(y)) for y in original]


def test_partition_id_outside_the_partition_is_refused(cfg):
    with pytest.raises(ValueError, match="partition-id 99"):
        make_client(cfg, 99, 100)


def test_a_received_model_is_a_trainable_copy_of_the_arrays_in_the_models_dtypes(cfg):
    """Built on the meta device and assigned: real CPU float32 parameters that train, a float64
    array does not turn a layer float64, and training never writes into the received arrays."""
    client = make_client(cfg, 0, cfg.partition.num_clients)
    arrays = [a.astype(np.float64) for a in initial_weights(cfg)]
    kept = [a.copy() for a in arrays]
    model = client.load_model(arrays)
    assert {(p.device.type, p.dtype, p.requires_grad) for p in model.parameters()} == {("cpu", torch.float32, True)}
    client.train_model(model, 1)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, kept))
    assert not all(np.allclose(a, b) for a, b in zip(get_weights(model), kept))
