"""PACFL (Vahidian et al.): principal angles between client data subspaces, the proximity matrix,
its clustering, newcomers placed by their subspace, and the strategy end to end on digits."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.client import TaskInput
from fedcluster_flwr.clustering import cluster_square
from fedcluster_flwr.algorithms.pacfl.math import closest_cluster, principal_angles, proximity_matrix, subspace_proximity
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.features import feature_map
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.algorithms.pacfl.strategy import PACFL, PACFLOptions
from fedcluster_flwr.algorithms.oneshot.tasks import (
    EIGENVALUES,
    EIGENVECTORS,
    FEATURES_KEY,
    FEATURE_DIM_KEY,
    FEATURE_SEED_KEY,
    GRAM_EIGEN,
    NUM_EIGENVECTORS_KEY,
    PRETRAINED_WEIGHTS_KEY,
    SHARE_EIGENVALUES_KEY,
    top_gram_eigenpairs,
)
from helpers import connect_test_run, pack_reply, Received, synthetic_grid, synthetic_round, make_setup

E = np.eye(4)


def rotated(t_degrees: float) -> np.ndarray:
    """A unit vector at ``t_degrees`` from e1 in the (e1, e2) plane, as a 4 × 1 basis."""
    t = np.radians(t_degrees)
    return (np.cos(t) * E[:, 0] + np.sin(t) * E[:, 1])[:, None]


# ---- principal angles and the proximity matrix -----------------------------------------------------


def test_principal_angles_of_hand_made_subspaces():
    plane = E[:, :2]
    assert principal_angles(plane, plane) == pytest.approx([0.0, 0.0], abs=1e-6)
    other_basis = plane @ np.array([[np.cos(0.7), -np.sin(0.7)], [np.sin(0.7), np.cos(0.7)]])  # same plane
    assert principal_angles(plane, other_basis) == pytest.approx([0.0, 0.0], abs=1e-6)
    assert principal_angles(plane, E[:, 2:]) == pytest.approx([90.0, 90.0])
    assert principal_angles(E[:, :1], rotated(30)) == pytest.approx([30.0])
    tilted = np.stack([E[:, 0], np.cos(np.radians(40)) * E[:, 1] + np.sin(np.radians(40)) * E[:, 2]], axis=1)
    assert principal_angles(plane, tilted) == pytest.approx([0.0, 40.0], abs=1e-6)  # ascending

    assert subspace_proximity(plane, tilted, "smallest_angle") == pytest.approx(0.0, abs=1e-6)  # eq. 2
    assert subspace_proximity(plane, tilted, "sum_of_angles") == pytest.approx(40.0)  # eq. 3
    assert subspace_proximity(plane, E[:, 2:], "smallest_angle") == pytest.approx(90.0)
    assert subspace_proximity(plane, E[:, 2:], "sum_of_angles") == pytest.approx(180.0)


def test_the_reference_codes_elementwise_angle_is_not_a_principal_angle():
    """min arccos(u_a · u_b) over basis vectors: a rotation of the basis inside the same plane, or a
    flipped sign (which an SVD leaves arbitrary), moves it; the principal angles do not move."""
    plane = E[:, :2]
    turned = np.stack([rotated(45)[:, 0], rotated(135)[:, 0]], axis=1)  # the same plane, turned 45°
    assert subspace_proximity(plane, turned, "smallest_angle") == pytest.approx(0.0, abs=1e-6)
    assert subspace_proximity(plane, turned, "elementwise_min_angle") == pytest.approx(45.0)
    assert subspace_proximity(E[:, :1], -E[:, :1], "smallest_angle") == pytest.approx(0.0, abs=1e-6)
    assert subspace_proximity(E[:, :1], -E[:, :1], "elementwise_min_angle") == pytest.approx(180.0)
    assert subspace_proximity(E[:, :1], rotated(30), "elementwise_min_angle") == pytest.approx(30.0)


@pytest.mark.parametrize("rule", ["smallest_angle", "sum_of_angles", "elementwise_min_angle"])
def test_the_proximity_matrix_is_symmetric_with_a_zero_diagonal(rule):
    rng = np.random.default_rng(0)
    bases = [np.linalg.qr(rng.normal(size=(10, 3)))[0] for _ in range(5)]
    proximity = proximity_matrix(bases, rule)
    assert proximity.shape == (5, 5)
    np.testing.assert_array_equal(proximity, proximity.T)
    np.testing.assert_array_equal(np.diag(proximity), 0.0)
    assert (proximity[~np.eye(5, dtype=bool)] > 0).all()


def noisy_groups(rng: np.random.Generator, sizes=(3, 4, 2), dim=20, p=2, noise=0.01) -> tuple[list[np.ndarray], np.ndarray]:
    """Orthonormal bases of subspaces scattered a little around one random p-dimensional subspace per group."""
    centres = [np.linalg.qr(rng.normal(size=(dim, p)))[0] for _ in sizes]
    bases, groups = [], []
    for g, size in enumerate(sizes):
        for _ in range(size):
            bases.append(np.linalg.qr(centres[g] + noise * rng.normal(size=(dim, p)))[0])
            groups.append(g)
    return bases, np.asarray(groups)


@pytest.mark.parametrize("rule", ["smallest_angle", "sum_of_angles"])
def test_hac_of_the_proximity_recovers_hand_made_groups(rule):
    bases, groups = noisy_groups(np.random.default_rng(1))
    order = np.random.default_rng(2).permutation(len(bases))  # interleave the groups
    bases, groups = [bases[i] for i in order], groups[order]
    proximity = proximity_matrix(bases, rule)
    # degrees: within a group at most 3° (smallest angle) / 7° (sum), across at least 60° / 140°
    for cut in ({"num_clusters": 3}, {"threshold": 30.0}):
        labels = cluster_square(proximity, "average", **cut).labels
        assert len(set(labels)) == 3
        assert all(len(set(labels[groups == g])) == 1 for g in range(3))


def test_a_newcomer_joins_the_cluster_at_the_smallest_linkage_distance():
    labels = np.array([0, 0, 1, 1])
    distances = np.array([1.0, 9.0, 4.0, 4.0])  # cluster 0: nearest 1, farthest 9, mean 5; cluster 1: 4
    assert closest_cluster(distances, labels, "single") == 0
    assert closest_cluster(distances, labels, "complete") == 1
    assert closest_cluster(distances, labels, "average") == 1
    assert closest_cluster(np.array([2.0, 2.0]), np.array([3, 1]), "average") == 1  # a tie: the lowest id


# ---- the client's summary is gram_eigen --------------------------------------------------------------


@pytest.fixture(scope="module")
def label_group_config():
    overrides = ["partition.name=label_groups", "partition.groups=[[0,1,2,3,4],[5,6,7,8,9]]",
                 "partition.samples_per_client=70", "strategy.name=pacfl", "strategy.threshold=null",
                 "strategy.num_clusters=2", "strategy.client_fraction=1.0", "rounds=3"]
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


def test_gram_eigen_vectors_span_the_top_left_singular_subspace_of_the_data_matrix(label_group_config):
    """PACFL's U_p (top-p left singular vectors of D = Φ(X)ᵀ, features × samples) is what gram_eigen
    returns: the top eigenvectors of (1/n) D Dᵀ."""
    client = Experiment(label_group_config).client(3, 20)
    config = {FEATURES_KEY: "identity", FEATURE_DIM_KEY: 64, FEATURE_SEED_KEY: 0, PRETRAINED_WEIGHTS_KEY: "",
              SHARE_EIGENVALUES_KEY: False, NUM_EIGENVECTORS_KEY: 3}
    blocks = top_gram_eigenpairs(client, TaskInput(1, {}, config)).blocks
    assert blocks[EIGENVALUES] == []
    (vectors,) = blocks[EIGENVECTORS]
    data = feature_map("identity", (1, 8, 8), 64, 0)(client.data.x_train).numpy().T  # D: 64 × n
    left, _, _ = np.linalg.svd(data, full_matrices=False)
    assert principal_angles(vectors.T, left[:, :3]) == pytest.approx([0, 0, 0], abs=0.05)  # degrees, float32 replies


# ---- the strategy with synthetic clients: placement, no GPS, a restarted clustering round ------------


def pacfl_strategy(tmp_path, num_clients=6, **options):
    opts = dict(num_clusters=2, num_basis=2, client_fraction=1.0) | options
    setup = make_setup(tmp_path, num_clients, true=np.arange(num_clients) % 2, rounds=6, checkpoint_every=1,
                       input_shape=(1, 2, 4), parameter_names=["w", "b"])
    return PACFL(PACFLOptions(**opts), setup)


SUBSPACES = [np.eye(8)[:, :2], np.eye(8)[:, 4:6]]  # the two distributions' subspaces, 90° apart


def synthetic_client(client: Received):
    """Client i's data lies near subspace i mod 2; a train reply is the model plus 10 + i."""
    if client.task == GRAM_EIGEN.name:
        noise = 0.05 * np.random.default_rng(client.pid).normal(size=(8, 2))
        basis = np.linalg.qr(SUBSPACES[client.pid % 2] + noise)[0]
        return pack_reply(GRAM_EIGEN, {EIGENVECTORS: [basis.T.astype(np.float32)], EIGENVALUES: []}), 50, {}
    return [a + 10 + client.pid for a in client.models[0]], 50, {}


def test_clusters_once_then_fedavg_per_cluster_without_a_gps_step(tmp_path):
    strategy, manager = pacfl_strategy(tmp_path), synthetic_grid(6)
    received = synthetic_round(strategy, manager, 1, synthetic_client)
    assert {c.task for c in received.values()} == {"gram_eigen"} and len(received) == 6
    assert all(c.config[NUM_EIGENVECTORS_KEY] == 2 and not c.config[SHARE_EIGENVALUES_KEY] for c in received.values())
    assert strategy.clustered and strategy.assignment.tolist() in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
    assert strategy.proximity[0, 2] < 10 and strategy.proximity[0, 1] > 80  # degrees
    received = synthetic_round(strategy, manager, 2, synthetic_client)
    assert {c.task for c in received.values()} == {"train"}
    even = strategy.assignment[0]
    np.testing.assert_allclose(strategy.models[even][0], 10 + 2)  # the mean of clients 0, 2, 4 only: no GPS
    np.testing.assert_allclose(strategy.models[1 - even][0], 10 + 3)
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["gram_eigen", "fedavg"] and rows[1]["bytes_gps"] == 0
    assert rows[0]["ari"] == 1.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["proximity_gap"] > 70 and summary["subspace_floats"] == 2 * 8
    assert {"proximity.npy", "proximity.png", "dendrogram.png"} <= {p.name for p in tmp_path.iterdir()}


def test_too_few_subspaces_ask_again_and_a_newcomer_is_placed_by_its_own(tmp_path, caplog):
    strategy, manager = pacfl_strategy(tmp_path), synthetic_grid(6)
    with caplog.at_level(logging.INFO):
        synthetic_round(strategy, manager, 1, synthetic_client, fail={0, 1, 2, 3, 4})  # one subspace: fewer than 2
        assert not strategy.clustered and strategy.phase(1) == "gram_eigen"
        synthetic_round(strategy, manager, 2, synthetic_client, fail={5})
        assert strategy.clustered and strategy.clustering.pids == (0, 1, 2, 3, 4) and strategy.assignment[5] == -1
        received = synthetic_round(strategy, manager, 3, synthetic_client)
    asked_again, clustered, placed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pacfl round")]
    assert asked_again == "pacfl round 1: 1 subspaces, 2 needed; asking again next round"
    assert clustered.startswith(f"pacfl round 2: 5 clients -> 2 clusters of sizes [3, 2]; mean {strategy.options.proximity} "
                                "within true clusters ")
    assert placed == f"pacfl round 3: newcomer 5 placed in cluster {strategy.assignment[1]} by its subspace"
    assert received[5].task == "gram_eigen" and {received[p].task for p in range(5)} == {"train"}
    assert strategy.assignment[5] == strategy.assignment[1]  # odd: the subspace of clients 1 and 3
    assert strategy.placements == [{"round": 3, "client": 5, "cluster": int(strategy.assignment[1])}]
    assert sorted(strategy.bases) == list(range(6)) and strategy.bases[5].shape == strategy.bases[1].shape  # kept for later newcomers
    received = synthetic_round(strategy, manager, 4, synthetic_client)
    assert received[5].task == "train"


@pytest.mark.parametrize("cut, clusters, rule", [({"threshold": 45.0}, 2, "threshold 45"),
                                                 ({"threshold": 1.0}, None, "threshold 1"),
                                                 ({"num_clusters": 3}, 3, "3 clusters")])
def test_the_one_shot_round_cuts_at_the_threshold_or_into_num_clusters(tmp_path, cut, clusters, rule):
    strategy = pacfl_strategy(tmp_path, **({"num_clusters": None} | cut))
    synthetic_round(strategy, synthetic_grid(6), 1, synthetic_client)
    labels = strategy.assignment.tolist()
    if clusters is None:  # 1° is below the angles within a subspace's noisy copies: they split too
        assert strategy.clustering.num_clusters > 2
    else:
        assert strategy.clustering.num_clusters == clusters == len(strategy.models)
    if cut == {"threshold": 45.0}:
        assert labels in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
    assert strategy.clustering.summary()["cut"] == rule


@pytest.mark.parametrize("num_clusters, replies, clustered", [(None, 1, False), (None, 2, True), (3, 2, False), (3, 3, True)])
def test_the_one_shot_round_needs_two_subspaces_or_num_clusters_of_them(tmp_path, num_clusters, replies, clustered):
    options = {"num_clusters": num_clusters} if num_clusters else {"num_clusters": None, "threshold": 45.0}
    strategy = pacfl_strategy(tmp_path, **options)
    synthetic_round(strategy, synthetic_grid(6), 1, synthetic_client, fail=set(range(replies, 6)))
    assert strategy.clustered is clustered


def test_an_interrupted_run_resumes_with_its_bases_and_places_newcomers_alike(tmp_path):
    from fedcluster_flwr.results.checkpoints import load_checkpoint
    from fedcluster_flwr.results.round_log import resume

    strategy, manager = pacfl_strategy(tmp_path), synthetic_grid(6)
    synthetic_round(strategy, manager, 1, synthetic_client, fail={5})
    resumed = pacfl_strategy(tmp_path / "other")
    resume(resumed, connect_test_run(resumed), load_checkpoint(tmp_path))
    assert resumed.clustered and sorted(resumed.bases) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(resumed.proximity, strategy.proximity)
    for run in (strategy, resumed):
        synthetic_round(run, manager, 2 if run is strategy else 1, synthetic_client)
    assert resumed.assignment.tolist() == strategy.assignment.tolist() and resumed.placements == strategy.placements
    assert PACFL.options_fixed_by(resumed.state_dict())[:4] == ("features", "feature_dim", "pretrained_weights", "num_basis")


# ---- end to end on digits ------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["strategy.num_clusters=2", "strategy.threshold=12.0"])
def test_pacfl_recovers_label_groups_of_real_digits_clients(label_group_config, cut, tmp_path):
    """Clients holding digits 0-4 vs 5-9 (label_groups) have different images, so their subspaces
    differ: the one-shot round recovers the groups (the smallest angles within a group are 4-10°,
    across about 17°, on this partition)."""
    overrides = [o for o in ("strategy.num_clusters=null", "strategy.threshold=null") if o.split("=")[0] != cut.split("=")[0]]
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (
        "partition.name=label_groups", "partition.groups=[[0,1,2,3,4],[5,6,7,8,9]]", "partition.samples_per_client=70",
        "strategy.name=pacfl", "strategy.client_fraction=1.0", "rounds=3", *overrides, cut)])
    strategy = run_in_process(config, tmp_path / "run")
    rows = strategy.observer.recorder.rows
    assert [r["phase"] for r in rows] == ["gram_eigen", "fedavg", "fedavg"]
    assert rows[0]["ari"] == 1.0 and rows[-1]["purity"] == 1.0 and len(strategy.models) == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["proximity_within_true_clusters"] < summary["proximity_across_true_clusters"] - 5
    assert summary["bytes_by_phase"]["gram_eigen"]["bytes_up"] > 20 * 3 * 64 * 4  # 20 clients' 3 × 64 float32 bases
    assert rows[-1]["mean_client_accuracy"] > rows[1]["mean_client_accuracy"]


def test_config_errors_name_the_key():
    def load(*overrides):
        return load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("strategy.name=pacfl", *overrides)])

    with pytest.raises(ConfigError, match="strategy.num_basis: must be >= 1, got 0"):
        load("strategy.num_clusters=4", "strategy.num_basis=0")
    with pytest.raises(ConfigError, match="strategy.num_basis: cannot exceed the 64 features of identity"):
        load("strategy.num_clusters=4", "strategy.num_basis=65")
    with pytest.raises(ConfigError, match="strategy.num_clusters: give at most one of strategy.num_clusters and strategy.threshold"):
        load("strategy.num_clusters=2", "strategy.threshold=20")
    with pytest.raises(ConfigError, match="strategy.threshold: must be > 0, got 0.0"):
        load("strategy.threshold=0.0")
    with pytest.raises(ConfigError, match="strategy.proximity: expected one of smallest_angle, sum_of_angles, elementwise_min_angle"):
        load("strategy.num_clusters=4", "strategy.proximity=trace")
    with pytest.raises(ConfigError, match="rounds: pacfl spends round 1 on clustering; give more than 1, got 1"):
        load("strategy.num_clusters=4", "rounds=1")
    with pytest.raises(ConfigError, match="strategy.num_clusters: cannot exceed partition.num_clients"):
        load("strategy.num_clusters=21")
    config, notes = load("strategy.num_clusters=2", "strategy.relevance=paper")
    assert "strategy.relevance ignored: not an option of strategy 'pacfl'" in notes  # one-shot HFL's, not PACFL's
    assert config.strategy.options.shared_layers == ()  # no GPS unless asked
