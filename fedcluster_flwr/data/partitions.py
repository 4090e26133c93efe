"""Non-IID partitioners that also return each client's true cluster id.

A partitioner assigns every client a set of sample indices of the dataset pool, a
true cluster id, and a transform that defines its distribution (a label
permutation for label swapping, an image rotation for rotated clusters). The
client's indices are then split into a local train and test split that share the
same label proportions, so a client is always tested on its own distribution.

Partitions are pure functions of (labels, options, seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..schema import ConfigError, Interval, above, at_least, join_key, option, require


@dataclass(frozen=True)
class ClientTransform:
    """How a client's samples differ from the pool: relabelling and/or rotation."""

    label_map: tuple[int, ...] | None = None  # new label = label_map[old label]
    rotation: float = 0.0  # degrees, counter-clockwise
    # what the rotated-away corners hold (RotationOptions.rotation_fill); a multiple of 90 degrees
    # leaves no corner, so then both fills give the same bits
    rotation_fill: Literal["normalized_zero", "black"] = "normalized_zero"


@dataclass(frozen=True, eq=False)
class Partition:
    """Per-client local train/test indices, true cluster ids and transforms."""

    train_indices: tuple[np.ndarray, ...]
    test_indices: tuple[np.ndarray, ...]
    true_clusters: np.ndarray
    transforms: tuple[ClientTransform, ...]
    val_indices: tuple[np.ndarray, ...] = ()  # per client, where partition.val_fraction > 0

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)


# ---- options, one dataclass per partitioner (YAML keys under `partition:`) -------------


@dataclass(frozen=True)
class IidOptions:
    """Shuffle the pool and give every client an equal share."""


@dataclass(frozen=True)
class PathologicalOptions:
    """Sort by label, cut into shards, give each client `labels_per_client` shards."""

    labels_per_client: int = option(2, at_least(1))


@dataclass(frozen=True)
class LabelSwapOptions:
    """IID split into `num_groups` groups; group g swaps the label pair `swaps[g]`."""

    num_groups: int = option(4, at_least(1))
    swaps: tuple[tuple[int, ...], ...] | None = None

    def validate(self, prefix: str) -> None:
        if self.swaps is not None:
            require(
                len(self.swaps) == self.num_groups,
                join_key(prefix, "swaps"),
                f"needs one label pair per group ({self.num_groups}), got {len(self.swaps)}",
            )
            for g, pair in enumerate(self.swaps):
                require(
                    len(pair) == 2 and pair[0] != pair[1],
                    join_key(prefix, f"swaps[{g}]"),
                    f"expected two different labels, got {list(pair)}",
                )

    def cluster_name(self, k: int) -> str:
        a, b = self.swaps[k] if self.swaps is not None else (2 * k, 2 * k + 1)
        return f"swap {a}↔{b}"

    def group_count(self) -> tuple[str, int]:
        return "num_groups", self.num_groups


@dataclass(frozen=True)
class RotationOptions:
    """IID split; the clients of cluster k see images rotated by `angles[k]` degrees.

    ``rotation_fill`` is what the corners that a rotation by other than a multiple of 90 degrees
    turns away from the image hold:

    - ``normalized_zero`` (default, as published): the image is rotated *after* normalisation, so
      the corners are 0 in the model's input space. The DAC reference code (github.com/edvinli/DAC,
      main_fed.py) loads Fashion-MNIST/CIFAR-10 with ``Compose([ToTensor(), Normalize(0.5, 0.5)])``
      and its ``DatasetSplit`` then applies ``RandomRotation(degrees=(d, d))`` (default fill 0) to
      the normalised tensor (``ClientUpdate.__init__``; ``create_test_data`` puts the rotation after
      Normalize in the same Compose). Its zero is raw grey 0.5, because it normalises with 0.5/0.5;
      ours normalises with the dataset's mean/std, so here the corners are the dataset's mean
      intensity (0.286 for Fashion-MNIST) - the same "no information" input to the model.
    - ``black``: rotated *before* normalisation, corners raw 0 (this project's former behaviour).

    The reference also rotates with nearest-neighbour interpolation (RandomRotation's default);
    we use bilinear. Angles that are multiples of 90 degrees are exact permutations either way.
    """

    angles: tuple[float, ...] = (0.0, 90.0, 180.0, 270.0)
    cluster_sizes: tuple[int, ...] | None = None
    rotation_fill: Literal["normalized_zero", "black"] = "normalized_zero"

    def validate(self, prefix: str) -> None:
        require(len(self.angles) >= 1, join_key(prefix, "angles"), "needs at least one angle")
        _check_one_per_entry(self.cluster_sizes, "size", "angles", len(self.angles), join_key(prefix, "cluster_sizes"))

    def cluster_name(self, k: int) -> str:
        return f"{self.angles[k]:g}°"

    def group_count(self) -> tuple[str, int]:
        return "angles", len(self.angles)


@dataclass(frozen=True)
class LabelGroupsOptions:
    """Cluster k mostly holds labels of `groups[k]`, plus `minority_fraction` of others."""

    groups: tuple[tuple[int, ...], ...] = ((0, 1, 8, 9), (2, 3, 4, 5, 6, 7))
    cluster_sizes: tuple[int, ...] | None = None
    minority_fraction: float = option(0.1, Interval(0, 1, closed="left"))

    def validate(self, prefix: str) -> None:
        require(len(self.groups) >= 2, join_key(prefix, "groups"), "needs at least two label groups")
        for k, group in enumerate(self.groups):
            require(len(group) >= 1, join_key(prefix, f"groups[{k}]"), "is empty")
        _check_one_per_entry(self.cluster_sizes, "size", "groups", len(self.groups), join_key(prefix, "cluster_sizes"))

    def cluster_name(self, k: int) -> str:
        return "labels " + ",".join(map(str, self.groups[k]))

    def group_count(self) -> tuple[str, int]:
        return "groups", len(self.groups)


@dataclass(frozen=True)
class ClassSubsetsOptions:
    """Cluster k holds only the classes in `subsets[k]` (uniformly): either `samples_per_client`
    per client, or `cluster_samples[k]` in all, split equally and at random over its clients."""

    subsets: tuple[tuple[int, ...], ...] = (
        (0, 1, 2, 3, 4, 5, 6, 7),
        (2, 3, 4, 5, 6, 7, 8, 9),
        (0, 1, 2, 3, 6, 7, 8, 9),
        (0, 1, 4, 5, 6, 7, 8, 9),
    )
    cluster_sizes: tuple[int, ...] | None = None
    cluster_samples: tuple[int, ...] | None = None

    def validate(self, prefix: str) -> None:
        require(len(self.subsets) >= 1, join_key(prefix, "subsets"), "needs at least one class subset")
        for k, subset in enumerate(self.subsets):
            require(len(subset) >= 1, join_key(prefix, f"subsets[{k}]"), "is empty")
        for name, item in (("cluster_sizes", "size"), ("cluster_samples", "total")):
            _check_one_per_entry(getattr(self, name), item, "subsets", len(self.subsets), join_key(prefix, name))

    def cluster_name(self, k: int) -> str:
        return "classes " + ",".join(map(str, self.subsets[k]))

    def group_count(self) -> tuple[str, int]:
        return "subsets", len(self.subsets)


@dataclass(frozen=True)
class DirichletOptions:
    """Each class is split over clients with proportions ~ Dir(alpha)."""

    alpha: float = option(0.5, above(0))
    min_samples: int = option(10, at_least(2))


@dataclass(frozen=True)
class NaturalOptions:
    """One client per writer (FEMNIST/LEAF); writers drawn at random."""


def _check_one_per_entry(values: Sequence[int] | None, item: str, entries: str, count: int, key: str) -> None:
    """``values``, where given, holds one positive ``item`` (a cluster's size, its sample total) per
    entry of the option ``entries`` (angles, groups, subsets: one per true cluster), ``count`` of them.
    A length that depends on another option is structure, not a range, so it stays code."""
    if values is None:
        return
    require(len(values) == count, key, f"needs one {item} per entry of {entries} ({count}), got {len(values)}")
    require(all(v >= 1 for v in values), key, f"{item}s must be >= 1")


# ---- building blocks ---------------------------------------------------------------


class LabelPools:
    """Per-label queues of shuffled pool indices, drawn without replacement; running out is a
    config error on ``key``, the option that sets how many samples are drawn."""

    def __init__(
        self, labels: np.ndarray, candidates: np.ndarray, rng: np.random.Generator,
        key: str = "partition.samples_per_client",
    ):
        self._labels = labels
        self._key = key
        self._queues = {
            int(label): list(rng.permutation(candidates[labels[candidates] == label]))
            for label in np.unique(labels[candidates])
        }

    def available(self, label: int) -> int:
        return len(self._queues.get(label, ()))

    def take(self, label: int, count: int) -> list[int]:
        queue = self._queues.get(label, [])
        if count > len(queue):
            raise ConfigError(
                self._key,
                f"not enough samples of label {label} left ({len(queue)} < {count}); "
                f"lower {self._key.rsplit('.', 1)[-1]} or partition.num_clients",
            )
        taken, self._queues[label] = queue[:count], queue[count:]
        return taken


def split_counts(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal integers."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def cluster_ids(sizes: Sequence[int] | None, num_clusters: int, num_clients: int) -> np.ndarray:
    """Client -> cluster id, contiguous blocks of the given (or equal) sizes."""
    if sizes is None:
        sizes = split_counts(num_clients, num_clusters)
    if sum(sizes) != num_clients:
        raise ConfigError(
            "partition.cluster_sizes",
            f"sizes add up to {sum(sizes)} but partition.num_clients is {num_clients}",
        )
    return np.repeat(np.arange(len(sizes)), sizes)


def draw_by_label_counts(pools: LabelPools, counts: dict[int, int]) -> np.ndarray:
    return np.asarray([i for label, n in counts.items() for i in pools.take(label, n)], dtype=np.int64)


def spread(total: int, labels: Sequence[int], rng: np.random.Generator) -> dict[int, int]:
    """``total`` samples spread evenly over ``labels`` (remainder to random labels)."""
    order = rng.permutation(len(labels))
    counts = split_counts(total, len(labels))
    return {int(labels[j]): counts[rank] for rank, j in enumerate(order)}


def apportion(
    total: int, weights: np.ndarray, rng: np.random.Generator, capacity: np.ndarray | None = None
) -> np.ndarray:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainder method,
    ties broken at random), each at most ``capacity``; ValueError if capacity runs out."""
    weights = np.asarray(weights, dtype=float)
    quota = total * weights / weights.sum()
    limit = np.full(len(weights), np.iinfo(np.int64).max) if capacity is None else np.asarray(capacity)
    counts = np.minimum(np.floor(quota).astype(np.int64), limit)
    remainder = quota - counts + rng.uniform(0, 1e-9, size=len(weights))
    while counts.sum() < total:
        spare = np.flatnonzero(counts < limit)
        if len(spare) == 0:
            raise ValueError("capacity exhausted")
        pick = spare[np.argmax(remainder[spare])]
        counts[pick] += 1
        remainder[pick] -= 1
    return counts


def stratified_split(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into train/test with the same label proportions.

    The test split has ``round(n * test_fraction)`` samples (at least one), shared out over
    labels by largest remainder, so rare labels do not all round down to zero.
    """
    indices = rng.permutation(indices)
    present, counts = np.unique(labels[indices], return_counts=True)
    num_test = max(int(round(len(indices) * test_fraction)), 1 if test_fraction > 0 and len(indices) >= 2 else 0)
    per_label = apportion(num_test, counts, rng, capacity=counts) if num_test else np.zeros(len(counts), int)
    test = [indices[labels[indices] == label][:k] for label, k in zip(present, per_label)]
    test_idx = np.concatenate(test) if test else np.empty(0, dtype=np.int64)
    train_idx = np.setdiff1d(indices, test_idx, assume_unique=True)
    return rng.permutation(train_idx), np.sort(test_idx)


# ---- partitioners -------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionRequest:
    """What every partitioner receives: pool labels, sizes and a seeded RNG."""

    labels: np.ndarray
    num_classes: int
    num_clients: int
    samples_per_client: int | None
    rng: np.random.Generator
    writers: np.ndarray | None = None

    def per_client(self) -> int:
        """Samples per client: the configured cap, else an equal share of the pool."""
        share = len(self.labels) // self.num_clients
        if self.samples_per_client is None:
            require(share >= 2, "partition.num_clients", f"too many clients for {len(self.labels)} samples")
            return share
        require(
            self.samples_per_client * self.num_clients <= len(self.labels),
            "partition.samples_per_client",
            f"{self.num_clients} clients x {self.samples_per_client} samples exceeds the "
            f"{len(self.labels)} samples of the dataset",
        )
        return self.samples_per_client

    def check_labels(self, key: str, labels: Sequence[int]) -> None:
        for label in labels:
            require(
                0 <= label < self.num_classes,
                key,
                f"label {label} is outside the dataset's classes 0..{self.num_classes - 1}",
            )


PartitionResult = tuple[list[np.ndarray], np.ndarray, list[ClientTransform]]


def iid_indices(req: PartitionRequest) -> list[np.ndarray]:
    size = req.per_client()
    order = req.rng.permutation(len(req.labels))
    return [order[i * size : (i + 1) * size] for i in range(req.num_clients)]


def partition_iid(req: PartitionRequest, opts: IidOptions) -> PartitionResult:
    return iid_indices(req), np.zeros(req.num_clients, dtype=np.int64), [ClientTransform()] * req.num_clients


def partition_pathological(req: PartitionRequest, opts: PathologicalOptions) -> PartitionResult:
    """McMahan et al.'s shards: every label's samples are cut into single-label shards, in
    proportion to the label's frequency; each client takes ``labels_per_client`` random
    shards, so it holds at most that many labels.

    A shard holds ``samples_per_client // labels_per_client`` samples; without
    ``samples_per_client``, the largest size at which every label still splits into
    whole shards (at most an equal share of the pool).
    """
    num_shards = req.num_clients * opts.labels_per_client
    labels, counts = np.unique(req.labels, return_counts=True)
    shard = req.per_client() // opts.labels_per_client
    if req.samples_per_client is None:
        while shard > 1 and (counts // shard).sum() < num_shards:
            shard -= 1
    require(shard >= 1, "partition.labels_per_client", f"exceeds samples per client ({req.per_client()})")
    try:
        shards_per_label = apportion(num_shards, counts, req.rng, capacity=counts // shard)
    except ValueError:
        raise ConfigError(
            "partition.samples_per_client",
            f"cannot cut {num_shards} single-label shards of {shard} samples from the dataset; "
            f"lower samples_per_client or num_clients",
        ) from None
    shards = []
    for label, count in zip(labels, shards_per_label):
        members = req.rng.permutation(np.flatnonzero(req.labels == label))
        shards += [members[k * shard : (k + 1) * shard] for k in range(count)]
    assignment = req.rng.permutation(num_shards).reshape(req.num_clients, opts.labels_per_client)
    indices = [np.concatenate([shards[j] for j in row]) for row in assignment]
    # Clients holding the same set of labels share a distribution: that is their true cluster.
    label_sets = [tuple(sorted(set(req.labels[idx].tolist()))) for idx in indices]
    ids = {s: k for k, s in enumerate(sorted(set(label_sets)))}
    true = np.asarray([ids[s] for s in label_sets], dtype=np.int64)
    return indices, true, [ClientTransform()] * req.num_clients


def partition_label_swap(req: PartitionRequest, opts: LabelSwapOptions) -> PartitionResult:
    swaps = opts.swaps
    if swaps is None:
        require(
            2 * opts.num_groups <= req.num_classes,
            "partition.num_groups",
            f"default swaps pair labels (0,1), (2,3), ...: at most {req.num_classes // 2} groups; "
            f"give partition.swaps for more",
        )
        swaps = tuple((2 * g, 2 * g + 1) for g in range(opts.num_groups))
    req.check_labels("partition.swaps", [label for pair in swaps for label in pair])
    true = cluster_ids(None, opts.num_groups, req.num_clients)
    transforms = []
    for g in range(opts.num_groups):
        label_map = list(range(req.num_classes))
        a, b = swaps[g]
        label_map[a], label_map[b] = b, a
        transforms.append(ClientTransform(label_map=tuple(label_map)))
    return iid_indices(req), true, [transforms[g] for g in true]


def partition_rotation(req: PartitionRequest, opts: RotationOptions) -> PartitionResult:
    true = cluster_ids(opts.cluster_sizes, len(opts.angles), req.num_clients)
    transforms = [ClientTransform(rotation=opts.angles[k], rotation_fill=opts.rotation_fill) for k in true]
    return iid_indices(req), true, transforms


def partition_label_groups(req: PartitionRequest, opts: LabelGroupsOptions) -> PartitionResult:
    """Ali & Arafa / Zec tasks: a majority task's labels plus a minority of the others."""
    for k, group in enumerate(opts.groups):
        req.check_labels(f"partition.groups[{k}]", group)
    size = req.per_client()
    true = cluster_ids(opts.cluster_sizes, len(opts.groups), req.num_clients)
    pools = LabelPools(req.labels, np.arange(len(req.labels)), req.rng)
    minority = int(round(size * opts.minority_fraction))
    indices = []
    for k in true:
        others = sorted(set(range(req.num_classes)) - set(opts.groups[k]))
        counts = spread(size - minority, opts.groups[k], req.rng)
        if minority:
            require(others, "partition.minority_fraction", f"group {k} holds every label")
            for label, n in spread(minority, others, req.rng).items():
                counts[label] = counts.get(label, 0) + n
        indices.append(draw_by_label_counts(pools, counts))
    return indices, true, [ClientTransform()] * req.num_clients


def partition_class_subsets(req: PartitionRequest, opts: ClassSubsetsOptions) -> PartitionResult:
    """Lin et al.: every cluster holds its own subset of the classes, spread evenly over them.

    With ``cluster_samples`` (the paper's setting: cluster A 17,500 MNIST samples, B 14,500) the
    cluster's total is drawn and split equally and at random over its clients; otherwise every
    client gets ``samples_per_client``, by default the largest size the pool can give every
    client for any seed: q·min_k |S_k|, where q = min over classes c of ⌊available(c) / (clients
    holding c)⌋ (a client of subset S_k then needs at most ⌈size/|S_k|⌉ ≤ q of each class).
    """
    for k, subset in enumerate(opts.subsets):
        req.check_labels(f"partition.subsets[{k}]", subset)
    true = cluster_ids(opts.cluster_sizes, len(opts.subsets), req.num_clients)
    if opts.cluster_samples is not None:
        require(req.samples_per_client is None, "partition.cluster_samples",
                "give either partition.samples_per_client or partition.cluster_samples, not both")
        pools = LabelPools(req.labels, np.arange(len(req.labels)), req.rng, key="partition.cluster_samples")
        indices: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * req.num_clients
        for k, total in enumerate(opts.cluster_samples):
            members = np.flatnonzero(true == k)
            require(total >= 2 * len(members), f"partition.cluster_samples[{k}]",
                    f"{total} samples cannot give each of the cluster's {len(members)} clients two")
            drawn = req.rng.permutation(draw_by_label_counts(pools, spread(total, opts.subsets[k], req.rng)))
            for pid, part in zip(members, np.split(drawn, np.cumsum(split_counts(total, len(members)))[:-1])):
                indices[pid] = part
        return indices, true, [ClientTransform()] * req.num_clients
    if req.samples_per_client is None:
        available = np.bincount(req.labels, minlength=req.num_classes)
        holders = np.zeros(req.num_classes, dtype=np.int64)
        for k in true:
            holders[list(opts.subsets[k])] += 1
        used = holders > 0
        per_class = int(np.min(available[used] // holders[used]))
        size = per_class * min(len(opts.subsets[k]) for k in set(true.tolist()))
        require(size >= 2, "partition.num_clients", f"too many clients for the classes of {len(req.labels)} samples")
    else:
        size = req.per_client()
    pools = LabelPools(req.labels, np.arange(len(req.labels)), req.rng)
    indices = [draw_by_label_counts(pools, spread(size, opts.subsets[k], req.rng)) for k in true]
    return indices, true, [ClientTransform()] * req.num_clients


def partition_dirichlet(req: PartitionRequest, opts: DirichletOptions) -> PartitionResult:
    """Hsu et al.: class c is split over clients with proportions ~ Dir(alpha)."""
    for _ in range(100):
        buckets: list[list[int]] = [[] for _ in range(req.num_clients)]
        for label in range(req.num_classes):
            members = req.rng.permutation(np.flatnonzero(req.labels == label))
            shares = req.rng.dirichlet(np.full(req.num_clients, opts.alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, part in enumerate(np.split(members, cuts)):
                buckets[client].extend(part.tolist())
        if min(len(b) for b in buckets) >= opts.min_samples:
            break
    else:
        raise ConfigError(
            "partition.alpha",
            f"could not give every client {opts.min_samples} samples in 100 draws; "
            f"raise alpha or lower num_clients / min_samples",
        )
    cap = req.samples_per_client
    indices = [req.rng.permutation(np.asarray(b, dtype=np.int64))[:cap] for b in buckets]
    return indices, np.zeros(req.num_clients, dtype=np.int64), [ClientTransform()] * req.num_clients


def partition_natural(req: PartitionRequest, opts: NaturalOptions) -> PartitionResult:
    """LEAF's natural split: each client is one writer."""
    if req.writers is None:
        raise ConfigError("partition.name", "'natural' needs a dataset with writer ids (femnist)")
    writers = np.unique(req.writers)
    require(
        req.num_clients <= len(writers),
        "partition.num_clients",
        f"the dataset has only {len(writers)} writers",
    )
    chosen = req.rng.choice(writers, size=req.num_clients, replace=False)
    cap = req.samples_per_client
    indices = [req.rng.permutation(np.flatnonzero(req.writers == w))[:cap] for w in chosen]
    return indices, np.zeros(req.num_clients, dtype=np.int64), [ClientTransform()] * req.num_clients


@dataclass(frozen=True)
class Partitioner:
    options: type
    build: Callable[[PartitionRequest, Any], PartitionResult]


PARTITIONERS: dict[str, Partitioner] = {
    "iid": Partitioner(IidOptions, partition_iid),
    "pathological": Partitioner(PathologicalOptions, partition_pathological),
    "label_swap": Partitioner(LabelSwapOptions, partition_label_swap),
    "rotation": Partitioner(RotationOptions, partition_rotation),
    "label_groups": Partitioner(LabelGroupsOptions, partition_label_groups),
    "class_subsets": Partitioner(ClassSubsetsOptions, partition_class_subsets),
    "dirichlet": Partitioner(DirichletOptions, partition_dirichlet),
    "natural": Partitioner(NaturalOptions, partition_natural),
}


def make_partition(
    name: str,
    options: Any,
    *,
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    samples_per_client: int | None,
    test_fraction: float,
    seed: int,
    writers: np.ndarray | None = None,
    val_fraction: float = 0.0,
) -> Partition:
    """Run partitioner ``name`` and split each client's samples into train and test (and, with
    ``val_fraction``, a validation split out of the training samples, stratified by label)."""
    partitioner = PARTITIONERS[name]
    assert isinstance(options, partitioner.options), "options do not match the partitioner"
    rng = np.random.default_rng(seed)
    req = PartitionRequest(labels, num_classes, num_clients, samples_per_client, rng, writers)
    indices, true, transforms = partitioner.build(req, options)
    splits = [stratified_split(np.asarray(idx), labels, test_fraction, rng) for idx in indices]
    val: list[np.ndarray] = []
    if val_fraction > 0:
        val_rng = np.random.default_rng([seed, 1])  # its own stream: train/test splits stay as without it
        share = val_fraction / (1.0 - test_fraction)
        held = [stratified_split(train, labels, share, val_rng) for train, _ in splits]
        splits = [(train, test) for (train, _), (_, test) in zip(held, splits)]
        val = [v for _, v in held]
    for client, (train, _) in enumerate(splits):
        if len(train) == 0:
            raise ConfigError("partition", f"client {client} got no training samples")
    return Partition(
        train_indices=tuple(train for train, _ in splits),
        test_indices=tuple(test for _, test in splits),
        true_clusters=np.asarray(true, dtype=np.int64),
        transforms=tuple(transforms),
        val_indices=tuple(val),
    )


def group_count(options: Any) -> tuple[str, int] | None:
    """The option that sets a partitioner's true clusters (``num_groups``, ``angles``, ...) and how
    many it sets; None for a partitioner without fixed groups (iid, dirichlet, ...)."""
    count = getattr(options, "group_count", None)
    return count() if callable(count) else None


def cluster_names(options: Any, num_clusters: int) -> tuple[str, ...]:
    """What each true cluster is, for plots ("180°", "labels 0,1,8,9"), from the partitioner's
    options; "cluster k" where a partitioner's clusters have no other name."""
    name = getattr(options, "cluster_name", None)
    return tuple(name(k) if callable(name) else f"cluster {k}" for k in range(num_clusters))
