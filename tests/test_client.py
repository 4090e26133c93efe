"""The ClientApp and ClusterClient: local training, train_select, evaluation and fault injection on
real digits data, each asked through Flower messages on an in-process grid."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.apps.client_app import FedclusterClientApp
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.engines.inprocess import InProcessGrid, node_id_of, partition_node_configs
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.algorithms.base.selection import TRAIN_SELECT
from fedcluster_flwr.training import get_weights


def config(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


class ClientFailed(Exception):
    """The ClientApp's error reply, as an exception (its reason is the client's exception, in one line)."""


def send(grid, pid, task, rnd, blocks, extra=None):
    """Client ``pid``'s reply to a ``task`` instruction of round ``rnd`` carrying ``blocks``."""
    content = task.instruction(blocks, extra or {}, rnd)
    (reply,) = grid.send_and_receive([Message(content, node_id_of(pid), task.message_type)])
    if reply.has_error():
        raise ClientFailed(reply.error.reason)
    return reply.content


def fit(grid, pid, task, rnd, *models):
    """Send ``models`` (the one model of ``train``, or the ``models`` block) to client ``pid``; its
    arrays, example count and metrics back."""
    block = protocol.MODEL if task is protocol.TRAIN else protocol.MODELS
    content = send(grid, pid, task, rnd, {block: list(models)})
    metrics = dict(content[protocol.METRICS])
    arrays = protocol.record_arrays(content[protocol.MODEL]) if protocol.MODEL in content else []
    return arrays, metrics.pop(protocol.NUM_EXAMPLES), metrics


def evaluate(grid, pid, weights):
    metrics = dict(send(grid, pid, protocol.EVALUATE, 1, {protocol.MODEL: [weights]})[protocol.METRICS])
    return metrics.pop(protocol.TEST_LOSS), metrics.pop(protocol.NUM_EXAMPLES), metrics


@pytest.fixture(scope="module")
def cfg():
    return config("client.epochs=3", "simulation.fail_fit={2: [4]}")


@pytest.fixture(scope="module")
def grid(cfg):
    return InProcessGrid(FedclusterClientApp(Experiment(cfg), keep_clients=True), partition_node_configs(cfg.partition.num_clients))


def test_identify_tells_the_partition(cfg, grid):
    content = RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND_KEY: 1})})
    (reply,) = grid.send_and_receive([Message(content, node_id_of(3), protocol.IDENTIFY.message_type)])
    assert dict(reply.content[protocol.METRICS]) == {"partition_id": 3, "num_partitions": cfg.partition.num_clients,
                                                      "own_data": 0}
    client = Experiment(cfg).client(3, cfg.partition.num_clients)
    _, partition = Experiment(cfg).data()
    assert client.num_train == len(partition.train_indices[3])
    assert len(client.data.y_test) == len(partition.test_indices[3])


def test_fit_trains_and_lowers_the_training_loss(cfg, grid):
    start = Experiment(cfg).weights()
    weights, num_examples, metrics = fit(grid, 0, protocol.TRAIN, 1, start)
    assert [w.shape for w in weights] == [w.shape for w in start]
    assert num_examples == Experiment(cfg).client(0, cfg.partition.num_clients).num_train
    assert list(metrics) == ["train_loss"]
    loss_before, _, _ = evaluate(grid, 0, start)
    loss_after, _, result = evaluate(grid, 0, weights)
    assert loss_after < loss_before
    assert 0.0 <= result["accuracy"] <= 1.0


def test_fit_is_reproducible_for_a_round_and_differs_across_rounds(cfg, grid):
    start = Experiment(cfg).weights()
    first, _, _ = fit(grid, 1, protocol.TRAIN, 5, start)
    again, _, _ = fit(grid, 1, protocol.TRAIN, 5, start)
    other, _, _ = fit(grid, 1, protocol.TRAIN, 6, start)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_two_clients_train_the_same_model_on_their_own_data_orders(cfg):
    """Each client's randomness stream is its own: two clients that held the same data would still see
    their batches in another order (the seed is (run seed, round, partition id))."""
    twin = Experiment(cfg).client(1, cfg.partition.num_clients)
    twin.pid = 0  # client 1's data under client 0's stream
    one = Experiment(cfg).client(1, cfg.partition.num_clients)
    start = Experiment(cfg).weights()
    models = [client.load_model(start) for client in (one, twin)]
    for client, model in zip((one, twin), models):
        client.train_model(model, 1)
    assert not all(np.array_equal(a, b) for a, b in zip(get_weights(models[0]), get_weights(models[1])))


def test_every_randomness_stream_of_a_client_is_its_own():
    """round_seed gives another stream for every run seed, round, partition id and stream number
    (training, the selection batch, the fault draw): a seed that dropped or repeated one of them
    would give two clients, two rounds or two runs one data order."""
    from fedcluster_flwr.algorithms.base.selection import SELECTION_STREAM
    from fedcluster_flwr.client import FAULT_STREAM, round_seed

    keys = [(seed, rnd, pid, *stream) for seed in (0, 1, 7) for rnd in range(1, 6) for pid in range(6)
            for stream in ((), (SELECTION_STREAM,), (FAULT_STREAM,))]
    assert len({round_seed(*key) for key in keys}) == len(keys)


def test_a_clients_data_order_follows_the_runs_seed():
    """Client 0 in round 1 of two runs that differ only in their seed: another data order, so another
    model from the same start (the partitions differ too; both are the seed's)."""
    models = []
    for seed in (0, 1):
        cfg = config(f"seed={seed}")
        client = Experiment(cfg).client(0, cfg.partition.num_clients)
        client.data = Experiment(config("seed=0")).client(0, cfg.partition.num_clients).data  # the same data for both
        model = client.load_model(Experiment(config("seed=0")).weights())
        client.train_model(model, 1)
        models.append(get_weights(model))
    assert not all(np.array_equal(a, b) for a, b in zip(*models))


def test_in_a_round_each_client_draws_its_own_fault():
    """faults.drop_rate 0.5: in each round some clients drop and others answer (one draw per client,
    not one per round shared by all)."""
    from fedcluster_flwr.client import Faults

    faults = Faults(drop_rate=0.5, seed=3)
    for rnd in range(1, 11):
        assert {faults.draw(rnd, pid) for pid in range(20)} == {"drop", None}, rnd


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_largest_lr_and_weight_decay_a_config_takes_never_overflow_the_optimizer(optimizer):
    """client.lr and client.weight_decay stop at 1e37 (training.OPTIMIZER_FACTOR_MAX): at it,
    every optimizer's step is a float32 number (the model diverges, which the reply checks refuse);
    past float32's 3.4e38, torch refuses the step, in every fit of the run, which is why the config
    refuses such a value, naming the key and why."""
    from dataclasses import asdict, replace
    from types import SimpleNamespace

    from fedcluster_flwr.training import OPTIMIZER_FACTOR_MAX
    from fedcluster_flwr.declarations.schema import ConfigError
    from fedcluster_flwr.training import train

    cfg = config(f"client.lr={OPTIMIZER_FACTOR_MAX}", f"client.weight_decay={OPTIMIZER_FACTOR_MAX}",
                 f"client.optimizer={optimizer}", "client.momentum=0.9")
    client = Experiment(cfg).client(0, cfg.partition.num_clients)
    client.train_model(client.load_model(Experiment(cfg).weights()), 1)  # no overflow
    with pytest.raises(ConfigError, match=r"^lr: must be in \(0, 1e\+37\], got 1e\+39"):
        replace(client.settings, lr=1e39)  # the settings type itself refuses it, wherever it is made
    # past the bound, torch refuses the step: shown with settings that skip the declarations
    data, past = client.data, SimpleNamespace(**(asdict(client.settings) | {"lr": 1e39}))
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        train(client.load_model(Experiment(cfg).weights()), data.x_train, data.y_train, past, torch.Generator(), client.device)
    with pytest.raises(ConfigError, match=r"^client.lr: must be in \(0, 1e\+37\], got 1e\+38 \(at most 1e37: Adam's"):
        config("client.lr=1e38")
    with pytest.raises(ConfigError, match=r"^client.weight_decay: must be in \[0, 1e\+37\], got 1e\+300 \(at most"):
        config("client.weight_decay=1e300")


def test_train_select_picks_the_model_with_the_lowest_training_loss(cfg, grid):
    untrained = Experiment(cfg).weights()
    trained = untrained
    for rnd in range(1, 4):
        trained, _, _ = fit(grid, 0, protocol.TRAIN, rnd, trained)
    weights, _, metrics = fit(grid, 0, TRAIN_SELECT, 9, untrained, trained, untrained)
    assert metrics["selected"] == 1
    assert metrics["loss_1"] < metrics["loss_0"] == pytest.approx(metrics["loss_2"])
    assert [w.shape for w in weights] == [w.shape for w in untrained]


def test_a_malformed_instruction_is_the_clients_failure_naming_what_is_wrong(cfg, grid):
    content = TRAIN_SELECT.instruction({protocol.MODELS: [Experiment(cfg).weights()]}, {}, 1)
    content["models.3"] = content.pop(protocol.MODELS)
    (reply,) = grid.send_and_receive([Message(content, node_id_of(0), TRAIN_SELECT.message_type)])
    assert reply.error.reason == "ProtocolError: task 'train_select': block 'models' must travel as ['models'], got ['models.3']"


def test_an_unknown_task_is_refused_by_flowers_routing(cfg, grid):
    content = RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND_KEY: 1})})
    (reply,) = grid.send_and_receive([Message(content, node_id_of(0), "train.dance")])
    assert reply.has_error() and "No train function registered with name 'dance'" in reply.error.reason


def test_the_client_app_serves_every_registered_task_under_its_message_type():
    """No import-order trap: in a fresh process the client module alone registers only the two
    tasks every family uses; the ClientApp loads the families and registers an action for each
    task they declare, under the task's message type, each taking the task to its own instruction
    check (here: what the empty instruction lacks)."""
    code = (
        "import json\n"
        "import fedcluster_flwr.client\n"
        "from fedcluster_flwr import registry\n"
        "before = list(registry.HANDLERS)\n"
        "from flwr.app import ConfigRecord, Message, RecordDict\n"
        "from fedcluster_flwr.apps.client_app import FedclusterClientApp\n"
        "from fedcluster_flwr.config.load import load_config\n"
        "from fedcluster_flwr.experiment import Experiment\n"
        "from fedcluster_flwr.engines.inprocess import InProcessGrid, node_id_of, partition_node_configs\n"
        f"config, _ = load_config({str(DEFAULT_CONFIG)!r})\n"
        "app = FedclusterClientApp(Experiment(config))\n"
        "grid = InProcessGrid(app, partition_node_configs(config.partition.num_clients))\n"
        "answers = {}\n"
        "for name, (task, _) in registry.HANDLERS.items():\n"
        "    content = RecordDict({'config': ConfigRecord({'server-round': 1})})\n"
        "    (reply,) = grid.send_and_receive([Message(content, node_id_of(0), task.message_type)])\n"
        "    answers[name] = reply.error.reason\n"
        "print(json.dumps({'before': before, 'tasks': list(registry.HANDLERS), 'answers': answers,\n"
        "                  'types': sorted(app._registered_funcs)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == ["train", "evaluate"]
    assert {"train_select", "select", "gram_eigen", "relevance", "gossip_train"} <= set(result["tasks"])
    assert {"train.default", "evaluate.default", "query.identify", "train.train_select", "query.select",
            "query.gram_eigen", "query.relevance", "train.gossip_train"} <= set(result["types"])
    for name in result["tasks"]:
        assert result["answers"][name].startswith(f"ProtocolError: task {name!r}: missing ["), result["answers"][name]


def test_fault_injection_fails_only_in_its_rounds(cfg, grid):
    with pytest.raises(ClientFailed, match="SimulatedClientFailure: client 2 fails in round 4"):
        fit(grid, 2, protocol.TRAIN, 4, Experiment(cfg).weights())
    fit(grid, 2, protocol.TRAIN, 3, Experiment(cfg).weights())
    evaluate(grid, 2, Experiment(cfg).weights())  # evaluation never fails on purpose


def test_label_swapped_clients_see_their_group_labels(cfg):
    """Group 1 swaps labels 2 and 3: its client's test labels are relabelled accordingly."""
    pool, partition = Experiment(cfg).data()
    pid = int(np.flatnonzero(partition.true_clusters == 1)[0])
    client = Experiment(cfg).client(pid, cfg.partition.num_clients)
    original = pool.labels[partition.test_indices[pid]]
    seen = client.data.y_test.numpy()
    swap = {2: 3, 3: 2}
    assert seen.tolist() == [swap.get(int(y), int(y)) for y in original]


def test_partition_id_outside_the_partition_is_refused(cfg):
    with pytest.raises(ValueError, match="partition-id 99"):
        Experiment(cfg).client(99, 100)


def test_a_received_model_is_a_trainable_copy_of_the_arrays_in_the_models_dtypes(cfg):
    """Built on the meta device and assigned: real CPU float32 parameters that train, a float64
    array does not turn a layer float64, and training never writes into the received arrays."""
    client = Experiment(cfg).client(0, cfg.partition.num_clients)
    arrays = [a.astype(np.float64) for a in Experiment(cfg).weights()]
    kept = [a.copy() for a in arrays]
    model = client.load_model(arrays)
    assert {(p.device.type, p.dtype, p.requires_grad) for p in model.parameters()} == {("cpu", torch.float32, True)}
    client.train_model(model, 1)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, kept))
    assert not all(np.allclose(a, b) for a, b in zip(get_weights(model), kept))
