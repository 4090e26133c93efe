"""``strategy.round_order`` of the gossip family: ``synchronous`` (every client merges the models the
round before left) and ``sequential`` (the DAC reference code's round: the clients take turns in a
shuffled order, each merging its neighbours' current models)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.algorithms.dac.strategy import DACOptions, DAC, GossipOptions, RandomGossip
from fedcluster_flwr.config.load import load_config, parse_override
from helpers import Received, synthetic_grid, connect_test_run, flat, make_setup, random_weights, synthetic_round


def three_clients(tmp_path, round_order: str, cls=RandomGossip, options_class=GossipOptions):
    """Three pretrained clients with different models, each drawing both others every round."""
    setup = make_setup(tmp_path, 3, train_sizes=[10, 10, 10], init_weights=random_weights)
    strategy = cls(options_class(num_neighbours=2, round_order=round_order), setup)
    strategy.pretrained[:] = True
    return strategy


def plus_one(client: Received):
    """A synthetic gossip client: its own model plus one, and a loss for each neighbour."""
    metrics = {protocol.indexed(protocol.LOSS, j): 1.0 for j in range(len(client.peers))}
    return [a + 1.0 for a in client.models[0]], 10, metrics


def test_sequential_clients_receive_the_models_their_neighbours_trained_earlier_in_the_round(tmp_path):
    strategy = three_clients(tmp_path, "sequential")
    manager = synthetic_grid(3)
    orders = []
    for rnd in range(1, 6):
        start = {p: flat(m).copy() for p, m in strategy.client_models.items()}
        received = synthetic_round(strategy, manager, rnd, plus_one)
        order = list(received)  # the order the clients were called in
        orders.append(order)
        assert sorted(order) == [0, 1, 2]
        for position, pid in enumerate(order):
            client = received[pid]
            np.testing.assert_array_equal(flat(client.models[0]), start[pid])  # its own, as the round began
            for model, peer in zip(client.models[1:], client.peers, strict=True):
                trained_before = peer in order[:position]
                np.testing.assert_array_equal(flat(model), start[peer] + (1.0 if trained_before else 0.0))
        for pid in range(3):
            np.testing.assert_array_equal(flat(strategy.client_models[pid]), start[pid] + 1.0)
    assert any(order != [0, 1, 2] for order in orders)  # shuffled, not partition-id order


def test_the_sequential_order_is_drawn_from_the_seed_and_the_round(tmp_path):
    orders = []
    for folder in ("a", "b"):
        strategy = three_clients(tmp_path / folder, "sequential")
        manager = synthetic_grid(3)
        orders.append([list(synthetic_round(strategy, manager, rnd, plus_one)) for rnd in range(1, 8)])
    assert orders[0] == orders[1]
    assert len({tuple(order) for order in orders[0]}) > 1


def test_synchronous_clients_receive_the_models_of_the_round_before(tmp_path):
    strategy = three_clients(tmp_path, "synchronous")
    manager = synthetic_grid(3)
    for rnd in (1, 2):
        start = {p: flat(m).copy() for p, m in strategy.client_models.items()}
        received = synthetic_round(strategy, manager, rnd, plus_one)
        assert list(received) == [0, 1, 2]
        for pid, client in received.items():
            for model, peer in zip(client.models[1:], client.peers, strict=True):
                np.testing.assert_array_equal(flat(model), start[peer])


def test_a_sequential_round_records_like_a_synchronous_one(tmp_path):
    """The same relay state and the same row keys; every exchange counted once, failures too."""
    rows = {}
    for order in ("synchronous", "sequential"):
        strategy = three_clients(tmp_path / order, order, DAC, DACOptions)
        manager = synthetic_grid(3)
        synthetic_round(strategy, manager, 1, plus_one, fail=[1])
        synthetic_round(strategy, manager, 2, plus_one)
        rows[order] = connect_test_run(strategy).recorder.rows
        assert strategy.exchanges == 2 and strategy.communication.sum() == 2 * 2 + 3 * 2
        assert strategy.met[[0, 2]].sum() == 4 and np.isfinite(strategy.similarity[[0, 2]]).sum() == 4
    for sync, seq in zip(rows["synchronous"], rows["sequential"], strict=True):
        assert sync.keys() == seq.keys()
        for key in ("fit_clients", "fit_failures", "rejected_updates", "bytes_up", "bytes_down", "pairs_met", "exchanges"):
            assert sync[key] == seq[key], key


def test_a_round_of_turns_sends_one_message_at_a_time(tmp_path):
    """A grid sends what it is given: a sequential round is one exchange per client, each made after
    the previous reply was absorbed, so it plays on every grid (Flower's, ours)."""
    strategy = three_clients(tmp_path, "sequential")
    grid = synthetic_grid(3)
    exchanges = []
    send = grid.send_and_receive

    def counted(messages, timeout=None):
        messages = list(messages)
        exchanges.append(len(messages))
        return send(messages, timeout=timeout)

    grid.send_and_receive = counted
    synthetic_round(strategy, grid, 1, plus_one)
    synthetic_round(strategy, grid, 2, plus_one)
    # round 1: who is who (3 queries), 3 turns, 3 evaluations; round 2: 3 turns, 3 evaluations
    assert exchanges == [3, 1, 1, 1, 3, 1, 1, 1, 3]


@pytest.mark.parametrize("engine", ["ray", "batched", "inprocess"])
def test_sequential_rounds_are_accepted_on_every_engine(engine):
    overrides = ("strategy.name=dac", "strategy.round_order=sequential", f"simulation.engine={engine}")
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    assert config.strategy.options.round_order == "sequential" and config.simulation.engine == engine


def test_sequential_dac_runs_on_real_clients_alike_on_both_in_process_engines(tmp_path):
    """On digits: pretraining then sequential exchanges; nothing refused, every client trained every
    round; the batched engine (one client per exchange) makes the same decisions as inprocess."""
    from fedcluster_flwr.apps.server_app import run_in_process

    overrides = ("rounds=3", "partition.name=rotation", "partition.angles=[0,180]", "partition.cluster_sizes=[6,4]",
                 "partition.num_clients=10", "strategy.name=dac", "strategy.client_fraction=1.0",
                 "strategy.num_neighbours=2", "strategy.round_order=sequential", "client.epochs=1")
    runs = {}
    for engine in ("inprocess", "batched"):
        config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*overrides, f"simulation.engine={engine}")])
        runs[engine] = strategy = run_in_process(config, tmp_path / engine)
        rows = strategy.observer.recorder.rows
        assert [r["phase"] for r in rows] == ["pretrain", "dac", "dac"]
        assert all(r["fit_clients"] == list(range(10)) and r["rejected_updates"] + r["fit_failures"] == 0 for r in rows)
        assert strategy.communication.sum() == 2 * 10 * 2 and np.isfinite(rows[-1]["mean_train_loss"])
    np.testing.assert_array_equal(runs["inprocess"].communication, runs["batched"].communication)
    assert runs["inprocess"].assignment.tolist() == runs["batched"].assignment.tolist()


@pytest.mark.slow
def test_sequential_dac_on_flowers_ray_engine_makes_the_in_process_engines_decisions(tmp_path):
    """Through Flower's simulation runtime the turns travel one message at a time, as on our grids:
    the same neighbours drawn, the same clusters, the same rounds."""
    from fedcluster_flwr.apps.server_app import run_in_process
    from fedcluster_flwr.results.run_files import read_rounds
    from fedcluster_flwr.runner import run_experiment
    from trajectories import KEYS

    overrides = ("rounds=3", "partition.name=rotation", "partition.angles=[0,180]", "partition.cluster_sizes=[4,2]",
                 "partition.num_clients=6", "strategy.name=dac", "strategy.client_fraction=1.0",
                 "strategy.num_neighbours=2", "strategy.round_order=sequential", "client.epochs=1")
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    in_process = run_in_process(config, tmp_path / "inprocess")
    run_experiment(config, tmp_path / "ray")
    ray_rows = read_rounds(tmp_path / "ray")
    assert [r["fit_clients"] for r in ray_rows] == [list(range(6))] * 3
    for ours, theirs in zip(in_process.observer.recorder.rows, ray_rows, strict=True):
        assert {k: ours[k] for k in KEYS} == {k: theirs[k] for k in KEYS}, ours["round"]
    np.testing.assert_array_equal(np.load(tmp_path / "ray" / "communication.npy"), in_process.communication)
