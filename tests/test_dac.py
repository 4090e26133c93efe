"""DAC and the gossip baselines: neighbour sampling, the relay's similarities and two-hop
estimates, the client's merge, and model selection on a validation split."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.client import TaskInput
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.protocol import MODEL, MODELS
from fedcluster_flwr.algorithms.dac.math import (
    centred_tau, reference_tau, reference_two_hop_update, same_true_cluster_share, two_hop_similarities,
)
from fedcluster_flwr.algorithms.dac.pens import PENS
from fedcluster_flwr.algorithms.dac.strategy import (
    DAC, DACOptions, DACVar, DACVarOptions, GossipOptions, OracleGossip, PENSOptions, RandomGossip,
)
from fedcluster_flwr.algorithms.baselines.strategy import LocalOnly, LocalOptions
from fedcluster_flwr.algorithms.dac.tasks import GOSSIP_TRAIN, MERGE_LOWEST_KEY, SAMPLES_KEY, merge_neighbours_and_train
from helpers import load_benchmark, connect_test_run, Received, SyntheticClient, synthetic_grid, constant_model, synthetic_round, flat, make_setup, random_weights

N = 8
TRUE = np.array([0, 0, 0, 0, 0, 0, 1, 1])


def gossip(cls, tmp_path, options, pretrained=True, **extra):
    """A gossip strategy over N synthetic clients; ``pretrained``: every client is past its
    pretraining (round 1 exchanges), for the tests of the exchanges themselves."""
    setup = make_setup(tmp_path, N, true=TRUE, train_sizes=[10 * (p + 1) for p in range(N)],
                       init_weights=random_weights, **extra)
    strategy = cls(options, setup)
    if pretrained:
        strategy.pretrained[:] = True
    return strategy


def loss_by_true_cluster(i: int, j: int) -> float:
    """Neighbour j's loss on client i's data: 1 within i's true cluster, 2 across."""
    return 1.0 + abs(int(TRUE[i]) - int(TRUE[j]))


def gossip_client(loss=loss_by_true_cluster) -> SyntheticClient:
    """A synthetic gossip client: it reports ``loss(i, j)`` for each neighbour j whose model it
    received, and returns its own model plus one."""

    def reply(client: Received):
        metrics = {protocol.indexed(protocol.LOSS, j): loss(client.pid, q) for j, q in enumerate(client.peers)}
        return [a + 1.0 for a in client.models[0]], 10, metrics

    return reply


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
    manager = synthetic_grid(N)
    before = {p: flat(m).copy() for p, m in strategy.client_models.items()}
    received = synthetic_round(strategy, manager, 1, gossip_client())
    assert set(received) == set(range(N))  # client_fraction 1.0
    for pid, client in received.items():
        assert client.task == GOSSIP_TRAIN.name and len(client.models) == 4
        for model, owner in zip(client.models, [pid, *client.peers], strict=True):  # its own mailbox, then the neighbours'
            np.testing.assert_array_equal(flat(model), before[owner])
        assert [client.config[protocol.indexed(SAMPLES_KEY, j)] for j in range(3)] == [10 * (q + 1) for q in client.peers]
        for q in client.peers:
            assert strategy.similarity[pid, q] == pytest.approx(1.0 / (1.0 + abs(int(TRUE[pid]) - int(TRUE[q]))))
            assert strategy.met[pid, q] and strategy.communication[pid, q] == 1
    assert strategy.communication.sum() == 3 * N
    np.testing.assert_array_equal(flat(strategy.client_models[3]), flat(received[3].models[0]) + 1.0)


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
    manager = synthetic_grid(N)
    for rnd in range(1, 11):
        synthetic_round(strategy, manager, rnd, gossip_client())
    assert strategy.met[6, 7] and strategy.similarity[6, 7] == 1.0 and strategy.similarity[6, 0] == 0.5
    late = [strategy.neighbours(11, 6) for _ in range(30)]
    assert all(7 in chosen for chosen in late)  # the only other client of its cluster, every time
    assert strategy.assignment.tolist() in (TRUE.tolist(), (1 - TRUE).tolist())  # implied clusters
    share = strategy.summary_entries()["exchanges_same_true_cluster"]
    counts = strategy.communication
    for cluster in (0, 1):
        rows = counts[TRUE == cluster]
        assert share[str(cluster)] == rows[:, TRUE == cluster].sum() / rows.sum()
    assert share["0"] > 0.9  # with tau = 50, almost every draw after the first rounds is a cluster mate


def test_the_same_cluster_share_reads_each_clusters_rows_and_leaves_out_silent_clusters():
    counts = np.array([[0, 3, 1, 0], [1, 0, 0, 0], [2, 2, 0, 4], [0, 0, 0, 0]])
    share = same_true_cluster_share(counts, np.array([0, 0, 1, 1]))
    assert share == {"0": 4 / 5, "1": 4 / 8}
    assert same_true_cluster_share(counts, np.array([0, 0, 1, 2])) == {"0": 4 / 5, "1": 0.0}  # 2 drew nobody
    assert same_true_cluster_share(np.ones((4, 4), dtype=bool) & ~np.eye(4, dtype=bool), np.array([0, 0, 1, 1])) == {
        "0": 1 / 3, "1": 1 / 3}  # uniform over the others


def test_a_client_that_has_not_joined_is_never_a_neighbour(tmp_path):
    strategy = gossip(RandomGossip, tmp_path, GossipOptions(num_neighbours=3), join_round={5: 3})
    manager = synthetic_grid(N)
    for rnd in (1, 2):
        received = synthetic_round(strategy, manager, rnd, gossip_client())
        assert 5 not in received and all(5 not in client.peers for client in received.values())
    received = synthetic_round(strategy, manager, 3, gossip_client())
    assert 5 in received
    assert any(5 in client.peers for rnd in range(4, 9) for client in synthetic_round(strategy, manager, rnd, gossip_client()).values())


def test_a_client_with_no_ready_peer_draws_no_neighbour(tmp_path):
    strategy = gossip(DAC, tmp_path, DACOptions(num_neighbours=3))
    strategy.directory.online = list(range(N))
    strategy.pretrained[1:] = False  # only client 0 is past its pretraining: nobody to draw
    assert strategy.neighbours(2, 0) == []
    strategy.pretrained[5] = True
    assert strategy.neighbours(2, 0) == [5]


def test_dac_scores_a_peer_by_tau_times_its_estimate_and_an_unknown_one_as_zero(tmp_path):
    strategy = gossip(DAC, tmp_path, DACOptions(tau=30.0))
    strategy.estimate = np.full((N, N), np.nan)
    strategy.estimate[0, 1] = 0.5
    np.testing.assert_array_equal(strategy.neighbour_scores(2, 0, np.array([1, 2])), [15.0, 0.0])


def test_dac_var_centred_scores_and_records_the_tau_of_the_server_round(tmp_path):
    """The centred schedule is a function of the server round, in either round order."""
    for order in ("synchronous", "sequential"):
        options = DACVarOptions(num_neighbours=2, tau_max=30.0, tau_schedule="centred", round_order=order)
        strategy = gossip(DACVar, tmp_path / order, options, rounds=20)
        manager = synthetic_grid(N)
        for rnd in (1, 2, 3):
            synthetic_round(strategy, manager, rnd, gossip_client())
        rows = [json.loads(line) for line in (tmp_path / order / "rounds.jsonl").read_text().splitlines()]
        assert [r["tau"] for r in rows] == pytest.approx([centred_tau(rnd, 30.0, 20) for rnd in (1, 2, 3)])
        estimate = np.nan_to_num(strategy.estimate[0, [1, 2]], nan=0.0)
        np.testing.assert_array_equal(strategy.neighbour_scores(7, 0, np.array([1, 2])), centred_tau(7, 30.0, 20) * estimate)


def test_the_implied_clusters_read_a_pair_known_one_way_and_put_unknown_pairs_farthest(tmp_path):
    """Average linkage of the losses 1 / s into the number of true clusters: a pair measured both ways at
    their mean, one way at that loss, never at the largest known loss."""
    nan = np.nan
    loss = np.array([
        [nan, 0.5, 3.0, 4.0],
        [1.5, nan, nan, nan],  # 0 and 1 measured each other (mean 1.0); 1 never met 2 or 3
        [nan, nan, nan, nan],  # 2 measured nobody
        [nan, nan, 0.4, nan],  # 3 measured 2 only: the pair (2, 3) is known one way
    ])
    strategy = gossip(DAC, tmp_path, DACOptions())
    strategy.num_true_clusters = 2
    strategy.estimate = 1.0 / loss
    assert strategy.implied_clusters().tolist() == [0, 0, 1, 1]
    loss[0, 1] = nan  # now (0, 1) is known one way, through 1's row: 1.5
    strategy.estimate = 1.0 / loss
    assert strategy.implied_clusters().tolist() == [0, 0, 1, 1]
    loss[1, 0], loss[0, 3] = 3.5, 1.0  # 0 is closer to 3 (1.0) than to 1 (3.5); 1 is unknown to all but 0
    strategy.estimate = 1.0 / loss
    assert strategy.implied_clusters().tolist() == [0, 1, 0, 0]
    strategy.num_true_clusters = 3
    assert strategy.implied_clusters().tolist() == [0, 1, 2, 2]


def test_oracle_gossip_stays_inside_the_true_cluster(tmp_path):
    strategy = gossip(OracleGossip, tmp_path, GossipOptions(num_neighbours=3))
    strategy.directory.online = list(range(N))
    for pid in range(N):
        chosen = strategy.neighbours(1, pid)
        assert all(TRUE[q] == TRUE[pid] for q in chosen) and pid not in chosen
    assert len(strategy.neighbours(1, 6)) == 1  # client 6 has a single cluster mate
    synthetic_round(strategy, synthetic_grid(N), 1, gossip_client())
    assert strategy.summary_entries()["exchanges_same_true_cluster"] == {"0": 1.0, "1": 1.0}


def test_the_reference_tau_schedule_is_tau_tanh_of_a_tenth_of_the_round_plus_one():
    """The reference code's tau_function(t, a=τ, b=0.2) = 2a / (1 + e^(−0.2 t)) − a + 1."""
    for t in (0, 1, 5, 10, 25, 60):
        assert reference_tau(t, 30.0) == pytest.approx(2 * 30 / (1 + np.exp(-0.2 * t)) - 30 + 1, abs=1e-12)
    assert reference_tau(0, 30.0) == 1.0
    assert reference_tau(10, 30.0) == pytest.approx(30 * np.tanh(1.0) + 1)  # ≈ 23.8
    assert 23.5 < reference_tau(10, 30.0) < 24.0 and 30.0 < reference_tau(25, 30.0) < 31.0
    # the centred schedule it replaces as the default: ≈ 0.5 at round 10 of 100
    assert centred_tau(10, 30.0, 100) == pytest.approx(30 / (1 + np.exp(4.0)))
    assert 0.4 < centred_tau(10, 30.0, 100) < 0.6 and centred_tau(50, 30.0, 100) == 15.0


def test_dac_var_draws_each_exchange_with_the_tau_of_the_one_before(tmp_path):
    """After the pretraining round, exchange e (0-based) draws with τ(e − 1): the weights the
    reference code's client computed at the end of its previous exchange (the first draws uniformly)."""
    strategy = gossip(DACVar, tmp_path, DACVarOptions(num_neighbours=2, tau_max=30.0), pretrained=False, rounds=8)
    manager = synthetic_grid(N)
    for rnd in range(1, 9):
        synthetic_round(strategy, manager, rnd, gossip_client())
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["pretrain"] + ["dac_var"] * 7
    assert [r["exchanges"] for r in rows] == list(range(8))
    expected = [reference_tau(max(e - 1, 0), 30.0) for e in range(7)]
    assert [r["tau"] for r in rows[1:]] == pytest.approx(expected)
    assert expected[:3] == [1.0, 1.0, pytest.approx(30 * np.tanh(0.1) + 1)]

    centred = gossip(DACVar, tmp_path / "centred", DACVarOptions(tau_max=30.0, tau_schedule="centred"), rounds=50)
    taus = [centred.tau(r) for r in range(1, 51)]
    assert taus[0] < 0.02 * 30 and taus[-1] > 0.99 * 30 and all(np.diff(taus) > 0)


# ---- pretraining ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("epochs", "sent"), [(None, None), (2, 2)])
def test_every_client_pretrains_alone_before_the_first_exchange_and_only_then(tmp_path, epochs, sent):
    """The reference code trains every client for E epochs before any exchange; here round 1 does
    that (task train, the client's own model; ``epochs`` sent only when it differs from client.epochs)
    and every later round exchanges; a late joiner pretrains in its first round online and is
    nobody's neighbour until then."""
    strategy = gossip(DAC, tmp_path, DACOptions(num_neighbours=2, pretrain_epochs=epochs), pretrained=False,
                      join_round={5: 3})
    manager = synthetic_grid(N)
    before = {p: flat(m).copy() for p, m in strategy.client_models.items()}
    first = synthetic_round(strategy, manager, 1, gossip_client())
    assert sorted(first) == [p for p in range(N) if p != 5]
    for pid, client in first.items():
        assert client.task == protocol.TRAIN.name and client.peers == () and len(client.models) == 1
        np.testing.assert_array_equal(flat(client.models[0]), before[pid])  # its own model, nobody else's
        assert client.config.get(protocol.EPOCHS_KEY) == sent
    assert strategy.communication.sum() == 0 and not strategy.met.any()
    for rnd in (2, 3, 4):
        received = synthetic_round(strategy, manager, rnd, gossip_client())
        tasks = {pid: client.task for pid, client in received.items()}
        if rnd == 2:
            assert 5 not in tasks and all(5 not in client.peers for client in received.values())
        if rnd == 3:  # client 5 joins: it pretrains while the others exchange, and nobody meets it yet
            assert tasks.pop(5) == protocol.TRAIN.name
            assert all(5 not in client.peers for client in received.values())
        assert set(tasks.values()) == {GOSSIP_TRAIN.name}
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["pretrain", "dac", "dac", "dac"]
    assert strategy.pretrained.all() and strategy.communication[5].sum() == 2  # it exchanged in round 4


def test_without_pretraining_round_one_exchanges_untrained_models(tmp_path):
    strategy = gossip(RandomGossip, tmp_path, GossipOptions(pretrain_epochs=0), pretrained=False)
    received = synthetic_round(strategy, synthetic_grid(N), 1, gossip_client())
    assert {client.task for client in received.values()} == {GOSSIP_TRAIN.name}


def test_a_train_instruction_with_epochs_trains_for_that_many_epochs():
    from fedcluster_flwr.client import train_received_model
    from fedcluster_flwr.training import LocalCompute

    seen = []

    class RecordingCompute(LocalCompute):  # how the client's torch work runs: here, recorded
        def train(self, model, x, y, settings, *rest):
            seen.append(settings.epochs)
            return 0.0

    config, _ = load_config(DEFAULT_CONFIG, [parse_override("strategy.name=fedavg")])
    client = Experiment(config).client(0, config.partition.num_clients)
    client.compute = RecordingCompute()
    model = Experiment(config).weights()
    train_received_model(client, TaskInput(1, {MODEL: [model]}, {}))
    train_received_model(client, TaskInput(1, {MODEL: [model]}, {protocol.EPOCHS_KEY: 5}))
    assert seen == [config.client.epochs, 5]


# ---- two-hop estimates: the paper's and the reference code's ----------------------------------------


def test_the_reference_two_hop_takes_this_rounds_neighbours_tables_estimates_included():
    """0 met 1 this round. 1 has measured 2 and holds an *estimate* of 3 (from its own neighbours):
    the reference copies both into 0's table (3 is two hops from 1, three from 0); the paper's rule,
    from measured similarities only, fills 0→2 but not 0→3."""
    nan = np.nan
    table = np.array([
        [nan, 0.8, nan, nan],
        [0.8, nan, 0.6, 0.4],  # 0.4: 1's estimate of 3
        [nan, 0.6, nan, nan],
        [nan, nan, nan, nan],
    ])
    met = np.array([[0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=bool)
    measured = np.where(met, table, nan)
    paper = two_hop_similarities(measured, met)
    assert paper[0, 2] == 0.6 and np.isnan(paper[0, 3])
    reference_two_hop_update(table, met, 0, [1])
    assert table[0, 2] == 0.6 and table[0, 3] == 0.4 and table[0, 1] == 0.8 and np.isnan(table[0, 0])
    # next round 0 meets 2 (measured 0.95, more similar than 1) and 1 again: 3 is overwritten from
    # 2's table, the most similar holder; measured pairs are never overwritten
    table[2, 3], met[0, 2], table[0, 2] = 0.9, True, 0.95
    reference_two_hop_update(table, met, 0, [1, 2])
    assert table[0, 3] == 0.9 and table[0, 2] == 0.95 and table[0, 1] == 0.8


def test_personal_models_start_apart_or_together(tmp_path):
    apart = gossip(RandomGossip, tmp_path / "a", GossipOptions())
    together = gossip(RandomGossip, tmp_path / "b", GossipOptions(same_init=True))
    assert not np.array_equal(flat(apart.client_models[1]), flat(apart.client_models[2]))
    assert all(np.array_equal(flat(together.client_models[p]), flat(together.client_models[0])) for p in range(N))


def test_local_never_receives_another_clients_model(tmp_path):
    strategy = LocalOnly(LocalOptions(), make_setup(tmp_path, N))
    for pid in range(N):
        strategy.client_models[pid] = constant_model(pid)
    received = synthetic_round(strategy, synthetic_grid(N), 1, gossip_client())
    assert sorted(received) == list(range(N))
    for pid, client in received.items():
        (model,) = client.models
        assert all(np.all(a == pid) for a in model)


def test_the_client_merges_own_and_neighbours_by_sample_counts(monkeypatch):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override("strategy.name=fedavg")])
    client = Experiment(config).client(0, config.partition.num_clients)
    monkeypatch.setattr(type(client), "train_model", lambda self, model, rnd: 0.0)  # keep the merge visible
    shapes = [a.shape for a in Experiment(config).weights()]
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
    with_val, without = Experiment(config).data()[1], Experiment(plain).data()[1]
    for pid in range(config.partition.num_clients):
        np.testing.assert_array_equal(with_val.test_indices[pid], without.test_indices[pid])
        assert set(with_val.train_indices[pid]) | set(with_val.val_indices[pid]) == set(without.train_indices[pid])
        assert not set(with_val.train_indices[pid]) & set(with_val.val_indices[pid])
        total = len(without.train_indices[pid]) + len(without.test_indices[pid])
        assert len(with_val.val_indices[pid]) == round(total * 0.1)
    assert without.val_indices == ()

    strategy = gossip(RandomGossip, tmp_path, GossipOptions())
    manager = synthetic_grid(N)
    for rnd, (val_loss, accuracy) in enumerate([(0.9, 0.5), (0.4, 0.7), (0.6, 0.9)], start=1):
        reported = {protocol.ACCURACY: accuracy, protocol.VAL_LOSS: val_loss}
        synthetic_round(strategy, manager, rnd, gossip_client(), evaluate=lambda pid, model, reported=reported: (0.5, reported))
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["mean_client_accuracy"] for r in rows] == [0.5, 0.7, 0.9]
    assert [r["mean_best_val_accuracy"] for r in rows] == [0.5, 0.7, 0.7]  # round 2's model kept the lowest val loss
    assert rows[-1]["per_true_cluster_best_val_accuracy"] == pytest.approx({"0": 0.7, "1": 0.7})


# ---- PENS ---------------------------------------------------------------------------------------------


def test_pens_keeps_the_lowest_loss_peers_then_gossips_only_with_those_kept_more_than_chance(tmp_path):
    """Selection rounds: n = 3 random peers, the m = 1 of lowest loss merged and counted. Then each
    client draws only from the peers it kept more than (m / N) · selection_rounds = 1/8 · 3 times."""
    strategy = gossip(PENS, tmp_path, PENSOptions(num_neighbours=3, num_kept=1, selection_rounds=3))
    manager = synthetic_grid(N)

    def loss(i, j):  # own cluster lower; ties broken by id so the lowest is unique
        return 1.0 + abs(int(TRUE[i]) - int(TRUE[j])) + 0.01 * j

    expected = np.zeros((N, N), dtype=int)
    for rnd in (1, 2, 3):
        for pid, client in synthetic_round(strategy, manager, rnd, gossip_client(loss)).items():
            assert client.task == GOSSIP_TRAIN.name and len(client.peers) == 3 and client.config[MERGE_LOWEST_KEY] == 1
            expected[pid, min(client.peers, key=lambda q: loss(pid, q))] += 1
    np.testing.assert_array_equal(strategy.kept_counts, expected)
    np.testing.assert_array_equal(strategy.neighbour_sets, expected > 1 / N * 3)
    assert strategy.neighbour_sets.any(axis=1).all()  # every client kept someone (3 rounds x 1 > 3/8)
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["pens_selection"] * 3
    for rnd in range(4, 10):
        for pid, client in synthetic_round(strategy, manager, rnd, gossip_client(loss)).items():
            kept = set(np.flatnonzero(strategy.neighbour_sets[pid]).tolist())
            assert set(client.peers) <= kept and len(client.peers) == min(3, len(kept))
            assert MERGE_LOWEST_KEY not in client.config  # every drawn peer is merged
    assert json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])["phase"] == "pens_gossip"
    summary = strategy.summary_entries()
    assert summary["neighbour_sets"] == [np.flatnonzero(row).tolist() for row in expected > 1 / N * 3]
    for cluster in np.unique(TRUE):
        kept = (expected > 1 / N * 3)[TRUE == cluster]
        assert summary["neighbour_set_same_true_cluster"][str(cluster)] == kept[:, TRUE == cluster].sum() / kept.sum()
    # of 3 peers drawn from 5 of its own cluster and 2 others, a cluster-0 client always meets its own
    assert summary["neighbour_set_same_true_cluster"]["0"] == 1.0


def test_pens_selection_candidates_draws_more_peers_while_selecting_and_num_neighbours_after(tmp_path):
    """Onoszko et al.'s own code: n = selection_candidates peers scored per selection round, the
    m lowest kept; afterwards num_neighbours of the kept ones per round. With 7 candidates of the 7
    others every client sees its whole cluster, so it keeps only peers of its own cluster."""
    options = PENSOptions(num_neighbours=1, num_kept=1, selection_rounds=2, selection_candidates=N - 1)
    strategy = gossip(PENS, tmp_path, options)
    manager = synthetic_grid(N)
    for rnd in (1, 2):
        for pid, client in synthetic_round(strategy, manager, rnd, gossip_client(loss_by_true_cluster)).items():
            assert len(client.peers) == N - 1 and client.config[MERGE_LOWEST_KEY] == 1
    kept = strategy.kept_counts > 0
    assert all(TRUE[j] == TRUE[i] for i, j in zip(*np.nonzero(kept)))  # the m lowest: own cluster only
    assert kept.sum(axis=1).min() >= 1
    for pid, client in synthetic_round(strategy, manager, 3, gossip_client(loss_by_true_cluster)).items():
        assert len(client.peers) == 1 and TRUE[client.peers[0]] == TRUE[pid]
    # the DAC reference's PENS (null): the same n while selecting as after
    assert PENSOptions().selection_candidates is None


def test_a_pens_client_merges_only_its_lowest_loss_neighbours(monkeypatch):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override("strategy.name=fedavg")])
    client = Experiment(config).client(0, config.partition.num_clients)
    monkeypatch.setattr(type(client), "train_model", lambda self, model, rnd, epochs=None: 0.0)
    # each model's loss on the client's data: its constant value (4, 10, 7)
    monkeypatch.setattr(type(client), "training_loss", lambda self, model: float(next(model.parameters()).detach().flatten()[0]))
    shapes = [a.shape for a in Experiment(config).weights()]
    own, *neighbours = [[np.full(s, v, np.float32) for s in shapes] for v in (1.0, 4.0, 10.0, 7.0)]
    counts = {f"samples_{j}": client.num_train for j in range(3)}
    output = merge_neighbours_and_train(client, TaskInput(3, {MODELS: [own, *neighbours]},
                                                          counts | {MERGE_LOWEST_KEY: 2}))
    np.testing.assert_allclose(output.blocks[protocol.MODEL][0], (1.0 + 4.0 + 7.0) / 3, rtol=1e-6)
    assert [output.metrics[f"loss_{j}"] for j in range(3)] == [4.0, 10.0, 7.0]  # every drawn peer's loss reported


# ---- options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (("strategy.name=dac", "strategy.pretrain_epochs=-1"), "strategy.pretrain_epochs: must be >= 0"),
    (("strategy.name=dac", "rounds=1"), "rounds: round 1 only pretrains"),
    (("strategy.name=dac_var", "strategy.tau_schedule=sigmoid"), "strategy.tau_schedule: expected one of reference, centred"),
    (("strategy.name=dac", "strategy.two_hop_estimate=both"), "strategy.two_hop_estimate: expected one of paper, reference"),
    (("strategy.name=dac", "strategy.two_hop=false", "strategy.two_hop_estimate=reference"),
     "strategy.two_hop_estimate: 'reference' chooses how two-hop estimates are made, but two_hop is false"),
    (("strategy.name=pens", "strategy.num_kept=6"), r"strategy.num_kept: must be in 1..num_neighbours \(5\)"),
    (("strategy.name=pens", "strategy.selection_rounds=0"), "strategy.selection_rounds: must be >= 1"),
    (("strategy.name=pens", "strategy.selection_candidates=10", "strategy.num_kept=11"),
     r"strategy.num_kept: must be in 1..selection_candidates \(10\)"),
    (("strategy.name=pens", "strategy.selection_candidates=20"),
     r"strategy.selection_candidates: must be below partition.num_clients \(20\)"),
])
def test_the_gossip_options_errors_name_the_key(overrides, message):
    from fedcluster_flwr.declarations.schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])


def test_one_round_is_enough_without_pretraining():
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("strategy.name=dac", "rounds=1", "strategy.pretrain_epochs=0")])
    assert config.rounds == 1


# ---- records ------------------------------------------------------------------------------------------


def test_the_communication_map_keeps_its_size_and_labels_the_true_clusters(tmp_path):
    """communication.png (and one-shot's similarity.png) at a fixed size, clients ordered by true
    cluster, each block labelled with its name and size, at 12 clients as at 1,000."""
    import matplotlib.image

    from fedcluster_flwr.data.partition_options import RotationOptions, cluster_names
    from fedcluster_flwr.plots import plot_client_matrix

    names = cluster_names(RotationOptions(angles=(0.0, 180.0, 10.0, 350.0)), 4)
    assert names == ("0°", "180°", "10°", "350°")
    shapes = []
    for scale in (1, 100):
        true = np.random.default_rng(scale).permutation(np.repeat(np.arange(4), [7 * scale, 2 * scale, scale // 2 or 1, scale // 2 or 2]))
        labels = plot_client_matrix(np.random.default_rng(0).random((len(true), len(true))), true, names,
                                    tmp_path / f"map{scale}.png", "title", "share")
        shapes.append(matplotlib.image.imread(tmp_path / f"map{scale}.png").shape)
        if scale == 100:
            assert labels == ["0° (700)", "180° (200)", "10° (50)", "350° (50)"]
    assert shapes[0] == shapes[1]

    strategy = gossip(RandomGossip, tmp_path / "run", GossipOptions(num_neighbours=2), cluster_names=("upright", "rotated"))
    synthetic_round(strategy, synthetic_grid(N), 1, gossip_client())
    connect_test_run(strategy).recorder.write_artifacts(strategy.artifacts())
    assert matplotlib.image.imread(tmp_path / "run" / "communication.png").shape == shapes[0]


def test_the_relays_state_survives_a_checkpoint(tmp_path):
    from fedcluster_flwr.results.checkpoints import load_checkpoint
    from fedcluster_flwr.results.round_log import resume

    for cls, options in ((DAC, DACOptions(num_neighbours=2, two_hop_estimate="reference")),
                         (PENS, PENSOptions(num_neighbours=3, num_kept=1, selection_rounds=2))):
        folder = tmp_path / cls.name
        strategy = gossip(cls, folder, options, pretrained=False, checkpoint_every=1)
        manager = synthetic_grid(N)
        for rnd in (1, 2, 3, 4):
            synthetic_round(strategy, manager, rnd, gossip_client())
        resumed = gossip(cls, tmp_path / f"{cls.name}_resumed", options, pretrained=False)
        resume(resumed, connect_test_run(resumed), load_checkpoint(folder))
        assert resumed.exchanges == strategy.exchanges == 3 and resumed.pretrained.all()
        np.testing.assert_array_equal(resumed.estimate, strategy.estimate)
        if cls is PENS:
            np.testing.assert_array_equal(resumed.neighbour_sets, strategy.neighbour_sets)
            np.testing.assert_array_equal(resumed.kept_counts, strategy.kept_counts)
            assert resumed.neighbour_sets.any()
        else:
            np.testing.assert_array_equal(resumed.reference_table, strategy.reference_table)


def test_pens_and_the_reference_two_hop_run_on_real_clients(tmp_path):
    """PENS and DAC with the reference code's two-hop estimates, end to end on real digits clients
    (in process): pretraining, selection with merge_lowest, gossip among the kept; nothing refused."""
    from fedcluster_flwr.apps.server_app import run_in_process

    settings = ("rounds=6", "partition.name=rotation", "partition.angles=[0,180]", "partition.cluster_sizes=[14,6]",
                "strategy.client_fraction=1.0", "strategy.num_neighbours=3", "client.epochs=1")
    for name, extra in (("pens", ("strategy.num_kept=1", "strategy.selection_rounds=3")),
                        ("dac", ("strategy.two_hop_estimate=reference",))):
        config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*settings, f"strategy.name={name}", *extra)])
        strategy = run_in_process(config, tmp_path / name)
        rows = strategy.observer.recorder.rows
        assert sum(r["rejected_updates"] + r["fit_failures"] for r in rows) == 0
        assert rows[0]["phase"] == "pretrain" and strategy.exchanges == 5
        if name == "pens":
            assert [r["phase"] for r in rows[1:]] == ["pens_selection"] * 3 + ["pens_gossip"] * 2
            assert strategy.kept_counts.sum() == 3 * 20 * 1 and strategy.neighbour_sets.any(axis=1).all()
            # 3 selection rounds of 3 random draws each, then 2 gossip rounds of min(3, kept set) draws
            kept = strategy.neighbour_sets.sum(axis=1)
            assert strategy.communication.sum() == 3 * 20 * 3 + 2 * int(np.minimum(kept, 3).sum())
        else:
            assert np.isfinite(strategy.estimate[~np.eye(20, dtype=bool)]).mean() > 0.9  # most pairs estimated


def test_the_reference_check_report_reads_both_sides_records(tmp_path):
    """benchmarks/dac/reference_check.py's report (the DAC page's side-by-side tables): per-cluster
    means over the seeds, the 180° clients' own-cluster draws, and every run with its current models
    after the last exchange (a dead run shows at 10 %), from records in both sides' formats."""
    import argparse

    check = load_benchmark("dac/reference_check.py")
    true = [0, 1, 2, 3]  # one client per cluster: 0°, 180°, 10°, 350°
    for seed, final_best, current in ((3, [0.8, 0.6, 0.7, 0.9], [0.7] * 4), (4, [0.6, 0.4, 0.5, 0.7], [0.1] * 4)):
        record = tmp_path / "ours" / "runs" / f"random_gossip_synchronous_seed{seed}" / "reference_check.jsonl"
        record.parent.mkdir(parents=True)
        rounds = [{"round": r, "phase": "x", "seconds": 10.0, "best": final_best, "current": current,
                   "own": {"1": 0.5}} for r in (1, 2)]
        communication = [[0, 1, 0, 0], [2, 3, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]  # client 1: 3 of 5 draws its own cluster
        final = {"true_clusters": true, "final_best": final_best, "communication": communication}
        record.write_text("".join(json.dumps(row) + "\n" for row in [*rounds, final]))
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "ref_random_n4_r1_t100_s3.jsonl").write_text("".join(json.dumps(row) + "\n" for row in (
        {"round": -1, "best": [50.0] * 4, "local": [50.0] * 4},
        {"round": 0, "best": [55.0] * 4, "local": [10.0] * 4},
        {"final_full_test": [60.0, 50.0, 40.0, 30.0], "cluster_idx": true, "n_sampled": communication, "seconds": 7.0},
    )))
    args = argparse.Namespace(out=tmp_path / "ours", reference=reference, methods=["random_gossip"],
                              orders=["synchronous"], clients=4, train=100, exchanges=1, final_test=2000,
                              set=["strategy.same_init=true"])
    lines = check.report(args, [3, 4]).splitlines()
    assert lines[0].startswith("Ours with `strategy.same_init=true`. 4 clients (")
    # ± is the sample std (ddof = 1): two runs 20 points apart give 14.1, not the population's 10.0
    assert ("| random_gossip, ours, synchronous | 2 | 70.0 ± 14.1 | 50.0 ± 14.1 | 60.0 ± 14.1 | 80.0 ± 14.1 "
            "| 50.0 ± 0.0 | 0.60 | 1 | 20 |") in lines
    assert "| random_gossip, reference code | 1 | 60.0 | 50.0 | 40.0 | 30.0 | – | 0.60 | 1 | 7 |" in lines
    assert "| random_gossip, ours, synchronous | 50 / 40 | 50 / 40 |" in lines  # round by round, 180°: best / current
    assert "| random_gossip, ours, synchronous | 4 | 60.0 | 40.0 | 50.0 | 70.0 | 10.0 |" in lines  # the dead run
    assert "| random_gossip, reference code | 3 | 60.0 | 50.0 | 40.0 | 30.0 | 10.0 |" in lines
    # every run's current models per round (mean over clients) and whether every client ended at <= 20 %
    assert "| random_gossip, ours, synchronous | 3 | 70 | 70 | no |" in lines
    assert "| random_gossip, ours, synchronous | 4 | 10 | 10 | yes |" in lines
    assert "| random_gossip, reference code | 3 | 50 | 10 | yes |" in lines


def test_the_reference_check_keeps_one_variant_per_folder(tmp_path):
    """`reference_check.py --set` makes a variant of ours; its folder refuses runs of other settings,
    and a folder of runs made before variants were recorded refuses a variant."""
    import argparse

    check = load_benchmark("dac/reference_check.py")
    variant = argparse.Namespace(out=tmp_path / "same_init", set=["strategy.same_init=true"])
    check.check_variant(variant)
    check.check_variant(variant)  # the same settings again: continues
    with pytest.raises(SystemExit, match="made with \\['strategy.same_init=true'\\], not none"):
        check.check_variant(argparse.Namespace(out=tmp_path / "same_init", set=[]))
    (tmp_path / "older" / "runs").mkdir(parents=True)
    check.check_variant(argparse.Namespace(out=tmp_path / "older", set=[]))  # no variant asked: fine
    (tmp_path / "older" / "variant.json").unlink()
    with pytest.raises(SystemExit, match="unrecorded settings"):
        check.check_variant(argparse.Namespace(out=tmp_path / "older", set=["strategy.same_init=true"]))


def test_the_reference_check_sets_a_stopped_run_aside_and_starts_it_anew(tmp_path, monkeypatch, capsys):
    """A run of reference_check.py stopped before its record's last line cannot be continued (the
    protocol's best models lived in the stopped process): it is set aside, never deleted, and run
    again; a finished run is kept and not run again."""
    import argparse

    check = load_benchmark("dac/reference_check.py")
    started: list = []

    class Protocol:  # stands in for the engine and the test sets: only the folder handling is checked here
        def __init__(self, config, args, record):
            self.record = record

        def make_strategy(self, config):
            return None

        def on_round(self, row):
            pass

        def finish(self):
            self.record.write_text('{"round": 1}\n{"true_clusters": [0]}\n')

    monkeypatch.setattr(check, "ReferenceProtocol", Protocol)
    monkeypatch.setattr(check, "run_in_process", lambda config, run_dir, *a, **k: started.append(run_dir))
    args = argparse.Namespace(out=tmp_path, exchanges=1, clients=40, train=100, set=[])
    stopped = tmp_path / "runs" / "dac_synchronous_seed0"
    stopped.mkdir(parents=True)
    (stopped / "reference_check.jsonl").write_text('{"round": 1}\n{"round": 2, "cut sh')  # stopped mid-line
    record = check.run("dac", "synchronous", 0, args)
    assert started == [stopped] and check.finished(record)
    aside = tmp_path / "runs" / "dac_synchronous_seed0.incomplete-1"
    assert (aside / "reference_check.jsonl").read_text().endswith("cut sh")
    assert "set aside as dac_synchronous_seed0.incomplete-1" in capsys.readouterr().out
    check.run("dac", "synchronous", 0, args)  # finished: kept
    assert started == [stopped] and not (tmp_path / "runs" / "dac_synchronous_seed0.incomplete-2").exists()


def test_the_reference_check_counts_a_run_dead_by_every_clients_model():
    """Dead: every client's current model at most twice chance (20 %) after the last exchange. The
    dead runs of the reference check read 6.5-15.5 % per client (one class, or nearly); a run with one
    client that learned is live."""
    check = load_benchmark("dac/reference_check.py")
    assert check.dead([6.5, 9.5, 13.0, 15.5])
    assert not check.dead([6.5, 9.5, 13.0, 45.0])


def test_the_reference_check_page_names_its_command_with_project_paths_relative(monkeypatch):
    check = load_benchmark("dac/reference_check.py")
    out = check.ROOT / "benchmarks" / "dac" / "results" / "reference_check"
    monkeypatch.setattr("sys.argv", ["reference_check.py", "--out", str(out), "--seeds", "0,1", "--set", "a=b c"])
    assert check.made_by() == ("Written by `python benchmarks/dac/reference_check.py --out "
                               "benchmarks/dac/results/reference_check --seeds 0,1 --set 'a=b c'`.\n\n")
