"""Non-IID partitioners that also return each client's true cluster id.

A partitioner assigns every client a set of sample indices of the dataset pool, a
true cluster id, and a transform that defines its distribution (a label
permutation for label swapping, an image rotation for rotated clusters). The
client's indices are then split into a local train and test split that share the
same label proportions, so a client is always tested on its own distribution.

Partitions are pure functions of (labels, options, seed). Each partitioner's options are declared
in :mod:`.partition_options`, the drawing it is built of in :mod:`.sampling`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..declarations.schema import ConfigError, require
from .partition_options import (
    ClassSubsetsOptions,
    DirichletOptions,
    IidOptions,
    LabelGroupsOptions,
    LabelSwapOptions,
    NaturalOptions,
    PathologicalOptions,
    RotationOptions,
)
from .sampling import LabelPools, apportion, cluster_ids, draw_by_label_counts, split_counts, spread, stratified_split


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
    seed: int = 0  # the run's seed: what a library partitioner's own seed defaults to (flwr_partitions)

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
    req = PartitionRequest(labels, num_classes, num_clients, samples_per_client, rng, writers, seed)
    indices, true, transforms = partitioner.build(req, options)
    check_split_sizes("test_fraction", "test", test_fraction, [len(idx) for idx in indices])
    splits = [stratified_split(np.asarray(idx), labels, test_fraction, rng) for idx in indices]
    val: list[np.ndarray] = []
    if val_fraction > 0:
        val_rng = np.random.default_rng([seed, 1])  # its own stream: train/test splits stay as without it
        share = val_fraction / (1.0 - test_fraction)
        check_split_sizes("val_fraction", "validation", share, [len(train) for train, _ in splits], val_fraction,
                          "training samples")
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


def check_split_sizes(key: str, split: str, share: float, sizes: Sequence[int], given: float | None = None,
                      of: str = "samples") -> None:
    """``partition.<key>`` must give every client at least one ``split`` example: a share of a
    client's ``sizes`` samples that rounds to none (``test_fraction=1e-9``) used to be raised to one
    example without a word, so that every accuracy measured was 0 or 1. ``given``: the option's
    value where ``share`` is derived from it (the validation share of the training samples, ``of``)."""
    smallest = int(np.argmin(sizes)) if len(sizes) else 0
    if not len(sizes) or round(sizes[smallest] * share) >= 1:
        return
    n = sizes[smallest]
    raise ConfigError(
        f"partition.{key}",
        f"{share if given is None else given:g} gives client {smallest} {round(n * share)} {split} examples of its {n} "
        f"{of} ({n * share:.3g}, rounded); a client needs at least one to be measured: give a larger share"
        f"{'' if given is not None else f' (at least {1 / n:.3g})'} or more samples per client",
    )

