"""DAC and the gossip baselines: neighbour sampling, the relay's similarities and two-hop
estimates, the client's merge, and model selection on a validation split."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.client import TaskInput, merge_neighbours_and_train
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.experiment import experiment_data, initial_weights, make_client
from fedcluster_flwr.protocol import LAYOUT_KEY, MODELS, TASK_KEY
from fedcluster_flwr.strategies.dac import DAC, DACOptions, DACVar, DACVarOptions, GossipOptions, OracleGossip, RandomGossip, two_hop_similarities
from fedcluster_flwr.strategies.fedavg import LocalOnly, LocalOptions
from test_strategies import DIM, SHAPES, client_manager, flat, make_setup, unflatten

N = 8
TRUE = np.array([0, 0, 0, 0, 0, 0, 1, 1])


def init_weights(seed):
    return unflatten(np.random.default_rng(seed).normal(size=DIM))


def gossip(cls, tmp_path, options, **extra):
    setup = make_setup(tmp_path, N, true=TRUE, train_sizes=[10 * (p + 1) for p in range(N)],
                       init_weights=init_weights, **extra)
    return cls(options, setup)


def play(strategy, manager, rnd, loss=lambda i, j: 1.0 + abs(int(TRUE[i]) - int(TRUE[j]))):
    """One round with synthetic clients: neighbour j's loss on i's data is ``loss(i, j)``."""
    received = {}
    results = []
    for proxy, ins in strategy.configure_fit(rnd, None, manager):
        models = protocol.unpack(parameters_to_ndarrays(ins.parameters), ins.config[LAYOUT_KEY])[MODELS]
        chosen = list(strategy._sent[proxy.pid][0].clusters)
        received[proxy.pid] = (ins.config[TASK_KEY], models, chosen, dict(ins.config))
        metrics = {protocol.indexed(protocol.LOSS, j): loss(proxy.pid, q) for j, q in enumerate(chosen)}
        new = [a + 1.0 for a in models[0]]
        results.append((proxy, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new), 10, metrics)))
    strategy.aggregate_fit(rnd, results, [])
    evals = [(p, EvaluateRes(Status(Code.OK, ""), 0.5, 5, {protocol.ACCURACY: 0.5}))
             for p, _ in strategy.configure_evaluate(rnd, None, manager)]
    strategy.aggregate_evaluate(rnd, evals, [])
    return received


def test_neighbours_are_never_the_client_itself_respect_m_and_are_seeded(tmp_path):
    picks = []
    for folder in ("a", "b"):
        strategy = gossip(RandomGossip, tmp_path / folder, GossipOptions(num_neighbours=3))
        strategy.directory.online = list(range(N))
        picks.append([strategy.neighbours(1, pid) for pid in range(N) for _ in range(20)])
    assert picks[0] == picks[1]
    for k, chosen in enumerate(picks[0]):
        pid = k // 20
        assert len(chosen) == 3 == len(set(chosen)) and pid not in chosen


def test_a_very_large_tau_picks_the_most_similar_clients(tmp_path):
    strategy = gossip(DAC, tmp_path, DACOptions(num_neighbours=2, tau=1e4, two_hop=False))
    strategy.directory.online = list(range(N))
    strategy.similarity[0] = [np.nan, 0.1, 0.9, 0.2, 0.8, 0.3, 0.1, 0.1]
    strategy.met[0] = ~np.isnan(strategy.similarity[0])
    strategy.estimate = strategy.effective_similarity()
    for _ in range(10):
        assert sorted(strategy.neighbours(2, 0)) == [2, 4]


def test_round_one_is_uniform_and_the_relay_records_one_over_loss(tmp_path):
    strategy = gossip(DAC, tmp_path, DACOptions(num_neighbours=3))
    manager = client_manager(N)
    before = {p: flat(m).copy() for p, m in strategy.client_models.items()}
    received = play(strategy, manager, 1)
    assert set(received) == set(range(N))  # client_fraction 1.0
    for pid, (task, models, chosen, config) in received.items():
        assert task == protocol.GOSSIP_TRAIN.name and len(models) == 4
        for model, owner in zip(models, [pid, *chosen], strict=True):  # its own mailbox, then the neighbours'
            np.testing.assert_array_equal(flat(model), before[owner])
        assert [config[protocol.indexed(protocol.SAMPLES_KEY, j)] for j in range(3)] == [10 * (q + 1) for q in chosen]
        for q in chosen:
            assert strategy.similarity[pid, q] == pytest.approx(1.0 / (1.0 + abs(int(TRUE[pid]) - int(TRUE[q]))))
            assert strategy.met[pid, q] and strategy.communication[pid, q] == 1
    assert strategy.communication.sum() == 3 * N
    np.testing.assert_array_equal(flat(strategy.client_models[3]), flat(received[3][1][0]) + 1.0)


def test_two_hop_lends_the_most_similar_neighbours_estimate():
    nan = np.nan
    similarity = np.array([
        [nan, 0.9, 0.2, nan],  # 0 met 1 (similar) and 2 (not); never 3
        [0.9, nan, nan, 0.7],  # 1 met 3
        [0.2, nan, nan, 0.1],  # 2 met 3
        [nan, nan, nan, nan],
    ])
    met = ~np.isnan(similarity)
    filled = two_hop_similarities(similarity, met)
    assert filled[0, 3] == 0.7  # from 1, 0's most similar neighbour that met 3 (not 2's 0.1)
    assert filled[0, 1] == 0.9 and np.isnan(filled[3, 0])  # measured kept; 3 met nobody
    assert filled[1, 2] == 0.2  # 1 met 0 (0.9) and 3 (0.7); 0, the more similar, met 2: s_02
    assert np.isnan(filled[0, 0])


def test_dac_samples_the_own_cluster_once_similarities_are_known(tmp_path):
    strategy = gossip(DAC, tmp_path, DACOptions(num_neighbours=2, tau=50.0))
    manager = client_manager(N)
    for rnd in range(1, 11):
        play(strategy, manager, rnd)
    assert strategy.met[6, 7] and strategy.similarity[6, 7] == 1.0 and strategy.similarity[6, 0] == 0.5
    late = [strategy.neighbours(11, 6) for _ in range(30)]
    assert all(7 in chosen for chosen in late)  # the only other client of its cluster, every time
    assert strategy.assignment.tolist() in (TRUE.tolist(), (1 - TRUE).tolist())  # implied clusters


def test_a_client_that_has_not_joined_is_never_a_neighbour(tmp_path):
    strategy = gossip(RandomGossip, tmp_path, GossipOptions(num_neighbours=3), join_round={5: 3})
    manager = client_manager(N)
    for rnd in (1, 2):
        received = play(strategy, manager, rnd)
        assert 5 not in received and all(5 not in chosen for _, _, chosen, _ in received.values())
    received = play(strategy, manager, 3)
    assert 5 in received
    assert any(5 in chosen for rnd in range(4, 9) for _, _, chosen, _ in play(strategy, manager, rnd).values())


def test_oracle_gossip_stays_inside_the_true_cluster(tmp_path):
    strategy = gossip(OracleGossip, tmp_path, GossipOptions(num_neighbours=3))
    strategy.directory.online = list(range(N))
    for pid in range(N):
        chosen = strategy.neighbours(1, pid)
        assert all(TRUE[q] == TRUE[pid] for q in chosen) and pid not in chosen
    assert len(strategy.neighbours(1, 6)) == 1  # client 6 has a single cluster mate


def test_dac_var_grows_tau_from_near_zero_to_tau_max(tmp_path):
    strategy = gossip(DACVar, tmp_path, DACVarOptions(tau_max=30.0), rounds=50)
    taus = [strategy.tau(r) for r in range(1, 51)]
    assert taus[0] < 0.02 * 30 and taus[-1] > 0.99 * 30 and all(np.diff(taus) > 0)


def test_personal_models_start_apart_or_together(tmp_path):
    apart = gossip(RandomGossip, tmp_path / "a", GossipOptions())
    together = gossip(RandomGossip, tmp_path / "b", GossipOptions(same_init=True))
    assert not np.array_equal(flat(apart.client_models[1]), flat(apart.client_models[2]))
    assert all(np.array_equal(flat(together.client_models[p]), flat(together.client_models[0])) for p in range(N))


def test_local_never_receives_another_clients_model(tmp_path):
    strategy = LocalOnly(LocalOptions(), make_setup(tmp_path, N))
    for pid in range(N):
        strategy.client_models[pid] = [np.full(s, float(pid), np.float32) for s in SHAPES]
    for proxy, ins in strategy.configure_fit(1, None, client_manager(N)):
        (model,) = protocol.unpack(parameters_to_ndarrays(ins.parameters), ins.config[LAYOUT_KEY])[MODELS]
        assert all(np.all(a == proxy.pid) for a in model)


def test_the_client_merges_own_and_neighbours_by_sample_counts(monkeypatch):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override("strategy.name=fedavg")])
    client = make_client(config, 0, config.partition.num_clients)
    monkeypatch.setattr(type(client), "train_model", lambda self, model, rnd: 0.0)  # keep the merge visible
    shapes = [a.shape for a in initial_weights(config)]
    own = [np.full(s, 1.0, np.float32) for s in shapes]
    neighbours = [[np.full(s, 4.0, np.float32) for s in shapes], [np.full(s, 10.0, np.float32) for s in shapes]]
    inputs = TaskInput(3, {MODELS: [own, *neighbours]}, {"samples_0": 2 * client.num_train, "samples_1": client.num_train})
    output = merge_neighbours_and_train(client, inputs)
    expected = (1.0 * 1 + 4.0 * 2 + 10.0 * 1) / 4
    np.testing.assert_allclose(output.blocks[protocol.MODEL][0], expected, rtol=1e-6)
    assert output.metrics["loss_0"] > 0 and output.metrics["loss_1"] > 0 and "loss_2" not in output.metrics


def test_a_validation_split_is_held_out_of_training_and_selects_the_reported_model(tmp_path):
    overrides = ["strategy.name=fedavg", "partition.val_fraction=0.1"]
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    plain, _ = load_config(DEFAULT_CONFIG, [parse_override("strategy.name=fedavg")])
    with_val, without = experiment_data(config)[1], experiment_data(plain)[1]
    for pid in range(config.partition.num_clients):
        np.testing.assert_array_equal(with_val.test_indices[pid], without.test_indices[pid])
        assert set(with_val.train_indices[pid]) | set(with_val.val_indices[pid]) == set(without.train_indices[pid])
        assert not set(with_val.train_indices[pid]) & set(with_val.val_indices[pid])
        total = len(without.train_indices[pid]) + len(without.test_indices[pid])
        assert len(with_val.val_indices[pid]) == round(total * 0.1)
    assert without.val_indices == ()

    strategy = gossip(RandomGossip, tmp_path, GossipOptions())
    manager = client_manager(N)
    strategy.configure_fit(1, None, manager)
    for rnd, (val_loss, accuracy) in enumerate([(0.9, 0.5), (0.4, 0.7), (0.6, 0.9)], start=1):
        evals = [(p, EvaluateRes(Status(Code.OK, ""), 0.5, 5, {protocol.ACCURACY: accuracy, protocol.VAL_LOSS: val_loss}))
                 for p, _ in strategy.configure_evaluate(rnd, None, manager)]
        strategy.aggregate_evaluate(rnd, evals, [])
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["mean_client_accuracy"] for r in rows] == [0.5, 0.7, 0.9]
    assert [r["mean_best_val_accuracy"] for r in rows] == [0.5, 0.7, 0.7]  # round 2's model kept the lowest val loss
    assert rows[-1]["per_true_cluster_best_val_accuracy"] == pytest.approx({"0": 0.7, "1": 0.7})
