"""Partitioners: sizes, disjointness, stratified splits, label sets, true cluster ids,
transforms, determinism and configuration errors.

All tests use small synthetic label arrays (or scikit-learn's digits labels) and fixed
seeds, so they are fast and deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedcluster_flwr.data import PARTITIONERS, ClientTransform, load_pool, make_partition
from fedcluster_flwr.data.flwr_partitions import FlwrDatasetsOptions
from fedcluster_flwr.data.partition_options import (
    ClassSubsetsOptions,
    DirichletOptions,
    IidOptions,
    LabelGroupsOptions,
    LabelSwapOptions,
    NaturalOptions,
    PathologicalOptions,
    RotationOptions,
)
from fedcluster_flwr.declarations.options import from_mapping
from fedcluster_flwr.declarations.schema import ConfigError

NUM_CLASSES = 10
TEST_FRACTION = 0.2


def balanced_labels(per_class: int = 100, seed: int = 1234) -> np.ndarray:
    """``per_class`` samples of each of 10 labels, shuffled with a seeded RNG."""
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(NUM_CLASSES), per_class)).astype(np.int64)


LABELS = balanced_labels()  # 1000 samples, 100 per label
WRITERS = np.random.default_rng(7).permutation(np.repeat(np.arange(40), 25)).astype(np.int64)  # 40 writers x 25


def partition(
    name: str,
    options,
    *,
    labels: np.ndarray = LABELS,
    num_classes: int = NUM_CLASSES,
    num_clients: int = 8,
    samples_per_client: int | None = None,
    test_fraction: float = TEST_FRACTION,
    seed: int = 0,
    writers: np.ndarray | None = None,
):
    return make_partition(
        name,
        options,
        labels=labels,
        num_classes=num_classes,
        num_clients=num_clients,
        samples_per_client=samples_per_client,
        test_fraction=test_fraction,
        seed=seed,
        writers=writers,
    )


def client_indices(p, client: int) -> np.ndarray:
    return np.concatenate([p.train_indices[client], p.test_indices[client]])


def client_labels(p, client: int, labels: np.ndarray = LABELS) -> set[int]:
    return set(labels[client_indices(p, client)].tolist())


# One representative configuration per partitioner (samples_per_client given where the
# partitioner needs a cap to be feasible with 100 samples per label).
CASES = {
    "iid": dict(options=IidOptions(), samples_per_client=None),
    "pathological": dict(options=PathologicalOptions(labels_per_client=2), samples_per_client=None),
    "label_swap": dict(options=LabelSwapOptions(num_groups=4), samples_per_client=None),
    "rotation": dict(options=RotationOptions(), samples_per_client=None),
    "label_groups": dict(options=LabelGroupsOptions(), samples_per_client=80),
    "class_subsets": dict(options=ClassSubsetsOptions(), samples_per_client=80),
    "dirichlet": dict(options=DirichletOptions(alpha=0.5), samples_per_client=None),
    "natural": dict(options=NaturalOptions(), samples_per_client=None, writers=WRITERS),
    # needs the extra fedcluster-flwr[hf]; its own tests: tests/test_hf.py
    "flwr_datasets": dict(options=FlwrDatasetsOptions("DirichletPartitioner", {"alpha": 0.5}), samples_per_client=None),
}


def run_case(name: str, **overrides):
    if name == "flwr_datasets":
        pytest.importorskip("flwr_datasets", reason="partition.name flwr_datasets needs the extra fedcluster-flwr[hf]")
    case = dict(CASES[name])
    case.update(overrides)
    options = case.pop("options")
    return partition(name, options, **case)


def test_cases_cover_every_partitioner():
    assert set(CASES) == set(PARTITIONERS)


# ---- properties every partitioner must have ---------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_number_of_clients(name):
    p = run_case(name, num_clients=8)
    assert p.num_clients == 8
    assert len(p.train_indices) == len(p.test_indices) == len(p.transforms) == 8
    assert p.true_clusters.shape == (8,)
    assert all(len(train) > 0 for train in p.train_indices)


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_sample_shared_between_clients_or_splits(name):
    p = run_case(name)
    for train, test in zip(p.train_indices, p.test_indices):
        assert len(np.intersect1d(train, test)) == 0, "a client's train and test overlap"
        assert len(np.unique(train)) == len(train) and len(np.unique(test)) == len(test)
    everything = np.concatenate([client_indices(p, c) for c in range(p.num_clients)])
    assert len(np.unique(everything)) == len(everything), "two clients share a sample"
    assert everything.min() >= 0 and everything.max() < len(LABELS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_test_fraction_respected_approximately(name):
    p = run_case(name)
    train = np.array([len(t) for t in p.train_indices])
    test = np.array([len(t) for t in p.test_indices])
    assert np.all(test >= 1), "every client needs a local test split"
    assert abs(test.sum() / (train + test).sum() - TEST_FRACTION) <= 0.035
    assert np.all(np.abs(test / (train + test) - TEST_FRACTION) <= 0.06)


@pytest.mark.parametrize("name", sorted(CASES))
def test_train_and_test_are_stratified(name):
    """Test labels are a subset of train labels; every well-represented label is in both,
    and each label's test count is its share of the client's samples up to rounding."""
    p = run_case(name)
    for c in range(p.num_clients):
        train_counts = np.bincount(LABELS[p.train_indices[c]], minlength=NUM_CLASSES)
        test_counts = np.bincount(LABELS[p.test_indices[c]], minlength=NUM_CLASSES)
        total = train_counts + test_counts
        assert set(np.flatnonzero(test_counts)) <= set(np.flatnonzero(train_counts))
        well_represented = total * TEST_FRACTION >= 1
        assert np.all(test_counts[well_represented] > 0)
        assert np.all(train_counts[total > 0] > 0)
        assert np.all(np.abs(test_counts - total * TEST_FRACTION) <= 1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_seed_same_partition_different_seed_different(name):
    a = run_case(name, seed=3)
    b = run_case(name, seed=3)
    c = run_case(name, seed=4)
    for x, y in zip(a.train_indices + a.test_indices, b.train_indices + b.test_indices):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.true_clusters, b.true_clusters)
    assert a.transforms == b.transforms
    assert any(
        not np.array_equal(x, y) for x, y in zip(a.train_indices + a.test_indices, c.train_indices + c.test_indices)
    )


@pytest.mark.parametrize("name", ["iid", "label_swap", "rotation", "label_groups", "class_subsets"])
def test_samples_per_client_is_exact(name):
    p = run_case(name, samples_per_client=60)
    sizes = [len(client_indices(p, c)) for c in range(p.num_clients)]
    assert sizes == [60] * p.num_clients


@pytest.mark.parametrize("name", ["iid", "label_swap", "rotation", "pathological"])
def test_default_size_is_an_equal_share_of_the_pool(name):
    p = run_case(name, num_clients=10, samples_per_client=None)
    assert [len(client_indices(p, c)) for c in range(10)] == [100] * 10


@pytest.mark.parametrize("name", ["dirichlet", "natural"])
def test_samples_per_client_is_a_cap(name):
    p = run_case(name, samples_per_client=12)
    sizes = [len(client_indices(p, c)) for c in range(p.num_clients)]
    assert max(sizes) <= 12
    assert sizes == [12] * p.num_clients  # every client has more than 12 samples here


# ---- iid ---------------------------------------------------------------------------------


def test_iid_clients_all_in_cluster_zero_without_transform():
    p = partition("iid", IidOptions(), num_clients=10)
    assert p.true_clusters.tolist() == [0] * 10
    assert all(t == ClientTransform() for t in p.transforms)
    # 100 samples drawn at random: every client sees (almost) every label
    assert all(len(client_labels(p, c)) >= 8 for c in range(10))


# ---- pathological ------------------------------------------------------------------------


@pytest.mark.parametrize("labels_per_client", [1, 2, 4, 5])  # shards that do not straddle labels
def test_pathological_at_most_labels_per_client_labels(labels_per_client):
    p = partition(
        "pathological", PathologicalOptions(labels_per_client=labels_per_client), num_clients=10
    )
    sets = [client_labels(p, c) for c in range(10)]
    assert all(1 <= len(s) <= labels_per_client for s in sets)
    # the shards of all clients cover the whole pool here (10 x 100 samples)
    assert set().union(*sets) == set(range(NUM_CLASSES))


def test_pathological_true_cluster_is_the_label_set():
    p = partition("pathological", PathologicalOptions(labels_per_client=2), num_clients=20)
    sets = [frozenset(client_labels(p, c)) for c in range(20)]
    ids = p.true_clusters.tolist()
    for a in range(20):
        for b in range(20):
            assert (ids[a] == ids[b]) == (sets[a] == sets[b])
    assert sorted(set(ids)) == list(range(len(set(sets))))  # ids are 0..k-1


def test_pathological_with_samples_cap_still_uses_every_label():
    digits = load_pool("digits")
    p = partition(
        "pathological",
        PathologicalOptions(labels_per_client=2),
        labels=digits.labels,
        num_clients=10,
        samples_per_client=50,
    )
    used = set().union(*(client_labels(p, c, digits.labels) for c in range(10)))
    # 10 clients x 2 shards of 25 samples: 20 shards shared out by label frequency reach every label
    assert used == set(range(10)), f"only labels {sorted(used)} were handed out"


def test_pathological_respects_labels_per_client_on_digits():
    digits = load_pool("digits")
    p = partition(
        "pathological",
        PathologicalOptions(labels_per_client=2),
        labels=digits.labels,
        num_clients=20,
    )
    counts = [len(client_labels(p, c, digits.labels)) for c in range(20)]
    assert max(counts) <= 2, f"labels per client: {counts}"


# ---- label_swap --------------------------------------------------------------------------


def test_label_swap_groups_equal_contiguous_and_default_pairs():
    p = partition("label_swap", LabelSwapOptions(num_groups=4), num_clients=20)
    assert p.true_clusters.tolist() == [g for g in range(4) for _ in range(5)]
    for client, group in enumerate(p.true_clusters.tolist()):
        label_map = p.transforms[client].label_map
        assert p.transforms[client].rotation == 0
        a, b = 2 * group, 2 * group + 1
        expected = list(range(NUM_CLASSES))
        expected[a], expected[b] = b, a
        assert list(label_map) == expected
    # clients of one group share one transform, different groups differ
    assert len({p.transforms[c] for c in range(20)}) == 4


def test_label_swap_configured_pairs():
    p = partition("label_swap", LabelSwapOptions(num_groups=2, swaps=((0, 9), (3, 4))), num_clients=6)
    assert p.true_clusters.tolist() == [0, 0, 0, 1, 1, 1]
    first, second = p.transforms[0].label_map, p.transforms[5].label_map
    assert (first[0], first[9]) == (9, 0)
    assert all(first[i] == i for i in range(1, 9))
    assert (second[3], second[4]) == (4, 3)
    assert all(second[i] == i for i in range(NUM_CLASSES) if i not in (3, 4))


def test_label_swap_uneven_groups_differ_by_at_most_one():
    p = partition("label_swap", LabelSwapOptions(num_groups=3), num_clients=10)
    ids = p.true_clusters.tolist()
    assert ids == sorted(ids)
    sizes = np.bincount(ids)
    assert sizes.sum() == 10 and sizes.max() - sizes.min() <= 1 and len(sizes) == 3


def test_label_swap_too_many_groups_for_default_swaps():
    with pytest.raises(ConfigError) as err:
        partition("label_swap", LabelSwapOptions(num_groups=6), num_clients=12)
    assert err.value.key == "partition.num_groups"
    # explicit swaps lift the limit
    p = partition(
        "label_swap",
        LabelSwapOptions(num_groups=6, swaps=((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (0, 9))),
        num_clients=12,
    )
    assert sorted(set(p.true_clusters.tolist())) == list(range(6))


def test_label_swap_label_outside_classes():
    with pytest.raises(ConfigError) as err:
        partition("label_swap", LabelSwapOptions(num_groups=1, swaps=((3, 10),)), num_clients=4)
    assert err.value.key == "partition.swaps"
    assert "10" in str(err.value)


# ---- rotation ----------------------------------------------------------------------------


def test_rotation_follows_cluster_sizes_and_angles():
    p = partition("rotation", RotationOptions(angles=(0.0, 90.0, 180.0, 270.0), cluster_sizes=(2, 3, 1, 4)), num_clients=10)
    assert p.true_clusters.tolist() == [0, 0, 1, 1, 1, 2, 3, 3, 3, 3]
    assert [t.rotation for t in p.transforms] == [0.0, 0.0, 90.0, 90.0, 90.0, 180.0, 270.0, 270.0, 270.0, 270.0]
    assert all(t.label_map is None for t in p.transforms)


def test_rotation_default_sizes_equal():
    p = partition("rotation", RotationOptions(angles=(0.0, 45.0)), num_clients=8)
    assert p.true_clusters.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [t.rotation for t in p.transforms] == [0.0] * 4 + [45.0] * 4


@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (3, 3, 3, 3)])
def test_cluster_sizes_must_sum_to_num_clients(sizes):
    with pytest.raises(ConfigError) as err:
        partition("rotation", RotationOptions(cluster_sizes=sizes), num_clients=10)
    assert err.value.key == "partition.cluster_sizes"
    assert "partition.cluster_sizes" in str(err.value)


# ---- label_groups ------------------------------------------------------------------------


def test_label_groups_majority_and_minority():
    opts = LabelGroupsOptions(groups=((0, 1, 8, 9), (2, 3, 4, 5, 6, 7)), cluster_sizes=(3, 5), minority_fraction=0.1)
    p = partition("label_groups", opts, num_clients=8, samples_per_client=100)
    assert p.true_clusters.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    for c, k in enumerate(p.true_clusters.tolist()):
        labels = LABELS[client_indices(p, c)]
        in_group = np.isin(labels, opts.groups[k])
        assert len(labels) == 100
        assert in_group.sum() == 90  # the majority comes from the client's group
        assert (~in_group).sum() == 10  # minority_fraction of the samples
        # the minority is spread over the other labels, not piled on one
        others = np.bincount(labels[~in_group], minlength=NUM_CLASSES)[np.setdiff1d(np.arange(NUM_CLASSES), opts.groups[k])]
        assert others.min() >= 1 and others.max() - others.min() <= 1


def test_label_groups_without_minority_only_hold_group_labels():
    opts = LabelGroupsOptions(groups=((0, 1, 2), (3, 4, 5, 6, 7, 8, 9)), minority_fraction=0.0)
    p = partition("label_groups", opts, num_clients=6, samples_per_client=60)
    for c, k in enumerate(p.true_clusters.tolist()):
        assert client_labels(p, c) == set(opts.groups[k])


def test_label_groups_on_digits():
    digits = load_pool("digits")
    opts = LabelGroupsOptions(minority_fraction=0.2)
    p = partition("label_groups", opts, labels=digits.labels, num_clients=10, samples_per_client=50)
    for c, k in enumerate(p.true_clusters.tolist()):
        labels = digits.labels[client_indices(p, c)]
        assert np.isin(labels, opts.groups[k]).sum() == 40


def test_test_fraction_respected_with_many_classes():
    labels = np.random.default_rng(5).permutation(np.repeat(np.arange(62), 20))
    p = partition("iid", IidOptions(), labels=labels, num_classes=62, num_clients=5, test_fraction=0.1)
    fractions = [len(te) / (len(tr) + len(te)) for tr, te in zip(p.train_indices, p.test_indices)]
    assert all(abs(f - 0.1) <= 0.03 for f in fractions), f"test fractions: {np.round(fractions, 3)}"


def test_label_groups_label_outside_classes():
    with pytest.raises(ConfigError) as err:
        partition("label_groups", LabelGroupsOptions(groups=((0, 1), (2, 12))), num_clients=4, samples_per_client=20)
    assert err.value.key == "partition.groups[1]"


# ---- class_subsets -----------------------------------------------------------------------


def test_class_subsets_clients_hold_only_their_subset():
    opts = ClassSubsetsOptions()
    p = partition("class_subsets", opts, num_clients=8, samples_per_client=80)
    assert p.true_clusters.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for c, k in enumerate(p.true_clusters.tolist()):
        counts = np.bincount(LABELS[client_indices(p, c)], minlength=NUM_CLASSES)
        assert set(np.flatnonzero(counts)) == set(opts.subsets[k])
        assert counts[list(opts.subsets[k])].tolist() == [10] * 8  # uniform over the subset


def test_class_subsets_follow_cluster_sizes():
    opts = ClassSubsetsOptions(subsets=((0, 1, 2), (3, 4), (5, 6, 7, 8, 9)), cluster_sizes=(1, 2, 3))
    p = partition("class_subsets", opts, num_clients=6, samples_per_client=30)
    assert p.true_clusters.tolist() == [0, 1, 1, 2, 2, 2]
    for c, k in enumerate(p.true_clusters.tolist()):
        assert client_labels(p, c) <= set(opts.subsets[k])


def test_class_subsets_not_enough_samples_of_a_label():
    with pytest.raises(ConfigError) as err:
        partition("class_subsets", ClassSubsetsOptions(subsets=((0, 1),)), num_clients=10, samples_per_client=50)
    assert err.value.key == "partition.samples_per_client"


def test_class_subsets_split_each_clusters_total_equally_over_its_clients():
    """Lin et al.'s setting: cluster totals (17,500 and 14,500 on MNIST), each split equally and
    at random over the cluster's clients; classes spread evenly within a cluster."""
    opts = ClassSubsetsOptions(subsets=((0, 1, 2, 3), (4, 5, 6, 7)), cluster_sizes=(3, 5), cluster_samples=(300, 250))
    p = partition("class_subsets", opts, num_clients=8)
    sizes = [len(client_indices(p, c)) for c in range(8)]
    assert sizes == [100] * 3 + [50] * 5
    for k, members in ((0, range(3)), (1, range(3, 8))):
        pooled = np.concatenate([client_indices(p, c) for c in members])
        labels, counts = np.unique(LABELS[pooled], return_counts=True)
        assert set(labels.tolist()) == set(opts.subsets[k]) and counts.max() - counts.min() <= 1
    assert len(np.unique(np.concatenate([client_indices(p, c) for c in range(8)]))) == 550  # disjoint


def test_class_subsets_cluster_totals_errors_name_the_key():
    opts = ClassSubsetsOptions(subsets=((0, 1), (2, 3)), cluster_samples=(150, 150))
    with pytest.raises(ConfigError, match="partition.cluster_samples: give either"):
        partition("class_subsets", opts, num_clients=4, samples_per_client=20)
    with pytest.raises(ConfigError, match="partition.cluster_samples: not enough samples of label 0"):
        partition("class_subsets", ClassSubsetsOptions(subsets=((0, 1), (0, 2)), cluster_samples=(150, 150)), num_clients=4)
    with pytest.raises(ConfigError, match=r"partition.cluster_samples: needs one total per entry of subsets \(2\)"):
        from_mapping(ClassSubsetsOptions, {"subsets": [[0], [1]], "cluster_samples": [5]}, "partition")


def test_class_subsets_default_size_is_the_largest_every_client_can_get():
    """With 24 clients on digits-like labels (~180 per class), an equal share of the pool (74)
    asks more of a class held by 3 of the 4 default subsets than it has; the default is the
    largest size that fits: 8 classes x min over classes of available // holders."""
    labels = balanced_labels(per_class=179)
    p = partition("class_subsets", ClassSubsetsOptions(), labels=labels, num_clients=24)
    sizes = {len(client_indices(p, c)) for c in range(24)}
    assert sizes == {8 * (179 // 24)}  # classes 6 and 7 are in every subset: all 24 clients hold them
    with pytest.raises(ConfigError, match="not enough samples of label"):
        partition("class_subsets", ClassSubsetsOptions(), labels=labels, num_clients=24, samples_per_client=8 * (179 // 24) + 8)


def test_class_subsets_label_outside_classes():
    with pytest.raises(ConfigError) as err:
        partition("class_subsets", ClassSubsetsOptions(subsets=((0, 1), (5, -1))), num_clients=4, samples_per_client=20)
    assert err.value.key == "partition.subsets[1]"


# ---- dirichlet ---------------------------------------------------------------------------


def test_dirichlet_covers_pool_and_min_samples():
    p = partition("dirichlet", DirichletOptions(alpha=0.5, min_samples=20), num_clients=8)
    assert p.true_clusters.tolist() == [0] * 8
    assert all(t == ClientTransform() for t in p.transforms)
    sizes = [len(client_indices(p, c)) for c in range(8)]
    assert min(sizes) >= 20
    assert sum(sizes) == len(LABELS)  # without a cap every sample goes to some client


def _mean_label_entropy(p) -> float:
    entropies = []
    for c in range(p.num_clients):
        freq = np.bincount(LABELS[client_indices(p, c)], minlength=NUM_CLASSES) / len(client_indices(p, c))
        freq = freq[freq > 0]
        entropies.append(float(-(freq * np.log(freq)).sum()))
    return float(np.mean(entropies))


def test_dirichlet_alpha_controls_skew():
    skewed = partition("dirichlet", DirichletOptions(alpha=0.1, min_samples=5), num_clients=8)
    uniform = partition("dirichlet", DirichletOptions(alpha=100.0), num_clients=8)
    assert _mean_label_entropy(uniform) > np.log(NUM_CLASSES) - 0.1  # close to uniform
    assert _mean_label_entropy(skewed) < _mean_label_entropy(uniform) - 0.5


def test_dirichlet_impossible_min_samples():
    with pytest.raises(ConfigError) as err:
        partition("dirichlet", DirichletOptions(alpha=0.01, min_samples=90), num_clients=10)
    assert err.value.key == "partition.alpha"


# ---- natural -----------------------------------------------------------------------------


def test_natural_one_distinct_writer_per_client():
    p = partition("natural", NaturalOptions(), num_clients=10, writers=WRITERS)
    chosen = []
    for c in range(10):
        idx = client_indices(p, c)
        writers = set(WRITERS[idx].tolist())
        assert len(writers) == 1
        (writer,) = writers
        chosen.append(writer)
        assert len(idx) == int((WRITERS == writer).sum())  # all of the writer's samples
    assert len(set(chosen)) == 10
    assert p.true_clusters.tolist() == [0] * 10


def test_natural_needs_writers():
    with pytest.raises(ConfigError) as err:
        partition("natural", NaturalOptions(), num_clients=4)
    assert err.value.key == "partition.name"


def test_natural_more_clients_than_writers():
    with pytest.raises(ConfigError) as err:
        partition("natural", NaturalOptions(), num_clients=41, writers=WRITERS)
    assert err.value.key == "partition.num_clients"


# ---- size errors -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["iid", "pathological", "label_swap", "rotation", "label_groups", "class_subsets"])
def test_too_many_samples_per_client(name):
    with pytest.raises(ConfigError) as err:
        run_case(name, num_clients=10, samples_per_client=101)
    assert err.value.key == "partition.samples_per_client"
    assert "1000" in str(err.value)


def test_too_many_clients_for_the_pool():
    with pytest.raises(ConfigError) as err:
        partition("iid", IidOptions(), num_clients=600)
    assert err.value.key == "partition.num_clients"


# ---- option validation through the config schema ---------------------------------------


@pytest.mark.parametrize(
    ("cls", "data", "key"),
    [
        (PathologicalOptions, {"labels_per_client": 0}, "partition.labels_per_client"),
        (LabelSwapOptions, {"num_groups": 0}, "partition.num_groups"),
        (LabelSwapOptions, {"num_groups": 2, "swaps": [[0, 1]]}, "partition.swaps"),
        (LabelSwapOptions, {"num_groups": 2, "swaps": [[0, 1], [3, 3]]}, "partition.swaps[1]"),
        (LabelSwapOptions, {"num_groups": 1, "swaps": [[0, 1, 2]]}, "partition.swaps[0]"),
        (RotationOptions, {"angles": []}, "partition.angles"),
        (RotationOptions, {"angles": [0, 90], "cluster_sizes": [5]}, "partition.cluster_sizes"),
        (RotationOptions, {"angles": [0, 90], "cluster_sizes": [5, 0]}, "partition.cluster_sizes"),
        (LabelGroupsOptions, {"minority_fraction": 1.0}, "partition.minority_fraction"),
        (LabelGroupsOptions, {"minority_fraction": -0.1}, "partition.minority_fraction"),
        (LabelGroupsOptions, {"groups": [[0, 1, 2]]}, "partition.groups"),
        (LabelGroupsOptions, {"groups": [[0, 1], []]}, "partition.groups[1]"),
        (LabelGroupsOptions, {"cluster_sizes": [1, 2, 3]}, "partition.cluster_sizes"),
        (ClassSubsetsOptions, {"subsets": []}, "partition.subsets"),
        (ClassSubsetsOptions, {"subsets": [[0], []]}, "partition.subsets[1]"),
        (DirichletOptions, {"alpha": 0}, "partition.alpha"),
        (DirichletOptions, {"alpha": -1.0}, "partition.alpha"),
        (DirichletOptions, {"min_samples": 1}, "partition.min_samples"),
        (DirichletOptions, {"alpha": "big"}, "partition.alpha"),
        (NaturalOptions, {"writers": 3}, "partition.writers"),
    ],
)
def test_options_validation(cls, data, key):
    with pytest.raises(ConfigError) as err:
        from_mapping(cls, data, "partition")
    assert err.value.key == key
    assert str(err.value).startswith(key)


def test_options_from_mapping_valid_values_become_tuples():
    swap = from_mapping(LabelSwapOptions, {"num_groups": 2, "swaps": [[0, 9], [3, 4]]}, "partition")
    assert swap.swaps == ((0, 9), (3, 4))
    rot = from_mapping(RotationOptions, {"angles": [0, 120, 240], "cluster_sizes": [2, 2, 1]}, "partition")
    assert rot.angles == (0.0, 120.0, 240.0) and rot.cluster_sizes == (2, 2, 1)
    p = partition("rotation", rot, num_clients=5)
    assert [t.rotation for t in p.transforms] == [0.0, 0.0, 120.0, 120.0, 240.0]
