"""Distances, hierarchical clustering and cluster scores on synthetic update vectors."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.cluster import hierarchy
from scipy.spatial.distance import pdist, squareform

from fedcluster_flwr import clustering
from fedcluster_flwr.clustering import DISTANCES, LINKAGES, UpdateMatrix, cluster_scores, hierarchical_clustering, pairwise_distances, purity, renumber, silhouette_cut
from fedcluster_flwr.l1_kernel import add_l1_distances
from helpers import load_benchmark

VALID_PAIRS = [(d, link) for d, link in itertools.product(DISTANCES, LINKAGES) if link != "ward" or d == "l2"]


def grouped_updates(num_groups: int = 4, per_group: int = 6, dim: int = 400, seed: int = 0):
    """Update vectors whose groups point in clearly different directions (as label swaps do)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_groups, dim)).astype(np.float32)
    true = np.repeat(np.arange(num_groups), per_group)
    vectors = centres[true] + 0.15 * rng.normal(size=(len(true), dim)).astype(np.float32)
    order = rng.permutation(len(true))
    return vectors[order], true[order]


SCIPY_METRIC = {"l1": "cityblock", "l2": "euclidean", "cosine": "cosine"}
# Largest relative difference from scipy's float64 pdist for float32 input: the sums over a block
# of columns run in float32; l2 comes from the Gram matrix, |a|^2 + |b|^2 - 2 a.b, whose
# cancellation grows the error for updates close together relative to their norms.
FLOAT32_RTOL = {"l1": 1e-6, "l2": 1e-5, "cosine": 1e-6}


def random_rows(count: int, dim: int, seed: int = 0, zero_rows: tuple[int, ...] = ()) -> np.ndarray:
    vectors = np.random.default_rng(seed).normal(size=(count, dim)).astype(np.float32)
    vectors[list(zero_rows)] = 0.0
    return vectors


def assert_matches_pdist(vectors: np.ndarray, distance: str, got: np.ndarray, rtol: float) -> None:
    """``got`` is scipy's float64 pdist of ``vectors`` within ``rtol``; pairs with a zero row are left
    out for cosine (scipy: NaN; ours: 1, see test_a_zero_update_is_at_cosine_distance_one_from_all)."""
    expected = pdist(vectors.astype(np.float64), metric=SCIPY_METRIC[distance])
    defined = np.isfinite(expected)
    assert got.shape == expected.shape and got.dtype == np.float64
    np.testing.assert_allclose(got[defined], expected[defined], rtol=rtol, atol=rtol * expected[defined].max(initial=0))


@pytest.mark.parametrize("distance", DISTANCES)
@pytest.mark.parametrize(("count", "dim", "zero_rows"), [(2, 3, ()), (13, 50, (0,)), (40, 3000, (5, 17))])
def test_pairwise_distances_match_scipy_pdist(distance, count, dim, zero_rows):
    vectors = random_rows(count, dim, zero_rows=zero_rows)
    assert_matches_pdist(vectors, distance, pairwise_distances(vectors, distance), FLOAT32_RTOL[distance])


@pytest.mark.parametrize("count", range(1, 11))
@pytest.mark.parametrize("dim", [1, 2, 3, 4, 5, 9])
def test_l1_kernel_adds_every_pair_once_whatever_the_row_and_column_tails(count, dim):
    """The l1 kernel takes rows four at a time and columns four at a time: for every remainder of
    each, down to one row (no pairs) and one column, it adds scipy's distance to each pair's
    entry of the condensed sum, once."""
    vectors = random_rows(count, dim, seed=count * 10 + dim)
    total = np.random.default_rng(count).uniform(1, 2, size=count * (count - 1) // 2)
    before = total.copy()
    add_l1_distances(np.ascontiguousarray(vectors.T), total)
    assert_matches_pdist(vectors, "l1", total - before, FLOAT32_RTOL["l1"])
    assert_matches_pdist(vectors, "l1", pairwise_distances(vectors, "l1"), FLOAT32_RTOL["l1"])


@pytest.mark.parametrize("distance", DISTANCES)
def test_grouped_updates_match_scipy_pdist(distance):
    """Updates close together within their group (where l2's Gram cancellation is largest)."""
    vectors, _ = grouped_updates(dim=2000)
    assert_matches_pdist(vectors, distance, pairwise_distances(vectors, distance), FLOAT32_RTOL[distance])


@pytest.mark.parametrize("distance", DISTANCES)
def test_float64_input_is_computed_in_float64(distance):
    vectors = random_rows(20, 500, zero_rows=(3,)).astype(np.float64)
    assert_matches_pdist(vectors, distance, pairwise_distances(vectors, distance), 1e-12)


@pytest.mark.parametrize("distance", DISTANCES)
def test_many_column_blocks_equal_one(distance):
    """Blocks of 7 columns (several per worker, the last one short) give scipy's distances too."""
    vectors = random_rows(30, 1000, zero_rows=(2,))
    blocked = pairwise_distances(vectors, distance, block_columns=7)
    assert_matches_pdist(vectors, distance, blocked, FLOAT32_RTOL[distance])
    one_block = pairwise_distances(vectors, distance, block_columns=1000)
    np.testing.assert_allclose(blocked, one_block, rtol=FLOAT32_RTOL[distance])


@pytest.mark.parametrize("distance", DISTANCES)
def test_distances_are_reproducible_and_restore_torch_threads(distance):
    """The server step runs one worker per core with one torch thread each; the caller's torch
    thread count (one, as the simulation sets it, or more) is restored, and a repeat is bit-identical."""
    vectors = random_rows(25, 2000)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            first = pairwise_distances(vectors, distance, block_columns=64)
            assert torch.get_num_threads() == threads
            assert np.array_equal(first, pairwise_distances(vectors, distance, block_columns=64))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("distance", DISTANCES)
def test_worker_count_changes_only_the_float64_summation_order(distance, monkeypatch):
    vectors = random_rows(25, 2000)
    results = []
    for cores in (1, 3):
        monkeypatch.setattr(clustering, "available_cores", lambda cores=cores: cores)
        results.append(pairwise_distances(vectors, distance, block_columns=64))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-12)


def resident_gb(field: str) -> float:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 2**20


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("distance", DISTANCES)
def test_distances_never_copy_the_update_matrix(distance):
    """The step's peak resident memory above what was resident before it (torch's allocations
    included, which tracemalloc does not see) stays far below the 98 MB matrix: a block per
    worker (1 MB), a few N x N matrices and the worker threads' allocator overhead (measured:
    up to 13 MB)."""
    vectors = random_rows(64, 400_000)  # 98 MB
    pairwise_distances(vectors[:, :1000], distance)  # torch's one-off start-up allocations
    before = resident_gb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    pairwise_distances(vectors, distance)
    extra = resident_gb("VmHWM") - before
    assert extra < 25 / 1024, f"{extra * 1024:.1f} MB extra for a {vectors.nbytes / 2**20:.0f} MB matrix"


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
    assert result.sizes_text() == "1 cluster of size 12"
    split = hierarchical_clustering(vectors, "l2", "complete", num_clusters=2)
    assert split.sizes_text() == f"2 clusters of sizes {np.bincount(split.labels).tolist()}"


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


def silhouette_reference(square: np.ndarray, method: str) -> tuple[np.ndarray, dict[int, float]]:
    """The cut by definition: every K in 2..N-1 that scipy's ``maxclust`` can make, scored by
    scikit-learn's silhouette; the largest wins, ties to the smaller K; one cluster if no K."""
    from sklearn.metrics import silhouette_score

    tree = hierarchy.linkage(squareform(square), method=method)
    scores = {}
    for k in range(2, len(square)):
        labels = hierarchy.fcluster(tree, k, "maxclust")
        if len(set(labels)) == k:
            scores[k] = silhouette_score(square, labels, metric="precomputed")
    best = max(scores, key=lambda k: (scores[k], -k)) if scores else 1
    return hierarchy.fcluster(tree, best, "maxclust"), scores


@pytest.mark.parametrize("method", ["single", "complete", "average"])
def test_the_silhouette_cut_agrees_with_its_definition_on_small_tied_distances(method):
    """Integer distances in 1..3 between 3 to 7 items: many tied merges, so Ks that cannot be cut
    (skipped), and the walk's bookkeeping at every K against scikit-learn's silhouette per K."""
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(150):
        n = int(rng.integers(3, 8))
        square = np.triu(rng.integers(1, 4, size=(n, n)).astype(float), 1)
        square += square.T
        expected, scores = silhouette_reference(square, method)
        ranked = sorted(scores.values(), reverse=True)
        if len(ranked) > 1 and ranked[0] - ranked[1] < 1e-9:
            continue  # a tie in exact arithmetic: round-off may order it either way
        got = silhouette_cut(hierarchy.linkage(squareform(square), method=method), squareform(square))
        assert got.tolist() == expected.tolist(), (square.tolist(), scores)
        checked += 1
    assert checked > 100


def test_the_silhouette_cut_takes_the_smaller_k_on_a_tie_and_stops_at_the_singletons_bound(monkeypatch):
    """Every K scores 0.5 here: K = 2 wins the tie; and past K = 5 of 8 items, where at least
    2K - N items are alone (silhouette 0), the mean cannot exceed 2 (N - K) / N <= 0.5: K = 6 and 7
    are never scored."""
    scored = []

    def same_score(summed, sizes, label):
        scored.append(summed.shape[1])
        return 0.5

    monkeypatch.setattr(clustering, "_mean_silhouette", same_score)
    distances = pdist(np.random.default_rng(3).normal(size=(8, 4)))
    tree = hierarchy.linkage(distances, "average")
    assert len(set(tree[:, 2])) == 7  # no tied merges: every K can be cut
    labels = silhouette_cut(tree, distances)
    assert scored == [2, 3, 4, 5] and labels.max() == 2


def test_an_item_at_distance_0_from_its_own_and_the_nearest_cluster_scores_0_without_a_floating_point_error():
    square = np.array([[0, 2, 1, 1, 1, 2], [2, 0, 0, 1, 2, 1], [1, 0, 0, 2, 0, 1],
                       [1, 1, 2, 0, 1, 1], [1, 2, 0, 1, 0, 2], [2, 1, 1, 1, 2, 0]], dtype=float)
    expected, _ = silhouette_reference(square, "average")
    with np.errstate(all="raise"):  # 0 / 0 in the silhouette is an item's 0, not an error
        labels = silhouette_cut(hierarchy.linkage(squareform(square), "average"), squareform(square))
    assert labels.tolist() == expected.tolist()


def test_fewer_than_three_items_are_one_cluster_of_integer_labels():
    for tree, distances in ((np.zeros((0, 4)), np.zeros(0)), (hierarchy.linkage([1.0], "single"), np.array([1.0]))):
        labels = silhouette_cut(tree, distances)
        assert labels.tolist() == [1] * (len(tree) + 1) and labels.dtype.kind == "i"


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


def test_renumber_orders_clusters_by_first_member_as_int64():
    assert renumber(np.array([3, 3, 1, 2, 1])).tolist() == [0, 0, 1, 2, 1]
    labels = renumber(np.array([7, -1, 7, 3, -1]))  # any label values, negative ones included
    assert labels.dtype == np.int64 and labels.tolist() == [0, 1, 0, 2, 1]


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
    return load_benchmark("flhc/calibrate.py")


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


def test_a_clustering_record_survives_its_state_and_summarises_itself():
    hac = hierarchical_clustering(np.array([[0.0], [0.1], [5.0]], np.float32), "l2", "single", num_clusters=2)
    record = clustering.ClusteringRecord.of(4, [7, 3, 9], hac, "2 clusters")
    again = clustering.ClusteringRecord.from_state(record.state_dict())
    assert (again.round, again.pids, again.cut) == (4, (7, 3, 9), "2 clusters")
    assert np.array_equal(again.labels, record.labels) and np.array_equal(again.linkage, record.linkage)
    assert record.summary() == {
        "clustering_round": 4, "clusters_found": 2, "clustered_clients": [7, 3, 9], "clustering_labels": [0, 0, 1],
        "merge_heights": pytest.approx([0.1, 4.9], rel=1e-6), "cut": "2 clusters",
    }
    older = {k: v for k, v in record.state_dict().items() if k != "cut"}
    assert clustering.ClusteringRecord.from_state(older).cut == "not recorded (checkpoint older than the cut's record)"
    assert clustering.ClusteringRecord.from_state(None) is None


def test_the_update_matrix_projects_only_to_fewer_dimensions_and_by_its_seed():
    vector = np.random.default_rng(0).normal(size=50).astype(np.float32)
    same = UpdateMatrix(1, 50, projection_dim=50)
    same.set_row(0, vector)
    assert np.array_equal(same.rows[0], vector)  # projection_dim = dim: kept as it is
    projected = [UpdateMatrix(1, 50, projection_dim=10) for _ in range(2)] + [UpdateMatrix(1, 50, projection_dim=10, seed=1)]
    for matrix in projected:
        matrix.set_row(0, vector)
    assert projected[0].rows.shape == (1, 10) and np.array_equal(projected[0].rows, projected[1].rows)
    assert not np.array_equal(projected[0].rows, projected[2].rows)
    from sklearn.random_projection import SparseRandomProjection

    expected = SparseRandomProjection(n_components=10, random_state=0).fit(np.zeros((1, 50))).transform(vector[None, :])
    np.testing.assert_allclose(projected[0].rows[0], np.asarray(expected.todense() if hasattr(expected, "todense") else expected)[0], rtol=1e-5)


def test_available_cores_counts_the_affinity_and_falls_back_to_the_cpu_count(monkeypatch):
    """The cores this process may use: its affinity where the platform reports one (not the machine's
    count), else os.cpu_count(), else 1."""
    from fedcluster_flwr.clustering import available_cores

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert available_cores() == 1
    monkeypatch.delattr(os, "sched_getaffinity")
    assert available_cores() == 4
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # the count is unknown
    assert available_cores() == 1


def test_pairwise_distances_names_an_unknown_distance_and_reads_integers_as_float32():
    with pytest.raises(ValueError, match=r"^unknown distance 'l3'; expected one of "):
        pairwise_distances(np.zeros((2, 3), np.float32), "l3")
    ints = np.array([[0, 2**24 + 1], [0, 0]])  # 2**24 + 1 has no float32: it reads as 2**24
    for distance in ("l1", "l2"):
        assert pairwise_distances(ints, distance).tolist() == [2.0**24], distance


def test_hierarchical_clustering_names_an_unknown_linkage_and_what_ward_needs():
    vectors = np.array([[0.0], [1.0]], np.float32)
    with pytest.raises(ValueError, match=r"^unknown linkage 'median'; expected one of "):
        hierarchical_clustering(vectors, "l2", "median", num_clusters=1)
    with pytest.raises(ValueError, match=r"^ward linkage needs l2 \(Euclidean\) distances$"):
        hierarchical_clustering(vectors, "cosine", "ward", num_clusters=1)


def test_a_clustering_records_dendrogram_draws_its_own_tree_title_and_cut():
    hac = hierarchical_clustering(np.array([[0.0], [0.1], [5.0]], np.float32), "l2", "single", num_clusters=2)
    record = clustering.ClusteringRecord.of(4, [7, 3, 9], hac, "2 clusters")
    draw = record.dendrogram(np.array([0, 0, 0, 1, 0, 0, 0, 0, 0, 1]), None, "FL+HC, round 4")
    assert draw.args[1:] == (["7:0", "3:1", "9:1"], None) and draw.args[0] is record.linkage
    assert draw.keywords == {"title": "FL+HC, round 4", "num_clusters": 2}
