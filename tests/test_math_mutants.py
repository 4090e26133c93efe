"""Edges of the paper math and the averaging that the mutation run (docs/development.md, "Mutation
testing") found untested: declared bounds, empty inputs, ties, the floor's scale, errors' words.
Each case is small and computed by hand."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fedcluster_flwr.aggregation import average_layers, lowest, weighted_mean
from fedcluster_flwr.algorithms.cfl.math import bipartition, cosine_similarity
from fedcluster_flwr.algorithms.dac.math import centred_tau, two_hop_similarities
from fedcluster_flwr.algorithms.oneshot.math import cluster_by_relevance, relevance_row, within_and_across
from fedcluster_flwr.algorithms.pacfl.math import closest_cluster, principal_angles, subspace_proximity
from fedcluster_flwr.clustering import cluster_condensed, cluster_scores, cluster_square, flatten, mean_by, purity

# ---- aggregation -------------------------------------------------------------------------------


def test_averaging_no_layers_or_no_models_returns_the_models_as_they_are():
    models = {3: [np.ones(2), np.zeros(1)], 5: [np.full(2, 3.0), np.ones(1)]}
    kept = average_layers(models, {3: 1.0, 5: 1.0}, [])
    assert kept == models and all(kept[k] is models[k] for k in models)
    assert average_layers({}, {}, [0]) == {}


def test_one_model_averaged_with_itself_keeps_its_values_and_dtype():
    models = {7: [np.array([1.5, -2.0], dtype=np.float32), np.array([4], dtype=np.int64)]}
    averaged = average_layers(models, {7: 10.0}, [0, 1])
    assert averaged[7][0].dtype == np.float32 and averaged[7][1].dtype == np.int64
    np.testing.assert_allclose(averaged[7][0], [1.5, -2.0])
    assert averaged[7][1].tolist() == [4]



def test_the_weighted_mean_normalises_the_weights_and_sums_in_float64():
    # 1e8 + 1 is not a float32, so a float32 sum would lose the 1; the weights sum to 4, not to 1
    big = [np.array([1e8], dtype=np.float32), np.array([2, 4], dtype=np.int64)]
    small = [np.array([1e8 + 4], dtype=np.float64), np.array([6, 8], dtype=np.int64)]
    mean = weighted_mean(iter([big, small]), [3.0, 1.0], [np.float64, np.int64])
    assert mean[0].dtype == np.float64 and mean[1].dtype == np.int64
    assert mean[0].tolist() == [1e8 + 1.0]
    assert mean[1].tolist() == [3, 5]


def test_the_weighted_mean_multiplies_in_float64_not_in_the_models_dtype():
    # 1 x 1/3 is 0.3333333433 in float32; float64 keeps the mean (1 + 3 x 2) / 3 to 1e-15
    one, three = [np.array([1.0], dtype=np.float32)], [np.array([3.0], dtype=np.float32)]
    mean = weighted_mean([one, three], [1.0, 2.0], [np.float64])
    assert abs(mean[0][0] - 7 / 3) < 1e-15


def test_the_weighted_mean_of_one_model_is_that_model_whatever_its_weight():
    model = [np.array([[1.5, -2.0]], dtype=np.float32)]
    mean = weighted_mean([model], [7.0], [np.float32])
    assert mean[0].shape == (1, 2) and mean[0].tolist() == [[1.5, -2.0]]


# ---- clustering's helpers ----------------------------------------------------------------------


def test_flatten_concatenates_in_order_as_float32():
    flat = flatten([np.array([[1, 2], [3, 4]], dtype=np.int64), np.array([5.5], dtype=np.float64)])
    assert flat.dtype == np.float32 and flat.tolist() == [1, 2, 3, 4, 5.5]


def test_mean_by_averages_per_group_numbers_first_in_numeric_order_then_names():
    values = {0: 1.0, 1: 3.0, 2: 10.0, 3: 4.0, 4: 6.0, 5: 8.0}
    groups = {0: "10", 1: "10", 2: "b", 3: "-5", 4: "2", 5: "a"}
    means = mean_by(values, groups)
    assert list(means) == ["-5", "2", "10", "a", "b"]
    assert means == {"-5": 4.0, "2": 6.0, "10": 2.0, "a": 8.0, "b": 10.0}
    assert list(mean_by({0: 1.0, 1: 2.0}, {0: "X1", 1: "7"})) == ["7", "X1"]  # "X1" is a name, not a number
    assert all(type(v) is float for v in means.values())


def test_purity_and_scores_of_no_clients_are_nan():
    empty = np.array([], dtype=np.int64)
    assert math.isnan(purity(empty, empty))
    scores = cluster_scores(empty, empty)
    assert list(scores) == ["purity", "ari", "nmi"] and all(math.isnan(v) for v in scores.values())


def test_scores_of_a_half_right_clustering_are_the_hand_computed_ones():
    true, predicted = np.array([0, 0, 1, 1]), np.array([0, 0, 0, 1])
    scores = cluster_scores(true, predicted)
    assert scores["purity"] == 0.75  # cluster 0 holds true 0,0,1 (majority 2), cluster 1 holds 1
    assert scores["ari"] == pytest.approx(0.0)  # sklearn's ARI of this split is exactly 0
    assert 0.0 < scores["nmi"] < 1.0 and all(type(v) is float for v in scores.values())


def test_cluster_condensed_of_fewer_than_two_items_is_one_cluster_without_a_tree():
    for count in (0, 1):
        distances = np.zeros(0)
        result = cluster_condensed(distances, count, "single")
        assert result.labels.tolist() == [0] * count and result.labels.dtype == np.int64
        assert result.linkage.shape == (0, 4) and result.distances is distances
        assert result.num_clusters == count


def test_cluster_condensed_cuts_by_threshold_by_count_or_by_silhouette():
    # five points on a line, 0, 1 | 10, 12 | 30 (gaps all different: no tied merges)
    points = np.array([0.0, 1.0, 10.0, 12.0, 30.0])
    square = np.abs(points[:, None] - points[None, :])
    condensed = square[np.triu_indices(5, 1)]
    by_threshold = cluster_condensed(condensed, 5, "single", threshold=2.5)
    assert by_threshold.labels.tolist() == [0, 0, 1, 1, 2]
    assert cluster_condensed(condensed, 5, "single", threshold=9.5).labels.tolist() == [0, 0, 0, 0, 1]
    by_count = cluster_condensed(condensed, 5, "single", num_clusters=2)
    assert by_count.labels.tolist() == [0, 0, 0, 0, 1] and by_count.linkage.shape == (4, 4)
    assert cluster_condensed(condensed, 5, "complete", num_clusters=4).labels.tolist() == [0, 0, 1, 2, 3]
    by_silhouette = cluster_condensed(condensed, 5, "single")
    assert by_silhouette.labels.tolist() == [0, 0, 1, 1, 2] and by_silhouette.distances is condensed
    assert cluster_condensed(condensed, 5, "complete", num_clusters=2).linkage[-1, 2] == 30.0  # single: 18
    with pytest.raises(ValueError, match="^give at most one of threshold and num_clusters$"):
        cluster_condensed(condensed, 5, "single", threshold=1.0, num_clusters=2)


def test_two_items_are_clustered_not_taken_as_one():
    assert cluster_condensed(np.array([5.0]), 2, "single", threshold=1.0).labels.tolist() == [0, 1]
    assert cluster_condensed(np.array([5.0]), 2, "single", threshold=6.0).labels.tolist() == [0, 0]


def test_cluster_square_ignores_the_diagonal_and_leaves_its_input_alone():
    points = np.array([0.0, 1.0, 10.0, 12.0])  # gaps all different: no tied merges
    square = np.abs(points[:, None] - points[None, :])
    np.fill_diagonal(square, 99.0)  # e.g. a similarity's own row: must not count as a distance
    before = square.copy()
    assert cluster_square(square, "average", threshold=3.0).labels.tolist() == [0, 0, 1, 1]
    assert cluster_square(square, "average", num_clusters=3).labels.tolist() == [0, 0, 1, 2]
    assert cluster_square(square, "average").labels.tolist() == [0, 0, 1, 1]
    assert cluster_square(square, "single").distances.tolist() == [1, 10, 12, 9, 11, 2]
    np.testing.assert_array_equal(square, before)


def test_cluster_square_reads_the_entries_above_the_diagonal_only():
    # below the diagonal: garbage that would join 0 and 3 (round-off makes real matrices unequal too)
    square = np.array([[0.0, 1.0, 10.0, 12.0], [0.0, 0.0, 9.0, 11.0], [0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    square[3, 0] = 1e-9
    assert cluster_square(square, "single", threshold=3.0).labels.tolist() == [0, 0, 1, 1]


# ---- DAC ---------------------------------------------------------------------------------------


def test_the_centred_tau_of_a_short_run_uses_its_own_tenth_as_the_width():
    """τ_max · σ((t − T/2) / (T/10)) at T = 5: the width is 0.5, not clamped to 1."""
    assert centred_tau(3, 10.0, 5) == pytest.approx(10.0 / (1 + math.exp(-(3 - 2.5) / 0.5)), rel=1e-12)  # 7.31
    assert centred_tau(1, 10.0, 0) == pytest.approx(10.0)  # T = 0: the guard's tiny width, a step at t = 0


def test_two_hop_fills_every_row_after_a_client_that_met_nobody():
    nan = np.nan
    similarity = np.array([
        [nan, nan, nan],  # 0 met nobody
        [nan, nan, 0.4],  # 1 met 2
        [0.6, 0.4, nan],  # 2 met 0 and 1
    ])
    filled = two_hop_similarities(similarity, ~np.isnan(similarity))
    assert filled[1, 0] == 0.6  # from 2, the only neighbour of 1 that met 0
    assert np.isnan(filled[0]).all()


def test_two_hop_lends_from_the_first_of_equally_similar_neighbours():
    """Ties among i's neighbours go to the lowest index (a stable order), also past the 16 items
    below which numpy's default sort happens to be stable: 0 met 1..38, the even ones equally
    and most similar; of those only 6 and 8 met 39."""
    count = 40
    similarity = np.full((count, count), np.nan)
    for j in range(1, count - 1):
        similarity[0, j] = similarity[j, 0] = 0.5 if j % 2 == 0 else 0.2
    similarity[6, count - 1], similarity[8, count - 1] = 0.11, 0.22
    filled = two_hop_similarities(similarity, ~np.isnan(similarity))
    assert filled[0, count - 1] == 0.11  # lent by 6, not 8 (nor nobody: 1, the first met, never met 39)


# ---- one-shot relevance --------------------------------------------------------------------------


def test_relevance_of_no_clients_is_an_empty_row():
    assert relevance_row(np.eye(3), []).shape == (0,)


def test_relevance_arrays_must_pair_with_eigenvectors():
    with pytest.raises(ValueError, match="1 eigenvalue arrays for 2 clients' eigenvectors"):
        relevance_row(np.eye(2), [np.eye(2), np.eye(2)], [np.ones(2)])


def test_the_eigen_floor_is_relative_to_the_larger_of_both_sides():
    """ε = floor · max(largest λ compared, largest λ̂): eq. 3's ratios by hand, G = diag(4, 1),
    client j's directions e1, e2 (λ̂ = 4, 1), floor 0.1."""
    gram, vectors = np.diag([4.0, 1.0]), np.eye(2)
    # j's own values 8, 1 dominate: ε = 0.8; ratios (4 + .8)/(8 + .8) and 1
    assert relevance_row(gram, [vectors], [np.array([8.0, 1.0])], floor=0.1)[0] == pytest.approx(math.sqrt(4.8 / 8.8))
    # the projections 4, 1 dominate j's values 2, 1: ε = 0.4; ratios (2 + .4)/(4 + .4) and 1
    assert relevance_row(gram, [vectors], [np.array([2.0, 1.0])], floor=0.1)[0] == pytest.approx(math.sqrt(2.4 / 4.4))


@pytest.mark.parametrize("scale", [1e-4, 1e3])
def test_relevance_does_not_depend_on_the_datas_scale(scale):
    rng = np.random.default_rng(5)
    data_i, data_j = rng.normal(size=(30, 4)), rng.normal(size=(30, 4)) * [3, 1, 1, 0.1]
    gram_i, gram_j = data_i.T @ data_i, data_j.T @ data_j
    values_j, vectors_j = np.linalg.eigh(gram_j)
    vectors_j, values_j = vectors_j[:, ::-1][:, :3].T, values_j[::-1][:3]
    for shared in (None, [values_j]):
        plain = relevance_row(gram_i, [vectors_j], shared)
        scaled = relevance_row(gram_i * scale, [vectors_j], None if shared is None else [values_j * scale])
        assert scaled == pytest.approx(plain, rel=1e-9)


def test_a_negative_own_eigenvalue_is_no_variance():
    """Round-off may make a Gram matrix's eigenvalue negative; it counts as 0: with ε = 0.1 · 2,
    the second ratio is (0 + 0.2)/(0.1 + 0.2), not (−0.1 + 0.2)/(0.1 + 0.2)."""
    row = relevance_row(np.diag([2.0, -0.1]), [np.eye(2)], floor=0.1)
    assert row[0] == pytest.approx(math.sqrt(0.2 / 0.3))


def test_relevance_is_computed_in_float64_whatever_the_inputs_dtype():
    rng = np.random.default_rng(2)
    data = rng.normal(size=(20, 3))
    gram = data.T @ data
    vectors = np.linalg.qr(rng.normal(size=(3, 3)))[0].T * (1 + 1e-3 * rng.normal(size=(3, 1)))
    values = np.array([5.1234567, 2.7654321, 0.3141593])
    want = relevance_row(gram, [vectors], [values])
    got = relevance_row(gram, [vectors.astype(np.float32)], [values.astype(np.float32)])
    want_from_float32 = relevance_row(gram, [vectors.astype(np.float32).astype(np.float64)],
                                      [values.astype(np.float32).astype(np.float64)])
    assert want != pytest.approx(want_from_float32, rel=1e-12, abs=0)  # float32 rounding shows at this tolerance
    assert got == pytest.approx(want_from_float32, rel=1e-12, abs=0)


def test_a_zero_ratio_at_floor_0_gives_relevance_0_silently():
    with np.errstate(all="raise"):  # log(0) = −inf is the rule here (r = 0), not an error
        assert relevance_row(np.diag([1.0, 0.0]), [np.eye(2)], [np.array([1.0, 1.0])], floor=0.0)[0] == 0.0


def test_clustering_by_relevance_cuts_at_the_threshold_or_the_number_given():
    relevance = np.array([
        [1.0, 0.9, 0.3, 0.2],
        [0.9, 1.0, 0.25, 0.3],
        [0.3, 0.25, 1.0, 0.6],
        [0.2, 0.3, 0.6, 1.0],
    ])  # distances 1 − R: 0.1 within {0, 1}, 0.4 within {2, 3}, >= 0.7 across
    assert cluster_by_relevance(relevance, "complete", threshold=0.2).labels.tolist() == [0, 0, 1, 2]
    assert cluster_by_relevance(relevance, "complete", threshold=0.5).labels.tolist() == [0, 0, 1, 1]
    assert cluster_by_relevance(relevance, "complete", num_clusters=3).labels.tolist() == [0, 0, 1, 2]
    assert cluster_by_relevance(relevance, "complete", num_clusters=1).labels.tolist() == [0, 0, 0, 0]


def test_relevance_above_1_from_round_off_is_distance_0():
    relevance = np.array([[1.0, 1.0 + 1e-12, 0.1], [1.0 + 1e-12, 1.0, 0.1], [0.1, 0.1, 1.0]])
    result = cluster_by_relevance(relevance, "single", num_clusters=2)
    assert result.labels.tolist() == [0, 0, 1] and result.linkage[0, 2] == 0.0


# ---- PACFL -------------------------------------------------------------------------------------


def test_closest_cluster_errors_name_the_cause():
    with pytest.raises(ValueError, match=r"unknown linkage 'ward'; expected one of \('single', 'complete', 'average'\)"):
        closest_cluster(np.ones(2), np.zeros(2), "ward")
    with pytest.raises(ValueError, match="^no clustered clients to place a newcomer among$"):
        closest_cluster(np.zeros(0), np.zeros(0), "single")


def test_the_elementwise_angle_of_a_unit_vector_with_itself_is_0_and_with_its_opposite_180():
    """Round-off puts some dot products of unit vectors past ±1 (arccos would give NaN): clipped."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = rng.normal(size=(5, 1))
        v /= np.linalg.norm(v)
        assert subspace_proximity(v, v, "elementwise_min_angle") == pytest.approx(0.0, abs=1e-5)
        assert subspace_proximity(v, -v, "elementwise_min_angle") == pytest.approx(180.0, abs=1e-5)


def test_principal_angles_are_computed_in_float64_whatever_the_bases_dtype():
    rng = np.random.default_rng(4)
    a, b = (np.linalg.qr(rng.normal(size=(6, 2)))[0].astype(np.float32) for _ in range(2))
    want = principal_angles(a.astype(np.float64), b.astype(np.float64))
    assert principal_angles(a, b) == pytest.approx(want, rel=1e-10, abs=1e-10)
    assert principal_angles(a.astype(np.float64), b) == pytest.approx(want, rel=1e-10, abs=1e-10)


def test_an_unknown_proximity_is_named():
    with pytest.raises(ValueError, match=r"unknown proximity 'cosine'; expected one of \('smallest_angle'"):
        subspace_proximity(np.eye(2), np.eye(2), "cosine")


def test_lowest_keeps_ties_in_position_order_past_16_values():
    values = [0.5 if i % 2 else 0.2 for i in range(40)]
    assert lowest(values, 5) == [0, 2, 4, 6, 8]
    assert lowest([3.0, 1.0, 2.0], 2) == [1, 2]


# ---- CFL ---------------------------------------------------------------------------------------


def test_the_bipartition_is_single_linkage_unless_told():
    """A chain 0..5 (s = 1 − 0.1·|i − j|) and item 6, 0.55 similar to all but 5 (0.6): single
    linkage cuts the maximum spanning tree's weakest edge (6's, at 0.6), Sattler et al.'s optimum;
    complete linkage cuts the chain (its largest cross similarity is 0.9)."""
    similarity = np.array([[max(0.0, 1 - 0.1 * abs(i - j)) for j in range(7)] for i in range(7)])
    similarity[6, :] = similarity[:, 6] = 0.55
    similarity[5, 6] = similarity[6, 5] = 0.6
    similarity[6, 6] = 1.0
    labels, cross = bipartition(similarity)
    assert labels.tolist() == [0, 0, 0, 0, 0, 0, 1] and cross == pytest.approx(0.6)
    labels, cross = bipartition(similarity, "complete")
    assert labels.tolist() != [0, 0, 0, 0, 0, 0, 1] and cross == pytest.approx(0.9)


def test_a_bipartition_of_two_items_separates_them():
    labels, cross = bipartition(np.array([[1.0, 0.3], [0.3, 1.0]]))
    assert labels.tolist() == [0, 1] and cross == 0.3


@pytest.mark.parametrize("similarity", [np.ones((3, 2)), np.ones(3), np.ones((1, 1))], ids=["not_square", "1d", "one_item"])
def test_a_bipartition_needs_a_square_matrix_of_two_items(similarity):
    with pytest.raises(ValueError, match="a bi-partition needs a square similarity matrix of at least 2 items"):
        bipartition(similarity)


def test_an_unknown_bipartition_linkage_is_named():
    with pytest.raises(ValueError, match=r"unknown linkage 'ward'; expected one of \('single', 'complete'\)"):
        bipartition(np.eye(2), "ward")


def test_a_zero_update_has_cosine_similarity_0_with_everything_itself_included():
    updates = np.array([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 0.0]], dtype=np.float32)
    with np.errstate(all="raise"):
        similarity = cosine_similarity(updates)
    np.testing.assert_allclose(similarity, [[1, 0, -1 / 3], [0, 0, 0], [-1 / 3, 0, 1]], atol=1e-12)


def test_cosine_similarities_stay_within_minus_1_and_1_despite_round_off():
    rows = np.random.default_rng(1).normal(size=(100, 7))
    similarity = cosine_similarity(np.concatenate([rows, -rows]))
    assert similarity.max() <= 1.0 and similarity.min() >= -1.0
    np.testing.assert_allclose(np.diagonal(similarity), 1.0, atol=1e-12)


# ---- one-shot: within and across ---------------------------------------------------------------


def test_within_and_across_average_the_off_diagonal_entries_by_group():
    matrix = np.array([[9.0, 1.0, 4.0], [3.0, 9.0, 6.0], [8.0, 2.0, 9.0]])
    assert within_and_across(matrix, np.array([0, 0, 1])) == (2.0, 5.0)  # (1 + 3)/2; (4 + 6 + 8 + 2)/4


def test_within_and_across_of_singletons_or_one_group_is_nan_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        within, across = within_and_across(np.ones((3, 3)), np.array([0, 1, 2]))
        assert math.isnan(within) and across == 1.0
        within, across = within_and_across(np.ones((3, 3)), np.array([0, 0, 0]))
        assert within == 1.0 and math.isnan(across)
