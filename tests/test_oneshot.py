"""One-shot data-similarity clustering (Ali & Arafa): the relevance math, the client's Gram
eigen-summary, the feature maps, and hierarchical training whose GPS touches only shared layers."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.client import TaskInput
from fedcluster_flwr.algorithms.oneshot.math import cluster_by_relevance, relevance_matrix, relevance_row, within_and_across
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.features import feature_map, gram_matrix, top_eigenpairs
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.aggregation import average_layers
from fedcluster_flwr.algorithms.oneshot.strategy import HFLOptions, OracleHFL
from fedcluster_flwr.algorithms.oneshot.tasks import (
    EIGENVALUES,
    EIGENVECTORS,
    EIGEN_FLOOR_KEY,
    FEATURES_KEY,
    FEATURE_DIM_KEY,
    FEATURE_SEED_KEY,
    GRAM_EIGEN,
    NUM_EIGENVECTORS_KEY,
    PRETRAINED_WEIGHTS_KEY,
    RELEVANCE,
    RELEVANCE_ROW,
    SHARE_EIGENVALUES_KEY,
    client_gram,
    relevance_to_every_client,
    top_gram_eigenpairs,
)
from helpers import load_benchmark, configure, connect_test_run, pack_reply, Received, SyntheticClient, synthetic_grid, constant_model, synthetic_round, make_setup, write_cifar

# ---- relevance -------------------------------------------------------------------------------------


def summary_of(x: np.ndarray, k: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    gram = gram_matrix(torch.as_tensor(x, dtype=torch.float64))
    vectors, values = top_eigenpairs(gram, k)
    return gram.numpy(), (vectors.numpy(), values.numpy())


def relevance_of(datasets: list[np.ndarray], k: int = 3, rule: str = "paper") -> np.ndarray:
    summaries = [summary_of(x, k) for x in datasets]
    vectors = [v for _, (v, _) in summaries]
    values = [lam for _, (_, lam) in summaries] if rule == "amiri" else None
    rows = np.stack([relevance_row(gram, vectors, values) for gram, _ in summaries])
    return relevance_matrix(rows)


def gaussian(seed: int, scales: list[float], n: int = 400) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, len(scales))) * np.asarray(scales)


@pytest.mark.parametrize("rule", ["paper", "amiri"])
def test_a_client_is_fully_relevant_to_itself_and_identical_data_gives_r_one(rule):
    data = gaussian(0, [5, 3, 2, 1, 0.5, 0.2])
    relevance = relevance_of([data, data.copy(), gaussian(1, [0.2, 0.5, 1, 2, 3, 5])], rule=rule)
    assert np.diag(relevance) == pytest.approx(1.0, abs=1e-9)
    assert relevance[0, 1] == pytest.approx(1.0, abs=1e-9)
    assert np.allclose(relevance, relevance.T)


@pytest.mark.parametrize("rule", ["paper", "amiri"])
def test_clients_of_different_distributions_are_less_relevant_and_cluster_apart(rule):
    first = [gaussian(s, [5, 3, 2, 0.3, 0.3, 0.3]) for s in range(3)]
    second = [gaussian(10 + s, [0.3, 0.3, 0.3, 2, 3, 5]) for s in range(3)]
    relevance = relevance_of(first + second, rule=rule)
    within, across = within_and_across(relevance, np.array([0, 0, 0, 1, 1, 1]))
    assert within > 0.9 and across < 0.3
    labels = cluster_by_relevance(relevance, "average", num_clusters=2).labels
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]


def test_the_papers_eq_3_compares_the_clients_own_eigenvalue_and_amiris_form_the_others():
    """Client i: G_i = diag(4, 1, 0.5). Client j shares i's principal directions e1, e2 with twice
    and a quarter of i's variance (its eigenvalues 9, 0.25). λ̂ = ‖G_i e_k‖ = 4, 1. The paper
    (eq. 3, Algorithm 2 line 10) compares λ̂_k with i's own λ_k^(i) = 4, 1: r = 1, j's directions
    carry i's variance in i's order. Amiri et al.'s form compares them with j's λ_k^(j) = 9, 0.25:
    r = sqrt(4/9 · 1/4) = 1/3."""
    gram_i = np.diag([4.0, 1.0, 0.5])
    vectors_j, values_j = np.eye(3)[:2], np.array([9.0, 0.25])
    paper = relevance_row(gram_i, [vectors_j], floor=0.0)
    amiri = relevance_row(gram_i, [vectors_j], [values_j], floor=0.0)
    assert paper[0] == pytest.approx(1.0, abs=1e-12)
    assert amiri[0] == pytest.approx(1 / 3, abs=1e-12)
    # the paper's k-th direction of j is compared with i's k-th eigenvalue: swapped directions disagree
    swapped = relevance_row(gram_i, [np.eye(3)[[1, 0]]], floor=0.0)
    assert swapped[0] == pytest.approx(np.sqrt(1 / 4 * 1 / 4), abs=1e-12)


def test_a_near_zero_eigenvalue_lowers_a_score_but_never_zeroes_it():
    """Client j has no variance along one of its top-k directions (eigenvalue 0). Unguarded, a
    round-off-sized 1e-12 on the other side makes that ratio 0 and zeroes the whole score of
    two clients with the same data; guarded, they score 1, and a client that does spread along
    that direction is lowered, not zeroed."""
    gram = np.diag([4.0, 2.0, 1.0, 1e-12])
    vectors = np.eye(4)
    values = np.array([4.0, 2.0, 1.0, 0.0])
    assert relevance_row(gram, [vectors], [values], floor=0.0)[0] == 0.0
    assert relevance_row(gram, [vectors], [values])[0] == pytest.approx(1.0, abs=1e-9)
    other = np.diag([4.0, 2.0, 1.0, 0.5])  # client i does spread along the 4th direction
    score = relevance_row(other, [vectors], [values])[0]
    assert 0.1 < score < 1.0
    assert score == pytest.approx((4e-3 / (0.5 + 4e-3)) ** 0.25, rel=1e-6)


# ---- the client's summaries, on real digits data --------------------------------------------------


@pytest.fixture(scope="module")
def label_group_config():
    overrides = ["partition.name=label_groups", "partition.groups=[[0,1,2,3,4],[5,6,7,8,9]]",
                 "partition.samples_per_client=70", "strategy.name=fedavg"]
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


FEATURE_CONFIG = {FEATURES_KEY: "identity", FEATURE_DIM_KEY: 64, FEATURE_SEED_KEY: 0, PRETRAINED_WEIGHTS_KEY: "",
                  SHARE_EIGENVALUES_KEY: False, EIGEN_FLOOR_KEY: 1e-3}
SHARING = FEATURE_CONFIG | {SHARE_EIGENVALUES_KEY: True}  # relevance: amiri


def test_eq_3_unguarded_past_the_gram_matrixs_rank_compares_no_variance_with_no_variance():
    """floor 0: directions of no variance at all (constant pixels: exact zeros, as in digits) have
    eigenvalue 0 and projection 0; 0/0 is a perfect match, not NaN, so r(i, i) stays 1 and a row
    stays finite."""
    gram = np.diag([4.0, 2.0, 1.0, 0.0, 0.0])  # rank 3 in 5 dimensions
    row = relevance_row(gram, [np.eye(5), np.eye(5)[[0, 1, 3, 4, 2]]], floor=0.0)
    assert np.isfinite(row).all()
    assert row[0] == 1.0
    assert row[1] == 0.0  # the other client's 3rd direction has none of i's variance: unguarded, 0


def test_gram_eigen_returns_the_top_eigenpairs_in_descending_order(label_group_config):
    client = Experiment(label_group_config).client(0, 20)
    output = top_gram_eigenpairs(client, TaskInput(1, {}, SHARING | {NUM_EIGENVECTORS_KEY: 5}))
    (vectors,), (values,) = output.blocks[EIGENVECTORS], output.blocks[EIGENVALUES]
    assert vectors.shape == (5, 64) and values.shape == (5,) and vectors.dtype == np.float32
    assert np.all(np.diff(values) <= 0)
    np.testing.assert_allclose(vectors @ vectors.T, np.eye(5), atol=1e-5)
    gram = client_gram(client, FEATURE_CONFIG).numpy()
    np.testing.assert_allclose(gram @ vectors.T, vectors.T * values, rtol=1e-3, atol=1e-4)
    assert values[0] == pytest.approx(np.linalg.eigvalsh(gram).max(), rel=1e-5)
    unshared = top_gram_eigenpairs(client, TaskInput(1, {}, FEATURE_CONFIG | {NUM_EIGENVECTORS_KEY: 5}))
    assert unshared.blocks[EIGENVALUES] == []  # the paper's users send eigenvectors only
    np.testing.assert_array_equal(unshared.blocks[EIGENVECTORS][0], vectors)


@pytest.mark.parametrize("config", [FEATURE_CONFIG, SHARING], ids=["paper", "amiri"])
def test_relevance_rows_of_real_clients_separate_the_two_tasks(label_group_config, config):
    clients = [Experiment(label_group_config).client(pid, 20) for pid in range(20)]
    summaries = []
    for client in clients:
        blocks = top_gram_eigenpairs(client, TaskInput(1, {}, config | {NUM_EIGENVECTORS_KEY: 5})).blocks
        summaries.append(blocks[EIGENVECTORS] + blocks[EIGENVALUES])
    rows = np.stack([
        relevance_to_every_client(client, TaskInput(2, {EIGENVECTORS: summaries}, config))
        .blocks[RELEVANCE][0] for client in clients
    ])
    assert np.diag(rows) == pytest.approx(1.0, abs=1e-4)
    relevance = relevance_matrix(rows)
    true = Experiment(label_group_config).data()[1].true_clusters
    within, across = within_and_across(relevance, true)
    assert within > across + 0.1
    labels = cluster_by_relevance(relevance, "average", num_clusters=2).labels
    assert (labels == true).all() or (labels == 1 - true).all()


def test_the_relevance_task_takes_eq_3s_eigenvalue_from_the_rule_the_instruction_names(label_group_config):
    """Ali & Arafa's eq. 3 compares λ̂_k with client i's *own* k-th eigenvalue (its users share only
    eigenvectors); Amiri et al.'s form with client j's, which j then shares. A relevance task that
    took j's values under the paper's rule, or left them out under Amiri's, gives another row: each
    rule's row is relevance_row under that rule, and the two differ on real clients of two tasks."""
    clients = [Experiment(label_group_config).client(pid, 20) for pid in (0, 1, 19)]  # 0 and 1 share a task, 19 not
    blocks = [top_gram_eigenpairs(c, TaskInput(1, {}, SHARING | {NUM_EIGENVECTORS_KEY: 5})).blocks for c in clients]
    vectors, values = [b[EIGENVECTORS][0] for b in blocks], [b[EIGENVALUES][0] for b in blocks]
    gram, floor = client_gram(clients[0], FEATURE_CONFIG).numpy(), FEATURE_CONFIG[EIGEN_FLOOR_KEY]
    rows = {}
    for rule, config, summaries in (("paper", FEATURE_CONFIG, [[v] for v in vectors]),
                                    ("amiri", SHARING, [[v, lam] for v, lam in zip(vectors, values)])):
        rows[rule] = relevance_to_every_client(clients[0], TaskInput(2, {EIGENVECTORS: summaries}, config)).blocks[RELEVANCE][0]
    np.testing.assert_allclose(rows["paper"], relevance_row(gram, vectors, floor=floor), rtol=1e-5)
    np.testing.assert_allclose(rows["amiri"], relevance_row(gram, vectors, values, floor=floor), rtol=1e-5)
    assert rows["paper"][0] == pytest.approx(1.0, abs=1e-4) and rows["amiri"][0] == pytest.approx(1.0, abs=1e-4)
    assert np.abs(rows["paper"][1:] - rows["amiri"][1:]).min() > 1e-3  # another matrix for the other clients


def test_the_relevance_task_takes_its_eigen_floor_from_the_instruction(label_group_config):
    """Digits' 64 pixels include a few that are (nearly) constant, so at k = 40 eigenvectors some
    compared eigenvalues are tiny: the guard's ε decides those ratios. The client's row is
    relevance_row at the floor the instruction carries, and a larger floor raises a score."""
    clients = [Experiment(label_group_config).client(pid, 20) for pid in (0, 19)]  # one client per task
    summaries = [top_gram_eigenpairs(c, TaskInput(1, {}, FEATURE_CONFIG | {NUM_EIGENVECTORS_KEY: 40})).blocks[EIGENVECTORS]
                 for c in clients]
    gram = client_gram(clients[0], FEATURE_CONFIG).numpy()
    rows = {}
    for floor in (0.0, 1e-3, 1e-1):
        config = FEATURE_CONFIG | {EIGEN_FLOOR_KEY: floor}
        rows[floor] = relevance_to_every_client(clients[0], TaskInput(2, {EIGENVECTORS: summaries}, config)).blocks[RELEVANCE][0]
        expected = relevance_row(gram, [s[0] for s in summaries], floor=floor)
        np.testing.assert_allclose(rows[floor], expected, rtol=1e-6)
    assert rows[0.0][1] < rows[1e-3][1] < rows[1e-1][1]  # across tasks, the floor lifts the score
    assert rows[1e-1][0] == pytest.approx(1.0, abs=1e-5)  # r(i, i) = 1 at any floor


def test_oneshot_sends_its_eigen_floor_with_the_relevance_instruction(tmp_path):
    strategy, manager = oneshot_strategy(tmp_path, eigen_floor=0.05), synthetic_grid(6)
    synthetic_round(strategy, manager, 1, one_shot_client())
    instructions = strategy.clustering_instructions(2, list(range(6)))
    assert {ins.config[EIGEN_FLOOR_KEY] for ins in instructions} == {0.05}
    from fedcluster_flwr.algorithms.oneshot.strategy import OneShotOptions

    assert OneShotOptions().eigen_floor == 1e-3  # the former constant stays the default


def test_random_projection_is_the_same_for_every_client_with_the_seed():
    x = torch.randn(10, 1, 8, 8)
    a = feature_map("random_projection", (1, 8, 8), 16, seed=3)(x)
    b = feature_map("random_projection", (1, 8, 8), 16, seed=3)(x)
    c = feature_map("random_projection", (1, 8, 8), 16, seed=4)(x)
    assert a.shape == (10, 16) and torch.equal(a, b) and not torch.equal(a, c)


def test_pretrained_features_read_a_weights_file_and_never_download(tmp_path):
    import torchvision

    with pytest.raises(ConfigError, match=f"strategy.pretrained_weights: expected the ImageNet ResNet-18 weights at {tmp_path}/missing.pth"):
        feature_map("pretrained", (1, 28, 28), 512, 0, str(tmp_path / "missing.pth"))
    torch.manual_seed(0)
    weights = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), weights)
    phi = feature_map("pretrained", (1, 28, 28), 512, 0, str(weights))(torch.randn(4, 1, 28, 28))
    assert phi.shape == (4, 512) and torch.isfinite(phi).all()


def test_config_errors_name_the_key():
    def load(*overrides):
        return load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("strategy.name=oneshot_hfl", *overrides)])

    with pytest.raises(ConfigError, match="strategy.shared_layers: 'conv' names no parameter of the model; its parameters are: fc.0.weight"):
        load("strategy.threshold=null", "strategy.num_clusters=2", "strategy.shared_layers=[conv]")
    with pytest.raises(ConfigError, match="strategy.pretrained_weights: features 'pretrained' needs the path"):
        load("strategy.threshold=null", "strategy.num_clusters=2", "strategy.features=pretrained")
    with pytest.raises(ConfigError, match="strategy.feature_dim: features random_projection needs"):
        load("strategy.threshold=null", "strategy.num_clusters=2", "strategy.features=random_projection")
    with pytest.raises(ConfigError, match="strategy.num_eigenvectors: cannot exceed the 64 features of identity"):
        load("strategy.threshold=null", "strategy.num_clusters=2", "strategy.num_eigenvectors=65")
    with pytest.raises(ConfigError, match="rounds: oneshot_hfl spends rounds 1-2 on clustering; give more than 2, got 2"):
        load("strategy.threshold=null", "strategy.num_clusters=2", "rounds=2")
    with pytest.raises(ConfigError, match="strategy.threshold: must be in \\(0, 1\\)"):
        load("strategy.threshold=20.0")
    with pytest.raises(ConfigError, match="strategy.relevance: expected one of paper, amiri; got 'eq3'"):
        load("strategy.threshold=null", "strategy.num_clusters=2", "strategy.relevance=eq3")


# ---- the GPS ----------------------------------------------------------------------------------------


def test_average_layers_replaces_only_the_shared_arrays_weighted_by_size():
    models = {0: [np.full(3, 1.0, np.float32), np.full(2, 5.0, np.float32)],
              1: [np.full(3, 4.0, np.float32), np.full(2, 7.0, np.float32)]}
    averaged = average_layers(models, {0: 2.0, 1: 1.0}, [0])
    for k in (0, 1):
        np.testing.assert_allclose(averaged[k][0], 2.0)  # (2 * 1 + 1 * 4) / 3
        assert averaged[k][1] is models[k][1]  # untouched, not even copied


def test_gps_touches_only_the_shared_layers_and_weights_by_cluster_data_size(tmp_path):
    true = np.array([0, 0, 0, 1])
    setup = make_setup(tmp_path, 4, true=true, train_sizes=[10, 10, 10, 30], parameter_names=["shared.w", "own.b"])
    strategy = OracleHFL(HFLOptions(client_fraction=1.0, shared_layers=("shared",)), setup)

    def train(client: Received):
        return constant_model(10 * true[client.pid] + client.pid), setup.train_sizes[client.pid], {}

    received = synthetic_round(strategy, synthetic_grid(4), 1, train)
    assert {client.task for client in received.values()} == {"train"} and len(received) == 4
    # LPS FedAvg: cluster 0 = mean of 0, 1, 2 = 1.0; cluster 1 = client 3's 13.0.
    # GPS on "shared.w" weighted by data size 30 vs 30: (1 + 13) / 2 = 7; "own.b" stays per LPS.
    np.testing.assert_allclose(strategy.models[0][0], 7.0)
    np.testing.assert_allclose(strategy.models[1][0], 7.0)
    np.testing.assert_allclose(strategy.models[0][1], 1.0)
    np.testing.assert_allclose(strategy.models[1][1], 13.0)
    row = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert row["bytes_gps"] == 2 * 2 * 12 * 4  # two LPS, up and down, one 4x3 float32 array


def test_gps_weights_differ_from_member_counts(tmp_path):
    true = np.array([0, 0, 0, 1])
    setup = make_setup(tmp_path, 4, true=true, train_sizes=[10, 10, 10, 90], parameter_names=["shared.w", "own.b"])
    strategy = OracleHFL(HFLOptions(shared_layers=("shared",)), setup)
    strategy.models = {0: [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)],
                       1: [np.ones((4, 3), np.float32), np.ones(3, np.float32)]}
    strategy.gps_step()
    np.testing.assert_allclose(strategy.models[0][0], 0.75)  # 90 / (30 + 90), not 1 / 4 by members
    np.testing.assert_allclose(strategy.models[0][1], 0.0)


def test_the_gps_leaves_out_an_lps_without_members_and_weighs_by_members_without_sizes(tmp_path):
    setup = make_setup(tmp_path, 3, true=np.array([0, 0, 1]), parameter_names=["shared.w", "own.b"])
    assert setup.train_sizes is None  # sizes unknown: each member counts 1
    strategy = OracleHFL(HFLOptions(shared_layers=("shared",)), setup)
    strategy.models = {0: [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)],
                       1: [np.ones((4, 3), np.float32), np.ones(3, np.float32)],
                       2: [np.full((4, 3), 5.0, np.float32), np.full(3, 5.0, np.float32)]}  # nobody's LPS
    assert strategy.cluster_data_sizes() == {0: 2.0, 1: 1.0}
    strategy.gps_step()
    np.testing.assert_allclose(strategy.models[0][0], 1 / 3)  # (2 x 0 + 1 x 1) / 3
    np.testing.assert_allclose(strategy.models[1][0], 1 / 3)
    np.testing.assert_allclose(strategy.models[2][0], 5.0)  # left out, not averaged in
    assert strategy.gps_bytes == 2 * 2 * 12 * 4  # two LPS, up and down, one 4x3 float32 array
    strategy.gps_step()
    assert strategy.gps_total == 2 * strategy.gps_bytes


def test_the_cifar10_conf_runs_on_tiny_files_in_the_real_format(tmp_path):
    """conf/oneshot_cifar10_2tasks.yaml end to end (in process) on CIFAR-10 batches written in the
    official python format: one-shot rounds, then LeNet LPS models sharing their conv layers."""
    from conftest import ROOT
    from fedcluster_flwr.apps.server_app import run_in_process

    write_cifar(tmp_path / "data", per_batch=100)
    overrides = [f"dataset.data_dir={tmp_path / 'data'}", "partition.samples_per_client=20", "rounds=3",
                 "strategy.features=random_projection", "strategy.feature_dim=64", "strategy.pretrained_weights=null"]
    config, _ = load_config(ROOT / "conf" / "oneshot_cifar10_2tasks.yaml", [parse_override(o) for o in overrides])
    strategy = run_in_process(config, tmp_path / "run")
    rows = strategy.observer.recorder.rows
    assert [r["phase"] for r in rows] == ["gram_eigen", "relevance", "lps"]
    assert strategy.clustering.round == 2 and len(strategy.models) == 2
    conv = strategy.parameter_indices(["conv"], "strategy.shared_layers")
    assert conv == [0, 1, 2, 3]
    for i in conv:  # the GPS made the conv layers identical across the two LPS models
        np.testing.assert_array_equal(strategy.models[0][i], strategy.models[1][i])
    assert not np.array_equal(strategy.models[0][-1], strategy.models[1][-1])  # the classifier stays per LPS


def test_the_cifar10_conf_takes_pretrained_features_and_says_where_the_missing_weights_go(tmp_path, monkeypatch):
    """The paper's CIFAR-10 features come from an ImageNet-pretrained ResNet-18: the conf asks for
    torchvision's file where torchvision keeps it, and without it stops with one line saying what
    to download from where, and where to put it."""
    from conftest import ROOT

    monkeypatch.setenv("HOME", str(tmp_path))  # ~ of the conf's path: an empty home
    with pytest.raises(ConfigError) as raised:
        load_config(ROOT / "conf" / "oneshot_cifar10_2tasks.yaml")
    message = str(raised.value)
    expected = tmp_path / ".cache" / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert message == (
        f"strategy.pretrained_weights: expected the ImageNet ResNet-18 weights at {expected}, which does not exist: "
        "download torchvision's resnet18-f37072fd.pth from https://download.pytorch.org/models/resnet18-f37072fd.pth "
        "and put it there (or set strategy.pretrained_weights to where it is)"
    )
    expected.parent.mkdir(parents=True)
    torch.save(torch.nn.Linear(1, 1).state_dict(), expected)  # a file there: the conf loads (its contents are read by the client)
    config, _ = load_config(ROOT / "conf" / "oneshot_cifar10_2tasks.yaml")
    assert config.strategy.options.features == "pretrained"


# ---- the one-shot phase with synthetic clients: failures, restarts, checkpoints --------------------


def oneshot_strategy(tmp_path, num_clients=6, **options):
    from fedcluster_flwr.algorithms.oneshot.strategy import OneShotHFL, OneShotOptions

    opts = dict(num_clusters=2, num_eigenvectors=2, features="identity") | options
    setup = make_setup(tmp_path, num_clients, true=np.arange(num_clients) % 2, rounds=6, checkpoint_every=1,
                       input_shape=(1, 2, 2), parameter_names=["w", "b"])
    return OneShotHFL(OneShotOptions(**opts), setup)


def one_shot_client(share_eigenvalues=None) -> SyntheticClient:
    """A synthetic one-shot client of one of two distributions (by the parity of its id): its
    gram_eigen reply is the top-2 eigenpairs of its data's Gram matrix, its relevance_row reply
    eq. 3 against the summaries it received. It shares its eigenvalues as instructed, or as
    ``share_eigenvalues`` says."""

    def reply(client: Received):
        share = client.config[SHARE_EIGENVALUES_KEY] if share_eigenvalues is None else share_eigenvalues
        x = np.random.default_rng(client.pid % 2).normal(size=(50, 4))
        gram, (vectors, values) = summary_of(x * ([3, 1, 0.3, 0.1] if client.pid % 2 else [0.1, 0.3, 1, 3]), 2)
        if client.task == RELEVANCE_ROW.name:
            summaries = client.blocks[EIGENVECTORS]
            others_values = [item[1] for item in summaries] if share else None
            return [relevance_row(gram, [item[0] for item in summaries], others_values).astype(np.float32)], 50, {}
        return pack_reply(GRAM_EIGEN, {EIGENVECTORS: [vectors.astype(np.float32)],
                                      EIGENVALUES: [values.astype(np.float32)] if share else []}), 50, {}

    return reply


def test_one_shot_clusters_synthetic_clients_and_starts_over_when_too_few_answer(tmp_path, caplog):
    strategy, manager = oneshot_strategy(tmp_path), synthetic_grid(6)
    with caplog.at_level(logging.INFO):
        synthetic_round(strategy, manager, 1, one_shot_client(), fail={0, 1, 2, 3, 4})  # one summary: fewer than 2 clusters need
        assert strategy.summaries == {} and strategy.phase(1) == "gram_eigen"
        synthetic_round(strategy, manager, 2, one_shot_client())
        assert sorted(strategy.summaries) == list(range(6))
        synthetic_round(strategy, manager, 3, one_shot_client())
    asked_again, clustered = [r.getMessage() for r in caplog.records if r.getMessage().startswith("oneshot_hfl round")]
    assert asked_again == "oneshot_hfl round 1: 1 eigen-summaries, 2 needed; asking again next round"
    assert clustered.startswith("oneshot_hfl round 3: 6 clients -> 2 clusters of sizes [3, 3]; mean R within true tasks ")
    assert strategy.clustered and strategy.clustering.round == 3
    assert strategy.assignment.tolist() in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["gram_eigen", "gram_eigen", "relevance"]


@pytest.mark.parametrize("cut, clusters, rule", [({"threshold": 1e-3}, 2, "threshold 0.001"),
                                                 ({"threshold": 0.999}, 1, "threshold 0.999"),  # above every distance
                                                 ({"num_clusters": 1}, 1, "1 cluster")])  # not the 2 the data has
def test_the_one_shot_clustering_cuts_as_configured_and_leaves_non_responders_unassigned(tmp_path, cut, clusters, rule):
    strategy, manager = oneshot_strategy(tmp_path, **({"num_clusters": None} | cut)), synthetic_grid(6)
    synthetic_round(strategy, manager, 1, one_shot_client())
    synthetic_round(strategy, manager, 2, one_shot_client(), fail={5})  # client 5 sends no relevance row
    assert strategy.clustered and strategy.clustering.num_clusters == clusters == len(strategy.models)
    assert strategy.clustering.summary()["cut"] == rule
    assert strategy.assignment[5] == -1 and (strategy.assignment[:5] >= 0).all()
    if clusters == 2:  # the same distribution's clients have the same data: distance 0 within
        assert strategy.assignment[:5].tolist() in ([0, 1, 0, 1, 0], [1, 0, 1, 0, 1])


def test_an_interrupted_one_shot_phase_resumes_where_it_stopped(tmp_path):
    from fedcluster_flwr.results.checkpoints import load_checkpoint
    from fedcluster_flwr.results.round_log import resume

    strategy, manager = oneshot_strategy(tmp_path), synthetic_grid(6)
    synthetic_round(strategy, manager, 1, one_shot_client())
    resumed = oneshot_strategy(tmp_path / "other")
    resume(resumed, connect_test_run(resumed), load_checkpoint(tmp_path))
    assert sorted(resumed.summaries) == list(range(6)) and not resumed.clustered
    for pid in range(6):
        for restored, original in zip(resumed.summaries[pid], strategy.summaries[pid], strict=True):
            np.testing.assert_array_equal(restored, original)
    synthetic_round(resumed, manager, 1, one_shot_client())  # Flower's round 1 of the rest is round 2: relevance
    assert resumed.clustered and resumed.clustering.round == 2
    again = oneshot_strategy(tmp_path / "third")
    resume(again, connect_test_run(again), load_checkpoint(tmp_path / "other"))
    assert again.clustered and again.clustering is not None and len(again.clustering.linkage) == 5
    np.testing.assert_allclose(again.relevance, resumed.relevance)


def test_the_papers_users_send_no_eigenvalues_and_a_reply_with_them_is_refused(tmp_path):
    from flwr.app import Array

    runs = {rule: oneshot_strategy(tmp_path / rule, relevance=rule) for rule in ("paper", "amiri")}
    for strategy in runs.values():
        manager = synthetic_grid(6)
        synthetic_round(strategy, manager, 1, one_shot_client())
        records = configure(strategy, 2, manager)[0].content.array_records  # the relevance instruction
        assert sorted(records) == [f"eigenvectors.{k}" for k in range(6)]
        assert {len(record) for record in records.values()} == {1 if strategy is runs["paper"] else 2}
    rows = {rule: json.loads((tmp_path / rule / "rounds.jsonl").read_text().splitlines()[0]) for rule in runs}
    eigenvalue_bytes = len(Array(np.zeros(2, np.float32)).data)  # k = 2 float32 values, serialized
    assert rows["amiri"]["bytes_up"] - rows["paper"]["bytes_up"] == 6 * eigenvalue_bytes
    assert all(len(summary) == 1 for summary in runs["paper"].summaries.values())
    assert runs["paper"].summary_entries()["eigen_summary_floats"] == 2 * 4  # k × d, no k eigenvalues
    assert runs["amiri"].summary_entries()["eigen_summary_floats"] == 2 * 4 + 2

    strict = oneshot_strategy(tmp_path / "strict")
    synthetic_round(strict, synthetic_grid(6), 1, one_shot_client(share_eigenvalues=True))  # replies the paper's users never send
    assert strict.summaries == {}
    row = json.loads((tmp_path / "strict" / "rounds.jsonl").read_text().splitlines()[0])
    assert row["rejected_updates"] == 6


def test_both_relevance_rules_cluster_the_synthetic_clients(tmp_path):
    for rule in ("paper", "amiri"):
        strategy, manager = oneshot_strategy(tmp_path / rule, relevance=rule), synthetic_grid(6)
        synthetic_round(strategy, manager, 1, one_shot_client())
        synthetic_round(strategy, manager, 2, one_shot_client())
        assert strategy.clustered and strategy.assignment.tolist() in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
        assert strategy.summary_entries()["relevance_rule"] == rule


@pytest.mark.skipif(not os.environ.get("FEDCLUSTER_DATA_DIR"), reason="needs Fashion-MNIST under FEDCLUSTER_DATA_DIR")
def test_the_benchmark_s_k_sweep_runs_on_the_conf_and_finds_its_tasks():
    """benchmarks/oneshot/run.py builds the relevance instruction itself (no Flower round); it broke
    once when the instruction gained a key (eigen_floor). Its k = 5 row is the README's."""
    module = load_benchmark("oneshot/run.py")
    sweep = module.clustering_vs_k(0, (1, 5))
    for rule in ("paper", "amiri"):
        assert sweep[rule][5]["ari"] == 1.0
        assert sweep[rule][5]["within"] > 0.9 > 0.5 > sweep[rule][5]["across"]
