"""Distances, hierarchical clustering and cluster scores on synthetic update vectors."""

from __future__ import annotations

import importlib.util
import itertools
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from scipy.cluster import hierarchy
from scipy.spatial.distance import pdist, squareform

from fedcluster_flwr.clustering import (
    DISTANCES,
    LINKAGES,
    UpdateMatrix,
    cluster_scores,
    hierarchical_clustering,
    pairwise_distances,
    purity,
    renumber,
    silhouette_cut,
)

VALID_PAIRS = [(d, link) for d, link in itertools.product(DISTANCES, LINKAGES) if link != "ward" or d == "l2"]


def grouped_updates(num_groups: int = 4, per_group: int = 6, dim: int = 400, seed: int = 0):
    """Update vectors whose groups point in clearly different directions (as label swaps do)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_groups, dim)).astype(np.float32)
    true = np.repeat(np.arange(num_groups), per_group)
    vectors = centres[true] + 0.15 * rng.normal(size=(len(true), dim)).astype(np.float32)
    order = rng.permutation(len(true))
    return vectors[order], true[order]


@pytest.mark.parametrize("distance", DISTANCES)
def test_pairwise_distances_match_scipy_pdist(distance):
    vectors, _ = grouped_updates(dim=50)
    metric = {"l1": "cityblock", "l2": "euclidean", "cosine": "cosine"}[distance]
    expected = pdist(vectors.astype(np.float64), metric=metric)
    np.testing.assert_allclose(pairwise_distances(vectors, distance), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("distance", DISTANCES)
def test_blocked_distances_equal_unblocked(distance):
    """1 MB of working memory splits every computation into several blocks; results must match scipy."""
    vectors = np.random.default_rng(0).normal(size=(400, 700)).astype(np.float32)
    assert 2**20 // (12 * len(vectors)) < len(vectors)  # l2/cosine: several blocks of rows
    assert 2**20 // (16 * vectors.shape[1]) < len(vectors)  # row norms and l1: several blocks
    metric = {"l1": "cityblock", "l2": "euclidean", "cosine": "cosine"}[distance]
    expected = pdist(vectors.astype(np.float64), metric=metric)
    np.testing.assert_allclose(pairwise_distances(vectors, distance, working_memory_mb=1), expected, rtol=1e-5)


@pytest.mark.parametrize("distance", DISTANCES)
def test_distances_stay_within_the_working_memory(distance):
    """Extra memory is the blocks plus the N x N result, never a copy of the update matrix."""
    vectors = np.random.default_rng(0).normal(size=(64, 200_000)).astype(np.float32)  # 49 MB
    tracemalloc.start()
    pairwise_distances(vectors, distance, working_memory_mb=4)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 12 * 2**20, f"{peak / 2**20:.1f} MB extra for a {vectors.nbytes / 2**20:.0f} MB matrix"


@pytest.mark.parametrize(("distance", "linkage"), VALID_PAIRS)
def test_known_groups_are_recovered_by_every_distance_and_linkage(distance, linkage):
    vectors, true = grouped_updates()
    result = hierarchical_clustering(vectors, distance, linkage, num_clusters=4)
    assert result.num_clusters == 4
    assert cluster_scores(true, result.labels) == pytest.approx({"purity": 1.0, "ari": 1.0, "nmi": 1.0})
    assert result.linkage.shape == (len(vectors) - 1, 4)


@pytest.mark.parametrize(("distance", "linkage"), VALID_PAIRS)
def test_threshold_cut_between_within_and_across_group_distances(distance, linkage):
    vectors, true = grouped_updates()
    dist = pairwise_distances(vectors, distance)
    same = true[:, None] == true[None, :]
    square = np.zeros((len(true), len(true)))
    square[np.triu_indices(len(true), 1)] = dist
    square = square + square.T
    within = square[same & ~np.eye(len(true), dtype=bool)].max()
    across = square[~same].min()
    assert within < across  # the synthetic groups are separable at all
    if linkage == "ward":
        threshold = None  # ward merge heights are not distances between points; cut by count
        result = hierarchical_clustering(vectors, distance, linkage, num_clusters=4)
    else:
        threshold = (within + across) / 2
        result = hierarchical_clustering(vectors, distance, linkage, threshold=threshold)
    assert purity(true, result.labels) == 1.0 and result.num_clusters == 4, threshold


def test_one_group_is_not_split_at_a_threshold_above_its_spread():
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(12, 100)).astype(np.float32)
    max_distance = pairwise_distances(vectors, "l2").max()
    result = hierarchical_clustering(vectors, "l2", "complete", threshold=max_distance * 1.01)
    assert result.num_clusters == 1


@pytest.mark.parametrize("distance", ["l1", "cosine"])
def test_ward_needs_l2(distance):
    vectors, _ = grouped_updates()
    with pytest.raises(ValueError, match="ward"):
        hierarchical_clustering(vectors, distance, "ward", num_clusters=2)


def test_at_most_one_of_threshold_and_num_clusters():
    vectors, _ = grouped_updates()
    with pytest.raises(ValueError, match="at most one"):
        hierarchical_clustering(vectors, "l2", "single", threshold=1.0, num_clusters=2)


@pytest.mark.parametrize("num_groups", [2, 3, 5])
@pytest.mark.parametrize(("distance", "linkage"), [("l1", "complete"), ("l2", "average"), ("cosine", "single")])
def test_without_a_cut_the_largest_silhouette_finds_the_groups(num_groups, distance, linkage):
    vectors, true = grouped_updates(num_groups=num_groups, per_group=5, seed=num_groups)
    result = hierarchical_clustering(vectors, distance, linkage)
    assert result.num_clusters == num_groups and purity(true, result.labels) == 1.0


def test_the_silhouette_cut_is_the_k_with_the_largest_silhouette():
    from sklearn.metrics import silhouette_score

    rng = np.random.default_rng(7)
    distances = pdist(rng.normal(size=(15, 6)))  # no groups: every K scores something
    tree = hierarchy.linkage(distances, method="average")
    scores = {k: silhouette_score(squareform(distances), hierarchy.fcluster(tree, k, "maxclust"), metric="precomputed")
              for k in range(2, 15)}
    chosen = silhouette_cut(tree, distances)
    assert chosen.max() == max(scores, key=scores.get)
    assert np.array_equal(silhouette_cut(hierarchy.linkage(pdist(np.eye(2)), "single"), pdist(np.eye(2))), [1, 1])


def test_the_silhouette_cut_skips_numbers_of_clusters_that_tied_merges_make_impossible():
    grid = np.array([[i, j] for i in range(4) for j in range(3)], dtype=float)
    grid[:6] += 10  # two grids of 6 points; inside each, every single-linkage merge is at distance 1
    distances = pdist(grid, "cityblock")
    labels = silhouette_cut(hierarchy.linkage(distances, "single"), distances)
    assert labels.tolist() == [1] * 6 + [2] * 6


def test_single_vector_forms_one_cluster():
    result = hierarchical_clustering(np.ones((1, 5), np.float32), "l2", "average", threshold=1.0)
    assert result.labels.tolist() == [0]


def test_a_zero_update_is_at_cosine_distance_one_from_all():
    vectors = np.vstack([np.zeros(10), np.ones(10), -np.ones(10)]).astype(np.float32)
    square = squareform(pairwise_distances(vectors, "cosine"))
    np.testing.assert_allclose(square[0, 1:], 1.0)
    assert square[1, 2] == pytest.approx(2.0)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_random_projection_keeps_the_clusters(distance):
    vectors, true = grouped_updates(dim=20000)
    matrix = UpdateMatrix(len(vectors), vectors.shape[1], projection_dim=256, seed=3)
    for row, vector in enumerate(vectors):
        matrix.set_row(row, vector)
    assert matrix.rows.shape == (len(vectors), 256) and matrix.rows.dtype == np.float32
    result = hierarchical_clustering(matrix.rows, distance, "average", num_clusters=4)
    assert purity(true, result.labels) == 1.0


def test_update_matrix_without_projection_stores_rows_in_float32():
    matrix = UpdateMatrix(2, 3)
    matrix.set_row(1, np.array([1.0, 2.0, 3.0]))
    assert matrix.rows.dtype == np.float32
    assert matrix.rows.tolist() == [[0, 0, 0], [1, 2, 3]]


def test_renumber_orders_clusters_by_first_member():
    assert renumber(np.array([3, 3, 1, 2, 1])).tolist() == [0, 0, 1, 2, 1]


def test_scores_are_label_permutation_invariant():
    true = np.array([0, 0, 1, 1, 2, 2])
    assert cluster_scores(true, np.array([5, 5, 0, 0, 9, 9])) == pytest.approx({"purity": 1, "ari": 1, "nmi": 1})
    mixed = cluster_scores(true, np.array([0, 1, 0, 1, 0, 1]))
    assert mixed["purity"] == pytest.approx(2 / 6) and mixed["ari"] < 0.1  # each predicted cluster holds one of each


def test_purity_counts_majorities():
    # predicted cluster A holds true 0,0,1 ; B holds 1,1 -> majorities 2 + 2 of 5
    assert purity(np.array([0, 0, 1, 1, 1]), np.array([0, 0, 0, 1, 1])) == pytest.approx(4 / 5)


def load_calibrate():
    """benchmarks/flhc/calibrate.py is a script, not a package module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "flhc" / "calibrate.py"
    spec = importlib.util.spec_from_file_location("calibrate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_interval_is_low_inclusive_high_exclusive():
    calibrate = load_calibrate()
    vectors, true = grouped_updates()
    tree = hierarchy.linkage(pairwise_distances(vectors, "l2"), method="complete")
    low, high = calibrate.exact_threshold_interval(tree, true)
    for t, exact in ((low, True), ((low + high) / 2, True), (high, False)):
        labels = hierarchy.fcluster(tree, t=t, criterion="distance")
        assert (cluster_scores(true, labels)["ari"] == 1.0) is exact, t


def test_calibration_reports_none_when_no_cut_recovers_the_truth():
    calibrate = load_calibrate()
    vectors, _ = grouped_updates()
    tree = hierarchy.linkage(pairwise_distances(vectors, "l2"), method="average")
    shuffled = np.random.default_rng(0).permutation(np.repeat(np.arange(4), 6))  # unrelated to the groups
    assert calibrate.exact_threshold_interval(tree, shuffled) is None
