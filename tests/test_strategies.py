"""Strategies driven round by round with synthetic clients (no Ray): sampling, aggregation,
FL+HC's phases and clustering, failures, newcomers and the results files."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import numpy as np
import pytest

from fedcluster_flwr.results.checkpoints import load_checkpoint
from fedcluster_flwr.results.round_log import resume
from fedcluster_flwr.algorithms.base import FederationError
from fedcluster_flwr.protocol import ACCURACY, CONFIG, ROUND_KEY, TRAIN_LOSS, VAL_LOSS
from fedcluster_flwr.aggregation import weighted_mean
from fedcluster_flwr.algorithms.base.strategy import UNASSIGNED, RoundReport
from fedcluster_flwr.algorithms.baselines.strategy import FedAvg, FractionOptions, LocalOnly, LocalOptions, OracleClusters
from fedcluster_flwr.algorithms.flhc.strategy import FLHC, FLHCOptions
from fedcluster_flwr.algorithms.base.selection import SELECTED, TRAIN_SELECT
from helpers import (
    connect_test_run,
    DIM,
    SHAPES,
    SyntheticGrid,
    SyntheticNode,
    configure,
    reply_to,
    Received,
    SyntheticClient,
    synthetic_grid,
    constant_model,
    synthetic_round,
    evaluated_at_80_percent,
    fit_res,
    flat,
    make_setup,
    rows_without_timing,
    select_metrics,
    unflatten,
)


def group_trainer(groups: np.ndarray, noise_per_client_and_round: bool = False) -> SyntheticClient:
    """Clients of group g pull a model towards target_g (their 'distribution').

    train: w + 0.5 (target_g - w) + noise.  train_select: pick the model closest to target_g.
    The noise comes from one generator shared by all clients, in the order they are asked, or,
    with ``noise_per_client_and_round``, from a seed of (client, round), as real clients' is:
    then a resumed run replays the same noise.
    """
    rng = np.random.default_rng(0)
    targets = rng.normal(size=(groups.max() + 1, DIM)) * 5

    def train(client: Received):
        target = targets[groups[client.pid]]
        metrics = {TRAIN_LOSS: 1.0}
        chosen = 0
        if client.task == TRAIN_SELECT.name:
            losses = [np.linalg.norm(flat(m) - target) for m in client.models]
            chosen = int(np.argmin(losses))
            metrics |= select_metrics(chosen, losses)
        noise = np.random.default_rng([client.pid, int(client.config[ROUND_KEY])]) if noise_per_client_and_round else rng
        w = flat(client.models[chosen])
        return unflatten(w + 0.5 * (target - w) + 0.01 * noise.normal(size=DIM)), 10 + client.pid, metrics

    return train


class Recording:
    """Passes ``client``'s replies on and keeps each client's last one: ``models[pid]`` (flat)
    and ``examples[pid]``."""

    def __init__(self, client: SyntheticClient):
        self.client, self.models, self.examples = client, {}, {}

    def __call__(self, received: Received):
        weights, n, metrics = self.client(received)
        self.models[received.pid], self.examples[received.pid] = flat(weights), n
        return weights, n, metrics

    def forget(self) -> None:
        self.models.clear()
        self.examples.clear()


class EvaluatedModels(dict):
    """The default evaluation, keeping by client the model (flat) each was evaluated on."""

    def __call__(self, pid: int, model):
        self[pid] = flat(model)
        return evaluated_at_80_percent(pid, model)


# ---- FedAvg, local, oracle ----------------------------------------------------------


def test_weighted_mean_weights_by_examples():
    a = [np.ones((2,), np.float32)]
    b = [np.full((2,), 4.0, np.float32)]
    mean = weighted_mean(iter([a, b]), [1, 3], [np.float32])  # an iterator: one model at a time
    np.testing.assert_allclose(mean[0], [3.25, 3.25])
    assert mean[0].dtype == np.float32


def test_fedavg_samples_a_fraction_and_averages_by_examples(tmp_path):
    strategy = FedAvg(FractionOptions(client_fraction=0.5), make_setup(tmp_path, 8))
    manager = synthetic_grid(8)
    trained = {}

    def train(client: Received):
        trained[client.pid] = 10 + client.pid
        return constant_model(client.pid), 10 + client.pid, {}

    received = synthetic_round(strategy, manager, 1, train)
    assert len(received) == 4 and all(client.task == "train" for client in received.values())
    expected = sum(pid * n for pid, n in trained.items()) / sum(trained.values())
    np.testing.assert_allclose(strategy.models[0][0], expected, rtol=1e-6)


def test_each_round_records_who_trained_and_every_clients_accuracy(tmp_path):
    """rounds.jsonl's fit_clients and client_accuracy: what post-clustering analyses read."""
    strategy = FedAvg(FractionOptions(client_fraction=0.5), make_setup(tmp_path, 8))
    received = synthetic_round(strategy, synthetic_grid(8), 1, group_trainer(np.zeros(8, dtype=int)),
                           evaluate=lambda pid, w: (0.5, {ACCURACY: pid / 10}))
    (row,) = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert row["fit_clients"] == sorted(received) and len(received) == 4
    assert row["client_accuracy"] == {str(pid): pid / 10 for pid in range(8)}


def test_sampling_is_seeded(tmp_path):
    def picks(seed, folder):
        setup = replace(make_setup(tmp_path / folder, 20), seed=seed)
        return sorted(synthetic_round(FedAvg(FractionOptions(0.25), setup), synthetic_grid(20), 1, group_trainer(np.zeros(20, int))))

    first, again, other = picks(0, "a"), picks(0, "b"), picks(1, "c")
    assert first == again and len(first) == 5
    assert other != first and first != list(range(5))


def test_each_client_gets_its_own_instruction(tmp_path):
    """Flower issues #2704/#2780: one shared instruction mutated for one client changes all."""
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 4))
    connect_test_run(strategy)
    configs = [message.content[CONFIG] for message in configure(strategy, 1, synthetic_grid(4))]
    configs[0][ROUND_KEY] = 99
    assert all(c[ROUND_KEY] == 1 for c in configs[1:])


def test_failed_and_corrupt_updates_never_reach_the_model(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 4))
    manager = synthetic_grid(4)
    synthetic_round(strategy, manager, 1, lambda client: (constant_model(1.0), 5, {}), fail={0}, corrupt={1})
    assert all(np.isfinite(a).all() for a in strategy.models[0])
    np.testing.assert_allclose(strategy.models[0][0], 1.0)
    row = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert row["fit_failures"] == 1 and row["rejected_updates"] == 1


def test_wrong_shapes_are_rejected(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 2))
    synthetic_round(strategy, synthetic_grid(2), 1, lambda client: ([np.ones((2, 2), np.float32)], 5, {}))
    np.testing.assert_allclose(strategy.models[0][0], 0.0)
    assert json.loads((tmp_path / "rounds.jsonl").read_text())["rejected_updates"] == 2


def test_all_failures_keep_the_previous_model_and_the_run_goes_on(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3, rounds=2))
    manager = synthetic_grid(3)
    synthetic_round(strategy, manager, 1, group_trainer(np.zeros(3, int)), fail={0, 1, 2})
    np.testing.assert_allclose(strategy.models[0][0], 0.0)
    synthetic_round(strategy, manager, 2, group_trainer(np.zeros(3, int)))
    assert json.loads((tmp_path / "summary.json").read_text())["finished"] is True


def test_local_clients_never_share_models(tmp_path):
    strategy = LocalOnly(LocalOptions(), make_setup(tmp_path, 3))
    synthetic_round(strategy, synthetic_grid(3), 1, lambda client: (constant_model(client.pid), 5, {}))
    for pid in range(3):
        np.testing.assert_allclose(strategy.client_models[pid][0], pid)


def test_oracle_averages_only_inside_true_clusters(tmp_path):
    true = np.array([0, 0, 1, 1])
    strategy = OracleClusters(FractionOptions(1.0), make_setup(tmp_path, 4, true=true))
    received = synthetic_round(strategy, synthetic_grid(4), 1, lambda client: (constant_model(10 * true[client.pid]), 5, {}))
    assert set(received) == {0, 1, 2, 3}
    np.testing.assert_allclose(strategy.models[0][0], 0.0)
    np.testing.assert_allclose(strategy.models[1][0], 10.0)


def test_federation_with_the_wrong_number_of_nodes_is_refused(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 4))
    connect_test_run(strategy)
    with pytest.raises(FederationError, match="num-supernodes=4"):
        configure(strategy, 1, synthetic_grid(2, reported=2))


def test_late_joiner_is_offline_until_its_round(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3, join_round={2: 3}))
    manager = synthetic_grid(3)
    trainer = group_trainer(np.zeros(3, int))
    assert set(synthetic_round(strategy, manager, 1, trainer)) == {0, 1}
    assert set(synthetic_round(strategy, manager, 3, trainer)) == {0, 1, 2}


# ---- FL+HC --------------------------------------------------------------------------

GROUPS = np.repeat(np.arange(3), 4)  # 12 clients, 3 true clusters


def flhc(tmp_path, rounds=8, **options) -> FLHC:
    opts = dict(client_fraction=0.25, rounds_before_clustering=2, distance="l2", linkage="average", num_clusters=3)
    opts.update(options)
    return FLHC(FLHCOptions(**opts), make_setup(tmp_path, len(GROUPS), true=GROUPS, rounds=rounds))


def test_flhc_runs_fedavg_then_clusters_all_updates_then_trains_clusters(tmp_path):
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2):  # FedAvg with cf: 3 of 12 clients, all on the joint model
        received = synthetic_round(strategy, manager, rnd, train)
        assert len(received) == 3 and strategy.phase(rnd) == "fedavg"
    joint = [a.copy() for a in strategy.models[0]]

    received = synthetic_round(strategy, manager, 3, train)  # the clustering round
    assert strategy.phase(3) == "clustering"
    assert set(received) == set(range(len(GROUPS)))  # every client takes part
    for client in received.values():
        assert client.task == "train" and len(client.models) == 1
        np.testing.assert_array_equal(flat(client.models[0]), flat(joint))  # all train the joint model
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["purity"] == 1.0 and summary["ari"] == 1.0 and summary["clusters_found"] == 3
    assert (tmp_path / "linkage.npy").is_file() and (tmp_path / "dendrogram.png").is_file()

    before = {c: flat(m).copy() for c, m in strategy.models.items()}
    received = synthetic_round(strategy, manager, 4, train)  # independent FedAvg per cluster, cf of members
    assert len(received) == 3  # max(1, int(0.25 * 4)) per cluster
    for pid, client in received.items():
        np.testing.assert_array_equal(flat(client.models[0]), before[strategy.assignment[pid]])
    sampled_clusters = sorted(strategy.assignment[pid] for pid in received)
    assert sampled_clusters == [0, 1, 2]


def test_flhc_cluster_models_start_from_the_joint_model_and_average_members(tmp_path):
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), Recording(group_trainer(GROUPS))
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    joint_before_clustering = flat(strategy.models[0]).copy()
    train.forget()
    synthetic_round(strategy, manager, 3, train)
    np.testing.assert_array_equal(flat(strategy.joint_model), joint_before_clustering)
    for cluster, model in strategy.models.items():
        members = [p for p in train.models if strategy.assignment[p] == cluster]
        expected = np.average([train.models[p] for p in members], axis=0, weights=[train.examples[p] for p in members])
        np.testing.assert_allclose(flat(model), expected, rtol=1e-5)


def test_after_clustering_only_the_sampled_members_shape_a_cluster_model(tmp_path):
    """Briggs et al.'s per-cluster FedAvg with partial participation, as published: in round n+2 a
    cluster of 4 with client_fraction 0.25 trains one member, and its update alone becomes the
    model that all 4 are evaluated on. In a cluster mixing label sets the 3 others lose what only
    they taught it (benchmarks/flhc/post_clustering.py measures this on pathological MNIST)."""
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), Recording(group_trainer(GROUPS))
    for rnd in (1, 2, 3):
        synthetic_round(strategy, manager, rnd, train)
    train.forget()
    evaluated = EvaluatedModels()
    synthetic_round(strategy, manager, 4, train, evaluate=evaluated)
    for cluster, model in strategy.models.items():
        members = [p for p in range(len(GROUPS)) if strategy.assignment[p] == cluster]
        (trained,) = [p for p in members if p in train.models]  # max(1, floor(0.25 * 4)) = 1
        np.testing.assert_array_equal(flat(model), train.models[trained])
        for pid in members:
            np.testing.assert_array_equal(evaluated[pid], train.models[trained])


def test_flhc_threshold_cut_on_update_distances(tmp_path):
    """A threshold between within-group and across-group update distances finds the groups."""
    strategy = flhc(tmp_path, num_clusters=None, threshold=4.0)
    manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2, 3):
        synthetic_round(strategy, manager, rnd, train)
    assert strategy.clustering.num_clusters == 3
    merges = strategy.clustering.linkage[:, 2]
    assert merges[-3] < 4.0 < merges[-2]
    assert json.loads((tmp_path / "summary.json").read_text())["cut"] == "threshold 4"

    above_every_merge = flhc(tmp_path / "above", num_clusters=None, threshold=float(merges[-1]) + 1.0)
    for rnd in (1, 2, 3):
        synthetic_round(above_every_merge, synthetic_grid(len(GROUPS)), rnd, train)
    assert above_every_merge.clustering.num_clusters == 1  # what no silhouette cut gives


def test_flhc_num_clusters_cuts_into_that_many_clusters(tmp_path):
    strategy = flhc(tmp_path, num_clusters=2)  # the groups are 3, and the silhouette finds 3
    manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2, 3):
        synthetic_round(strategy, manager, rnd, train)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["clusters_found"], summary["cut"]) == (2, "2 clusters")
    assert not (tmp_path / "updates.npy").exists()  # only with save_updates


def test_flhc_without_a_cut_cuts_at_the_largest_silhouette_and_says_so(tmp_path):
    strategy = flhc(tmp_path, num_clusters=None, threshold=None)
    manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2, 3):
        synthetic_round(strategy, manager, rnd, train)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["clusters_found"], summary["purity"], summary["cut"]) == (3, 1.0, "largest silhouette")


def test_client_absent_from_clustering_joins_the_cluster_with_lowest_training_loss(tmp_path):
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    absent = 5  # true group 1
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train, fail={absent})
    evaluated = EvaluatedModels()
    synthetic_round(strategy, manager, 3, train, fail={absent}, evaluate=evaluated)
    assert strategy.assignment[absent] == UNASSIGNED
    np.testing.assert_array_equal(evaluated[absent], flat(strategy.joint_model))  # evaluated on the joint model
    row = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[2])
    assert "unassigned" in row["per_cluster_accuracy"] and row["unassigned_clients"] == 1

    received = synthetic_round(strategy, manager, 4, train)
    assert received[absent].task == "train_select" and len(received[absent].models) == 3  # every cluster model
    peers = [p for p in range(len(GROUPS)) if GROUPS[p] == GROUPS[absent] and p != absent]
    assert strategy.assignment[absent] == strategy.assignment[peers[0]]
    assert json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])["unassigned_clients"] == 0


def test_client_joining_after_clustering_is_placed_by_training_loss(tmp_path):
    newcomer = 10  # true group 2
    strategy = FLHC(
        FLHCOptions(client_fraction=0.25, rounds_before_clustering=1, distance="cosine", linkage="complete", num_clusters=3),
        make_setup(tmp_path, len(GROUPS), true=GROUPS, rounds=6, join_round={newcomer: 4}),
    )
    manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2, 3):
        received = synthetic_round(strategy, manager, rnd, train)
        assert newcomer not in received
    received = synthetic_round(strategy, manager, 4, train)
    assert received[newcomer].task == "train_select"
    assert strategy.assignment[newcomer] == strategy.assignment[11]


def test_train_select_without_a_valid_choice_is_rejected(tmp_path):
    strategy, manager = flhc(tmp_path), synthetic_grid(len(GROUPS))
    train = group_trainer(GROUPS)
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    synthetic_round(strategy, manager, 3, train, fail={0})

    def no_choice(client: Received):
        weights, n, metrics = train(client)
        metrics.pop(SELECTED, None)
        return weights, n, metrics

    synthetic_round(strategy, manager, 4, no_choice)
    assert strategy.assignment[0] == UNASSIGNED


def test_no_update_in_clustering_round_postpones_clustering(tmp_path):
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    synthetic_round(strategy, manager, 3, train, fail=set(range(len(GROUPS))))
    assert not strategy.clustered and strategy.phase(3) == "clustering"
    received = synthetic_round(strategy, manager, 4, train)
    assert len(received) == len(GROUPS) and strategy.clustering.round == 4
    assert strategy.phase(4) == "clustering" and strategy.phase(5) == "clustered"
    assert json.loads((tmp_path / "summary.json").read_text())["clustering_round"] == 4


def test_summary_keeps_round_one_beside_the_last_round(tmp_path):
    """summary.json carries round 1's reading (DAC's pre-training level) per true cluster and over
    clients, not the last round's, so a table can print both (issue #53)."""
    strategy, manager, train = flhc(tmp_path, rounds=3), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in range(1, 4):
        # each round scores every client differently: round r gives 0.1 r + 0.05 g (g its true cluster)
        synthetic_round(strategy, manager, rnd, train,
                        evaluate=lambda pid, w, r=rnd: (0.5, {ACCURACY: 0.1 * r + 0.05 * GROUPS[pid]}))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["per_true_cluster_first_round_accuracy"] == pytest.approx({"0": 0.1, "1": 0.15, "2": 0.2})
    assert summary["first_round_mean_client_accuracy"] == pytest.approx(0.15)
    assert summary["per_true_cluster_accuracy"] == pytest.approx({"0": 0.3, "1": 0.35, "2": 0.4})


def test_results_contract_files(tmp_path):
    strategy, manager, train = flhc(tmp_path, rounds=5), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in range(1, 6):
        synthetic_round(strategy, manager, rnd, train, evaluate=lambda pid, w: (0.5, {ACCURACY: 0.4 + 0.1 * (pid % 3)}))
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["phase"] for r in rows] == ["fedavg", "fedavg", "clustering", "clustered", "clustered"]
    for key in ("mean_client_accuracy", "pct_clients_over_target", "per_cluster_accuracy", "num_clusters",
                "purity", "ari", "nmi", "bytes_up", "bytes_down", "seconds"):
        assert key in rows[-1]
    assert rows[-1]["mean_client_accuracy"] == pytest.approx(np.mean([0.4 + 0.1 * (p % 3) for p in range(12)]))
    per_cluster = {}
    for pid in range(12):
        per_cluster.setdefault(str(strategy.assignment[pid]), []).append(0.4 + 0.1 * (pid % 3))
    assert rows[-1]["per_cluster_accuracy"] == pytest.approx({k: np.mean(v) for k, v in per_cluster.items()})
    per_true = {str(g): np.mean([0.4 + 0.1 * (p % 3) for p in range(12) if GROUPS[p] == g]) for g in range(3)}
    assert rows[0]["per_true_cluster_accuracy"] == pytest.approx(per_true)  # by true id, whatever the assignment
    assert rows[-1]["per_true_cluster_accuracy"] == pytest.approx(per_true)
    assert rows[-1]["per_true_cluster_accuracy_std"] == pytest.approx(np.std(list(per_true.values())))
    assert rows[-1]["nmi"] == pytest.approx(1.0) and rows[0]["nmi"] == pytest.approx(0.0)
    assert rows[-1]["pct_clients_over_target"] == pytest.approx(100 * 8 / 12)  # acc 0.5 and 0.6 reach 0.5
    assert rows[2]["bytes_up"] == rows[2]["bytes_down"] > 0  # 12 models each way in the clustering round
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] and summary["completed_rounds"] == 5
    assert summary["true_clusters"] == GROUPS.tolist() and len(summary["assignment"]) == 12
    assert summary["rounds_to_target"] == 1
    assert summary["per_true_cluster_accuracy"] == pytest.approx(per_true)
    for name in ("accuracy.png", "clients_over_target.png", "checkpoint/models.npz", "checkpoint/state.json"):
        assert (tmp_path / name).is_file(), name
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint["round"] == 5 and sorted(checkpoint["strategy"]["models"]) == [0, 1, 2]
    np.testing.assert_array_equal(checkpoint["strategy"]["joint_model"][0], strategy.joint_model[0])
    np.testing.assert_array_equal(checkpoint["strategy"]["clustering"]["linkage"], strategy.clustering.linkage)


def test_two_clients_claiming_one_partition_id_keep_the_first(tmp_path):
    grid = synthetic_grid(3)
    grid.add(SyntheticNode("impostor", 1, 3))
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3))
    connect_test_run(strategy)
    messages = configure(strategy, 1, grid)
    assert grid.pids(messages) == [0, 1, 2]
    assert "impostor" not in {grid.name_of(m.metadata.dst_node_id) for m in messages}


# ---- hostile and unlucky federations (review findings) ------------------------------


def test_clusters_do_not_depend_on_the_order_results_arrive(tmp_path):
    outcomes = []
    for order_seed in (1, 2):
        strategy, manager = flhc(tmp_path / str(order_seed), linkage="single"), synthetic_grid(len(GROUPS))
        train = group_trainer(GROUPS)
        for rnd in (1, 2):
            synthetic_round(strategy, manager, rnd, train)
        synthetic_round(strategy, manager, 3, train, shuffle=np.random.default_rng(order_seed))  # the clustering round
        outcomes.append((strategy.assignment.tolist(), strategy.clustering.linkage.tolist(),
                         sorted(synthetic_round(strategy, manager, 4, train))))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    "reply",
    [
        lambda ok: fit_res(ok, tensors=[b"not an array"] * len(SHAPES)),
        lambda ok: fit_res([np.full(s, "x") for s in SHAPES]),
        lambda ok: fit_res(constant_model(3e38)),
        lambda ok: fit_res([w.astype(np.int64) for w in ok]),
        lambda ok: fit_res(ok, n=10**18),
        lambda ok: fit_res(ok, n=0),
        lambda ok: fit_res(ok, n=0.001),
        lambda ok: fit_res(ok, n=1.5),
        lambda ok: fit_res(ok, n=1e-300),
        lambda ok: fit_res(ok, metrics={TRAIN_LOSS: float("inf")}),
    ],
    ids=["garbage-bytes", "strings", "huge-values", "integers", "absurd-num-examples", "no-examples",
         "a-thousandth-example", "one-and-a-half-examples", "1e-300-examples", "infinite-train-loss"],
)
def test_a_hostile_reply_is_rejected_without_stopping_the_server(tmp_path, reply):
    setup = make_setup(tmp_path, 2, train_sizes=[50, 50])
    strategy = FedAvg(FractionOptions(1.0), setup)
    connect_test_run(strategy)
    messages = configure(strategy, 1, synthetic_grid(2))
    good = constant_model(1.0)
    strategy.aggregate_train(1, [reply_to(messages[0], fit_res(good)), reply_to(messages[1], reply(good))])
    np.testing.assert_allclose(strategy.models[0][0], 1.0)  # only the good update counted
    assert strategy.counters.rejected_updates == 1


def test_bad_metrics_never_become_results(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 4, rounds=1))
    accuracies = [0.5, "high", 1e6, float("nan")]
    synthetic_round(strategy, synthetic_grid(4), 1, lambda client: (constant_model(1.0), 10, {TRAIN_LOSS: "x"}),
                evaluate=lambda pid, w: (0.1, {ACCURACY: accuracies[pid]}))
    row = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert row["mean_client_accuracy"] == 0.5 and row["eval_failures"] == 3
    assert row["mean_train_loss"] is None  # "x" is not a loss


def test_malformed_partition_ids_are_ignored(tmp_path):
    grid = synthetic_grid(2)
    grid.add(SyntheticNode("odd", "x", 2))
    grid.add(SyntheticNode("float", 1.0, 2))
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 2))
    connect_test_run(strategy)
    assert grid.pids(configure(strategy, 1, grid)) == [0, 1]


def test_a_restarted_supernode_takes_its_partition_back(tmp_path):
    grid = synthetic_grid(3)
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 3))
    connect_test_run(strategy)
    configure(strategy, 1, grid)
    grid.remove("1")
    grid.add(SyntheticNode("restarted", 1, 3))
    messages = configure(strategy, 2, grid)
    assert "restarted" in {grid.name_of(m.metadata.dst_node_id) for m in messages}


def test_no_answering_client_stops_the_run_with_the_reason(tmp_path):
    def broken():
        raise ValueError("client_fn failed: CUDA unavailable")

    grid = SyntheticGrid([SyntheticNode("1", 0, 1, identify=broken)])
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 1))
    connect_test_run(strategy)
    with pytest.raises(FederationError, match="CUDA unavailable"):
        configure(strategy, 1, grid)


def test_clustering_waits_for_a_quorum_of_updates(tmp_path):
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    synthetic_round(strategy, manager, 3, train, fail=set(range(9)))  # 3 of 12 < 0.5 quorum
    assert not strategy.clustered
    synthetic_round(strategy, manager, 4, train)
    assert strategy.clustering.round == 4 and strategy.clustering.num_clusters == 3


def test_exactly_a_quorum_of_updates_is_enough_to_cluster(tmp_path):
    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    synthetic_round(strategy, manager, 3, train, fail=set(range(6)))  # 6 of 12 = the 0.5 quorum
    assert strategy.clustered and strategy.clustering.round == 3


def test_a_quorum_below_one_update_clusters_the_one_that_came(tmp_path):
    strategy, manager, train = flhc(tmp_path, clustering_quorum=0.05), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    synthetic_round(strategy, manager, 3, train, fail=set(range(1, len(GROUPS))))  # 1 of 12 >= 0.6, and >= 1
    assert strategy.clustered and strategy.clustering.pids == (0,) and strategy.clustering.num_clusters == 1


def test_the_clustering_its_postponement_and_its_failure_are_logged(tmp_path, caplog, monkeypatch):
    from fedcluster_flwr.algorithms.flhc import strategy as flhc_module

    strategy, manager, train = flhc(tmp_path), synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)

    def messages(level):
        return [r.getMessage() for r in caplog.records if r.levelno == level and r.getMessage().startswith("FL+HC")]

    with caplog.at_level(logging.INFO):
        synthetic_round(strategy, manager, 3, train, fail=set(range(9)))
        assert messages(logging.WARNING) == [
            "FL+HC round 3: 3 updates, below the clustering quorum of 6; clustering next round"]

        def fails(*args, **kwargs):
            raise ValueError("the distances are not finite")

        with monkeypatch.context() as patch:
            patch.setattr(flhc_module, "hierarchical_clustering", fails)
            synthetic_round(strategy, manager, 4, train)
        assert not strategy.clustered
        assert messages(logging.ERROR) == ["FL+HC round 4: clustering failed (the distances are not finite); retrying next round"]

        synthetic_round(strategy, manager, 5, train)
        (clustered,) = messages(logging.INFO)
    assert clustered.startswith("FL+HC round 5: 12 clients -> 3 clusters of sizes [4, 4, 4] "
                                "(l2 distance, average linkage, cut: 3 clusters); pairwise distances min ")


def test_the_projection_of_the_updates_is_drawn_from_the_runs_seed(tmp_path):
    """Every client trains in both rounds, so the seed changes nothing but the projection."""
    saved = {}
    for folder, seed in (("a", 3), ("b", 3), ("c", 4)):
        strategy = FLHC(FLHCOptions(client_fraction=1.0, rounds_before_clustering=1, distance="l2", num_clusters=3,
                                    projection_dim=4, save_updates=True),
                        make_setup(tmp_path / folder, len(GROUPS), true=GROUPS, rounds=4, seed=seed))
        manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
        for rnd in (1, 2):
            synthetic_round(strategy, manager, rnd, train)
        saved[folder] = np.load(tmp_path / folder / "updates.npy")
    np.testing.assert_array_equal(saved["a"], saved["b"])
    assert not np.allclose(saved["a"], saved["c"])


def test_sampling_rounds_down_without_float_error(tmp_path):
    strategy = FedAvg(FractionOptions(0.29), make_setup(tmp_path, 100))
    assert len(strategy.sample(list(range(100)), 0.29)) == 29


def test_round_means_do_not_depend_on_reply_order(tmp_path):
    accuracies = [0.1 * k + 0.07 for k in range(10)]  # sums whose float result depends on order
    means = []
    for order_seed in (1, 2, 3):
        strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path / str(order_seed), 10))
        synthetic_round(strategy, synthetic_grid(10), 1, lambda client: (constant_model(1.0), 10, {}),
                    evaluate=lambda pid, w: (accuracies[pid] / 3, {ACCURACY: accuracies[pid]}),
                    shuffle=np.random.default_rng(order_seed))
        row = json.loads((tmp_path / str(order_seed) / "rounds.jsonl").read_text())
        means.append((row["mean_client_accuracy"], row["mean_test_loss"]))
    assert means[0] == means[1] == means[2]


# ---- resume from a checkpoint ------------------------------------------------------------


def test_a_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    def strategy_in(folder, **extra):
        opts = FLHCOptions(client_fraction=0.25, rounds_before_clustering=2, distance="l2", linkage="average", num_clusters=3)
        return FLHC(opts, make_setup(folder, len(GROUPS), true=GROUPS, rounds=6, checkpoint_every=3, **extra))

    train = group_trainer(GROUPS, noise_per_client_and_round=True)
    whole = strategy_in(tmp_path / "whole", join_round={7: 5})
    for rnd in range(1, 7):
        synthetic_round(whole, synthetic_grid(len(GROUPS)), rnd, train, fail={4} if rnd == 3 else set())

    first = strategy_in(tmp_path / "resumed", join_round={7: 5})
    for rnd in range(1, 4):
        synthetic_round(first, synthetic_grid(len(GROUPS)), rnd, train, fail={4} if rnd == 3 else set())
    checkpoint = load_checkpoint(tmp_path / "resumed")
    assert checkpoint["round"] == 3 and checkpoint["strategy"]["joint_model"] is not None

    setup = make_setup(tmp_path / "resumed", len(GROUPS), true=GROUPS, rounds=6, checkpoint_every=3, join_round={7: 5})
    resumed = FLHC(first.options, setup)
    resume(resumed, connect_test_run(resumed, resuming=True), checkpoint)
    for flower_round in (1, 2, 3):  # Flower counts the remaining rounds from 1 again
        synthetic_round(resumed, synthetic_grid(len(GROUPS)), flower_round, train)

    assert resumed.assignment.tolist() == whole.assignment.tolist()
    for cluster in whole.models:
        np.testing.assert_array_equal(flat(resumed.models[cluster]), flat(whole.models[cluster]))

    def rows(folder):
        return rows_without_timing([json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()])

    assert rows(tmp_path / "resumed") == rows(tmp_path / "whole")
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["finished"] and summary["clustering_round"] == 3 and summary["fit_failures"] == 1


def test_flhc_clusters_projected_updates(tmp_path):
    """projection_dim < model size: updates are projected on arrival and still cluster."""
    strategy = flhc(tmp_path, projection_dim=8, save_updates=True)
    manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2, 3):
        synthetic_round(strategy, manager, rnd, train)
    saved = np.load(tmp_path / "updates.npy")
    assert saved.shape == (len(GROUPS), 8)  # rows in clustered_clients order
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["purity"] == 1.0 and summary["clusters_found"] == 3


@pytest.mark.parametrize("distance", ["l1", "l2", "cosine"])
def test_saved_updates_are_the_clients_deltas(tmp_path, distance):
    """What FL+HC clusters, under every distance, is each client's update w_local - w_joint (the
    matrix it saves is the one it clusters); under l1 and l2 only these rows could tell updates
    from weights, whose pairwise distances are the same."""
    strategy = flhc(tmp_path, save_updates=True, distance=distance)
    manager, train = synthetic_grid(len(GROUPS)), Recording(group_trainer(GROUPS))
    for rnd in (1, 2):
        synthetic_round(strategy, manager, rnd, train)
    joint = flat(strategy.models[0]).copy()
    synthetic_round(strategy, manager, 3, train)
    saved = np.load(tmp_path / "updates.npy")
    for row, pid in enumerate(strategy.clustering.pids):
        np.testing.assert_allclose(saved[row], train.models[pid] - joint, rtol=1e-6, atol=1e-6)


def test_flhc_clusters_by_the_direction_of_the_updates_not_of_the_weights_under_cosine(tmp_path):
    """The joint model w (norm 10) plus each client's update along u, orthogonal to w: clients 0 and
    1 move by +0.1 and +10, clients 2 and 3 by -0.1 and -10. The updates point two ways, {0, 1} and
    {2, 3}; the weights w ± 0.1u are nearly w's direction and w ± 10u far from it and from each other,
    so clustering the weights by cosine would put 0 with 2 (distance 7e-5) and split off 1 or 3."""
    from helpers import SyntheticSetup

    joint, u = np.zeros(DIM), np.zeros(DIM)
    joint[0], u[1] = 10.0, 1.0
    moves = {0: 0.1, 1: 10.0, 2: -0.1, 3: -10.0}
    setup = SyntheticSetup(unflatten(joint), 4, np.array([0, 0, 1, 1]), 3, seed=0, run_dir=tmp_path)
    options = FLHCOptions(client_fraction=1.0, rounds_before_clustering=0, distance="cosine", linkage="complete",
                          num_clusters=2)
    strategy = FLHC(options, setup)
    synthetic_round(strategy, synthetic_grid(4), 1,
                    lambda client: (unflatten(flat(client.models[0]) + moves[client.pid] * u), 10, {TRAIN_LOSS: 1.0}))
    assert strategy.clustering is not None
    a = strategy.assignment
    assert a[0] == a[1] and a[2] == a[3] and a[0] != a[2], a


def test_dendrogram_draws_the_threshold(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.axhline
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", lambda self, y=0, *a, **k: drawn.append(y) or original(self, y, *a, **k))
    strategy = flhc(tmp_path, num_clusters=None, threshold=4.0)
    manager, train = synthetic_grid(len(GROUPS)), group_trainer(GROUPS)
    for rnd in (1, 2, 3):
        synthetic_round(strategy, manager, rnd, train)
    assert 4.0 in drawn and (tmp_path / "dendrogram.png").stat().st_size > 0


def test_a_float64_reply_is_stored_in_the_models_dtype(tmp_path):
    strategy = LocalOnly(LocalOptions(), make_setup(tmp_path, 2))
    synthetic_round(strategy, synthetic_grid(2), 1, lambda client: (constant_model(0.1, np.float64), 10, {}))
    assert all(a.dtype == np.float32 for a in strategy.client_models[0])
    np.testing.assert_allclose(strategy.client_models[0][0], 0.1, rtol=1e-6)


def test_local_trains_every_client_every_round(tmp_path):
    strategy = LocalOnly(LocalOptions(), make_setup(tmp_path, 5))
    for rnd in (1, 2):
        assert sorted(synthetic_round(strategy, synthetic_grid(5), rnd, group_trainer(np.zeros(5, int)))) == [0, 1, 2, 3, 4]


def test_a_torn_checkpoint_is_detected(tmp_path):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 2, rounds=2, checkpoint_every=1))
    manager = synthetic_grid(2)
    synthetic_round(strategy, manager, 1, group_trainer(np.zeros(2, int)))
    state_after_round_1 = (tmp_path / "checkpoint" / "state.json").read_text()
    synthetic_round(strategy, manager, 2, group_trainer(np.zeros(2, int)))
    (tmp_path / "checkpoint" / "state.json").write_text(state_after_round_1)  # as if stopped mid-write
    with pytest.raises(ValueError, match="torn"):
        load_checkpoint(tmp_path)


# ---- what every strategy keeps beside its algorithm ------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda setup: FedAvg(FractionOptions(1.0), setup),
    lambda setup: FLHC(FLHCOptions(client_fraction=1.0, rounds_before_clustering=5, num_clusters=2), setup),
], ids=["fedavg", "flhc"])
def test_every_strategy_reports_the_accuracy_of_each_clients_best_validated_model(tmp_path, make):
    """Model selection by validation loss (Zec et al.) is not only the gossip strategies': a
    strategy whose clients report a validation loss gets it in its rows, summary and state."""
    strategy = make(make_setup(tmp_path, 4, true=[0, 0, 1, 1], rounds=3))
    trainer = group_trainer(np.array([0, 0, 1, 1]))
    for rnd, (val_loss, accuracy) in enumerate([(0.9, 0.5), (0.4, 0.7), (0.6, 0.9)], start=1):
        reported = {ACCURACY: accuracy, VAL_LOSS: val_loss}
        synthetic_round(strategy, synthetic_grid(4), rnd, trainer, evaluate=lambda pid, w, reported=reported: (0.5, reported))
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["mean_best_val_accuracy"] for r in rows] == [0.5, 0.7, 0.7]  # round 2's models kept the lowest val loss
    assert rows[-1]["per_true_cluster_best_val_accuracy"] == pytest.approx({"0": 0.7, "1": 0.7})
    assert json.loads((tmp_path / "summary.json").read_text())["mean_best_val_accuracy"] == 0.7
    assert strategy.state_dict()["best_validated"] == {p: [0.4, 0.7] for p in range(4)}


def test_a_strategy_connected_to_no_round_log_says_its_rounds_are_not_recorded(tmp_path, caplog):
    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 2))
    strategy.end_round(RoundReport(1, strategy.counters, {0: 0.5, 1: 0.5}, {0: 1.0, 1: 1.0}, eval_failures=0))
    assert "round 1 of fedavg is not recorded: the strategy is not connected to a round log" in caplog.text
    assert not (tmp_path / "rounds.jsonl").exists()


def test_a_round_timeout_that_passes_before_any_reply_is_named(tmp_path, caplog):
    """On Flower's grids a reply that does not come within the round timeout is simply missing: the
    first round's who-is-who says so naming the key, and a missing training reply is a failure naming it."""

    class Silent(SyntheticGrid):
        def send_and_receive(self, messages, *, timeout=None):
            return []  # nothing came back within ``timeout``

    strategy = FedAvg(FractionOptions(1.0), make_setup(tmp_path, 2))
    connect_test_run(strategy)
    with pytest.raises(FederationError, match=r"did not answer within the round timeout \(simulation.round_timeout_s"):
        configure(strategy, 1, Silent([SyntheticNode("a", 0, 2), SyntheticNode("b", 1, 2)]))
    other = FedAvg(FractionOptions(1.0), make_setup(tmp_path / "other", 2))
    connect_test_run(other)
    sent = configure(other, 1, synthetic_grid(2))
    with caplog.at_level(logging.WARNING):
        _, metrics = other.aggregate_train(1, [reply_to(sent[0], fit_res(constant_model(1.0)))])
    assert metrics["fit_failures"] == 1
    assert "round 1: client 1 failed: no reply within the round timeout (simulation.round_timeout_s)" in caplog.text
