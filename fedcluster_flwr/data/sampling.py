"""Drawing a partition's samples: per-label pools drawn without replacement, counts spread evenly
or by largest remainder, clients in contiguous cluster blocks, and a client's stratified
train/test split. Pure functions of their inputs and the RNG they are given."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..declarations.schema import ConfigError


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
