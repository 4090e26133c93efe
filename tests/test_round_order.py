"""``strategy.round_order`` of the gossip family: ``synchronous`` (every client merges the models the
round before left) and ``sequential`` (the DAC reference code's round: the clients take turns in a
shuffled order, each merging its neighbours' current models)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.algorithms.dac.strategy import DACOptions, DAC, GossipOptions, RandomGossip
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.engines.inprocess import play_round
from fedcluster_flwr.schema import ConfigError
from helpers import Received, client_manager, connect_test_run, flat, make_setup, random_weights, synthetic_round


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
    manager = client_manager(3)
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
        manager = client_manager(3)
        orders.append([list(synthetic_round(strategy, manager, rnd, plus_one)) for rnd in range(1, 8)])
    assert orders[0] == orders[1]
    assert len({tuple(order) for order in orders[0]}) > 1


def test_synchronous_clients_receive_the_models_of_the_round_before(tmp_path):
    strategy = three_clients(tmp_path, "synchronous")
    manager = client_manager(3)
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
        manager = client_manager(3)
        synthetic_round(strategy, manager, 1, plus_one, fail=[1])
        synthetic_round(strategy, manager, 2, plus_one)
        rows[order] = connect_test_run(strategy).recorder.rows
        assert strategy.exchanges == 2 and strategy.communication.sum() == 2 * 2 + 3 * 2
        assert strategy.met[[0, 2]].sum() == 4 and np.isfinite(strategy.similarity[[0, 2]]).sum() == 4
    for sync, seq in zip(rows["synchronous"], rows["sequential"], strict=True):
        assert sync.keys() == seq.keys()
        for key in ("fit_clients", "fit_failures", "rejected_updates", "bytes_up", "bytes_down", "pairs_met", "exchanges"):
            assert sync[key] == seq[key], key


def test_sequential_rounds_refuse_to_run_as_flowers_synchronous_round(tmp_path):
    """On an engine that instructs every client at once (Ray), the strategy refuses rather than
    playing a synchronous round under the name sequential."""
    strategy = three_clients(tmp_path, "sequential")
    connect_test_run(strategy)
    with pytest.raises(RuntimeError, match="strategy.round_order: sequential.*simulation.engine: inprocess"):
        strategy.configure_fit(1, None, client_manager(3))
    with pytest.raises(ValueError, match="batched engine: set simulation.engine: inprocess"):
        play_round(strategy, client_manager(3), 1, rendezvous=object())


@pytest.mark.parametrize("engine", ["ray", "batched"])
def test_sequential_needs_the_inprocess_engine(engine):
    overrides = ("strategy.name=dac", "strategy.round_order=sequential", f"simulation.engine={engine}")
    with pytest.raises(ConfigError, match=r"^strategy.round_order: .*one after another, which only simulation.engine "
                                          rf"inprocess can do \(simulation.engine is {engine}\): set simulation.engine: inprocess"):
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*overrides[:2], "simulation.engine=inprocess")])
    assert config.strategy.options.round_order == "sequential"


def test_sequential_dac_runs_on_real_clients(tmp_path):
    """In process on digits: pretraining then sequential exchanges; nothing refused, every client
    trained every round."""
    from fedcluster_flwr.engines.inprocess import run_in_process

    overrides = ("rounds=3", "partition.name=rotation", "partition.angles=[0,180]", "partition.cluster_sizes=[6,4]",
                 "partition.num_clients=10", "strategy.name=dac", "strategy.client_fraction=1.0",
                 "strategy.num_neighbours=2", "strategy.round_order=sequential", "simulation.engine=inprocess",
                 "client.epochs=1")
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    strategy = run_in_process(config, tmp_path / "run")
    rows = strategy.observer.recorder.rows
    assert [r["phase"] for r in rows] == ["pretrain", "dac", "dac"]
    assert all(r["fit_clients"] == list(range(10)) and r["rejected_updates"] + r["fit_failures"] == 0 for r in rows)
    assert strategy.communication.sum() == 2 * 10 * 2 and np.isfinite(rows[-1]["mean_train_loss"])
