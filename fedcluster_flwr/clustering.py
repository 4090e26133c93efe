"""Server-side clustering: update matrices, pairwise distances, HAC and cluster scores.

The strategy writes each client's update into one float32 matrix (N x d) as it
deserializes them one at a time; distances are then summed over blocks of columns on
every core, each core holding one block and an N x N float64 sum (8 MB at N = 1,000), so
FL+HC's clustering adds little more than that matrix to what Flower itself holds (the N
received updates, as bytes). For l2/cosine,
``projection_dim`` projects each update on arrival with a sparse random projection
(Johnson-Lindenstrauss), shrinking the matrix to N x projection_dim; for 1,000 clients
of a 1.7 M-parameter model that is the difference between 6.6 GB and a few MB.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
from sklearn.metrics.cluster import contingency_matrix
from sklearn.random_projection import SparseRandomProjection

from .numerics import torch_threads

DISTANCES = ("l1", "l2", "cosine")
LINKAGES = ("single", "complete", "average", "ward")
# Columns per block of the pairwise distances: an l1 block (all rows) stays in a core's L2 cache
# while the kernel walks its pairs (262 columns at 1,000 rows; benchmarks/clustering); a Gram
# block is wide enough for BLAS to run near its peak.
L1_BLOCK_BYTES = 2**20
MIN_L1_BLOCK_COLUMNS = 64
GRAM_BLOCK_COLUMNS = 32_768


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate model arrays into one float32 vector."""
    return np.concatenate([np.ravel(a) for a in arrays]).astype(np.float32, copy=False)


class UpdateMatrix:
    """Client update vectors as rows of one float32 matrix, filled one row at a time."""

    def __init__(self, num_rows: int, dim: int, projection_dim: int | None = None, seed: int = 0):
        self._projection = None
        if projection_dim is not None and projection_dim < dim:
            self._projection = SparseRandomProjection(
                n_components=projection_dim, dense_output=True, random_state=seed
            ).fit(np.zeros((1, dim), dtype=np.float32))
            dim = projection_dim
        self.rows = np.zeros((num_rows, dim), dtype=np.float32)

    def set_row(self, row: int, vector: np.ndarray) -> None:
        if self._projection is not None:
            vector = self._projection.transform(vector.reshape(1, -1))[0]
        self.rows[row] = vector


def pairwise_distances(vectors: np.ndarray, distance: str, block_columns: int | None = None) -> np.ndarray:
    """Condensed pairwise distance vector (as scipy's ``pdist``), float64, without copying ``vectors``.

    Sums over blocks of columns (all rows, ``block_columns`` wide; by default a width suited to
    each metric): l1 from a compiled kernel over each block (:mod:`fedcluster_flwr.l1_kernel`), l2
    and cosine from each block's Gram matrix; float32 input is computed in float32 within a block
    and summed over blocks in float64.
    """
    if distance not in DISTANCES:
        raise ValueError(f"unknown distance {distance!r}; expected one of {DISTANCES}")
    vectors = np.asarray(vectors)
    if vectors.dtype not in (np.float32, np.float64):
        vectors = vectors.astype(np.float32)
    rows = torch.from_numpy(vectors)  # shares the memory
    count = len(rows)
    if distance == "l1":
        # imported here: every client process imports this module, and only the server's l1 step needs numba
        from fedcluster_flwr.l1_kernel import add_l1_distances

        width = block_columns or max(MIN_L1_BLOCK_COLUMNS, L1_BLOCK_BYTES // (rows.element_size() * max(count, 1)))
        return _sum_over_column_blocks(
            rows, lambda block, total: add_l1_distances(block.T.contiguous().numpy(), total.numpy()), width,
            (count * (count - 1) // 2,),
        ).numpy()
    width = block_columns or GRAM_BLOCK_COLUMNS
    gram = _sum_over_column_blocks(rows, lambda block, total: total.add_(block @ block.T), width, (count, count))
    return _distances_from_gram(gram.numpy(), distance)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity, where the platform reports one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _sum_over_column_blocks(
    rows: torch.Tensor, add_block: Callable[[torch.Tensor, torch.Tensor], Any], width: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """The float64 sum that ``add_block(rows[:, block], total)`` adds to over consecutive blocks of ``width`` columns.

    One worker thread per available core, each summing every k-th block with a single-threaded
    torch (the kernels release the GIL): the simulation leaves torch at one thread, and measured
    on a loaded 2-core machine, workers that never wait for each other beat torch's own
    thread pool, whose every kernel call waits for all its threads (benchmarks/clustering).
    Which worker sums which block depends only on the core count, so a result is reproducible.
    """
    starts = range(0, rows.shape[1], width)
    workers = max(1, min(available_cores(), len(starts)))

    def worker_sum(first: int) -> torch.Tensor:
        total = torch.zeros(shape, dtype=torch.float64)
        for start in starts[first::workers]:
            add_block(rows[:, start : start + width], total)
        return total

    with torch_threads(1), ThreadPoolExecutor(workers) as pool:
        return functools.reduce(torch.add, pool.map(worker_sum, range(workers)))


def _distances_from_gram(gram: np.ndarray, distance: str) -> np.ndarray:
    """Condensed l2 or cosine distances from the Gram matrix (its diagonal: the squared norms).

    A zero update is at cosine distance 1 from everything.
    """
    squared_norms = np.diagonal(gram)
    if distance == "l2":
        square = np.sqrt(np.maximum(squared_norms[:, None] + squared_norms[None, :] - 2.0 * gram, 0.0))
    else:
        norms = np.sqrt(squared_norms)
        inverse_norms = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
        square = 1.0 - gram * inverse_norms[:, None] * inverse_norms[None, :]
    square = np.maximum((square + square.T) / 2, 0.0)  # symmetric, no round-off negatives
    np.fill_diagonal(square, 0.0)
    return squareform(square, checks=False)


@dataclass(frozen=True)
class HacResult:
    """Flat clusters (0..K-1, numbered by first member) and scipy's linkage matrix."""

    labels: np.ndarray
    linkage: np.ndarray
    distances: np.ndarray  # condensed

    @property
    def num_clusters(self) -> int:
        return int(self.labels.max()) + 1 if len(self.labels) else 0

    def sizes_text(self) -> str:
        """``3 clusters of sizes [4, 4, 4]`` or ``1 cluster of size 12``, for the decision logs."""
        sizes = np.bincount(self.labels).tolist()
        if len(sizes) == 1:
            return f"1 cluster of size {sizes[0]}"
        return f"{len(sizes)} clusters of sizes {sizes}"


@dataclass(frozen=True)
class ClusteringRecord:
    """A one-time clustering of some clients (FL+HC's updates, one-shot HFL's relevance): the
    round it happened, whom it clustered (``pids``, in the order of the linkage's leaves), the
    labels it gave them and scipy's linkage matrix. Self-contained: a checkpoint keeps it whole."""

    round: int
    pids: tuple[int, ...]
    labels: np.ndarray
    linkage: np.ndarray
    cut: str  # how the dendrogram was cut (:func:`cut_rule`)

    @classmethod
    def of(cls, server_round: int, pids: Sequence[int], hac: HacResult, cut: str) -> ClusteringRecord:
        return cls(server_round, tuple(int(p) for p in pids), hac.labels, hac.linkage, cut)

    @property
    def num_clusters(self) -> int:
        return int(self.labels.max()) + 1 if len(self.labels) else 0

    def summary(self) -> dict[str, Any]:
        return {
            "clustering_round": self.round,
            "clusters_found": self.num_clusters,
            "clustered_clients": list(self.pids),
            "clustering_labels": self.labels.tolist(),
            "merge_heights": self.linkage[:, 2].tolist(),
            "cut": self.cut,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "pids": list(self.pids), "labels": self.labels, "linkage": self.linkage,
                "cut": self.cut}

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> ClusteringRecord | None:
        if state is None:
            return None
        return cls(int(state["round"]), tuple(state["pids"]), np.asarray(state["labels"]), np.asarray(state["linkage"]),
                   state.get("cut", "not recorded (checkpoint older than the cut's record)"))

    def dendrogram(self, true_clusters: np.ndarray, threshold: float | None, title: str) -> Callable[[Path], None]:
        """The dendrogram figure (leaves ``client:true cluster``), drawn when called with a path, with
        its cut: ``threshold`` where the clustering used one, else the height that leaves the clusters
        found (a cut by number of clusters or by silhouette has no threshold of its own)."""
        from .plots import plot_dendrogram

        labels = [f"{p}:{true_clusters[p]}" for p in self.pids]
        return functools.partial(plot_dendrogram, self.linkage, labels, threshold, title=title,
                                 num_clusters=self.num_clusters)


def hierarchical_clustering(
    vectors: np.ndarray,
    distance: str,
    linkage: str,
    *,
    threshold: float | None = None,
    num_clusters: int | None = None,
) -> HacResult:
    """Agglomerative clustering of ``vectors``, cut as :func:`cluster_condensed` cuts."""
    if linkage not in LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; expected one of {LINKAGES}")
    if linkage == "ward" and distance != "l2":
        raise ValueError("ward linkage needs l2 (Euclidean) distances")
    return cluster_condensed(pairwise_distances(vectors, distance), len(vectors), linkage,
                             threshold=threshold, num_clusters=num_clusters)


def cluster_condensed(
    distances: np.ndarray,
    count: int,
    linkage: str,
    *,
    threshold: float | None = None,
    num_clusters: int | None = None,
) -> HacResult:
    """Agglomerative clustering of ``count`` items given their condensed pairwise ``distances``, cut at
    ``threshold``, into ``num_clusters`` or, given neither, where the silhouette is largest
    (:func:`silhouette_cut`)."""
    if threshold is not None and num_clusters is not None:
        raise ValueError("give at most one of threshold and num_clusters")
    if count < 2:
        return HacResult(np.zeros(count, dtype=np.int64), np.zeros((0, 4)), distances)
    tree = hierarchy.linkage(distances, method=linkage)
    if threshold is not None:
        flat = hierarchy.fcluster(tree, t=threshold, criterion="distance")
    elif num_clusters is not None:
        flat = hierarchy.fcluster(tree, t=num_clusters, criterion="maxclust")
    else:
        flat = silhouette_cut(tree, distances)
    return HacResult(renumber(flat), tree, distances)


def silhouette_cut(tree: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """Flat clusters of the linkage ``tree`` at the number of clusters K in 2..N-1 whose mean silhouette
    (Rousseeuw 1987, as scikit-learn's ``silhouette_score`` on the same condensed ``distances``) is
    largest, ties to the smaller K; one cluster for fewer than 3 items, where no K has a silhouette.

    The cut for a user who names neither a threshold nor a number of clusters: FL+HC's, one-shot HFL's
    and PACFL's papers tune the cut per dataset, and a threshold written for one distance (FL+HC's l1
    ``20``) means nothing on another (1 - R in (0, 1)). The silhouette never chooses a single cluster.

    Walks the tree from the root down, undoing one merge per K, and keeps each item's summed distance
    to every current cluster, so all K cost O(N^2 log N) instead of one O(N^2) ``silhouette_score``
    per K (36 s at N = 1,000); ``tests/test_clustering.py`` checks it against scikit-learn's. A K
    that tied merge heights make impossible to cut at (scipy's ``maxclust`` then gives fewer clusters)
    is skipped. K stops once the singletons' zeros alone bound the mean below the best so far."""
    count = len(tree) + 1
    if count < 3:
        return np.ones(count, dtype=np.int64)
    square = squareform(distances)
    members: list[np.ndarray] = [np.array([i]) for i in range(count)]
    for left, right in tree[:, :2].astype(np.int64):
        members.append(np.concatenate([members[left], members[right]]))
    column_of_node = {2 * count - 2: 0}
    label = np.zeros(count, dtype=np.int64)  # each item's cluster, a column of summed
    summed = np.zeros((count, count))  # summed[i, c]: sum of distances from item i to cluster c's members
    summed[:, 0] = square.sum(axis=1)
    sizes = np.zeros(count)
    sizes[0] = count
    best_score, best_k = -np.inf, 1
    for k in range(2, count):
        row = count - k  # undoing merge `row` (the last one still made) splits its node in two
        column = column_of_node.pop(count + row)
        small, large = sorted(tree[row, :2].astype(np.int64), key=lambda node: len(members[node]))
        small_sum = square[:, members[small]].sum(axis=1)
        summed[:, column] -= small_sum
        summed[:, k - 1] = small_sum
        column_of_node[large], column_of_node[small] = column, k - 1
        label[members[small]] = k - 1
        sizes[column], sizes[k - 1] = len(members[large]), len(members[small])
        if tree[row - 1, 2] == tree[row, 2]:
            continue
        if 2 * (count - k) / count <= best_score:  # >= 2k - N singletons, each scoring 0
            break
        score = _mean_silhouette(summed[:, :k], sizes[:k], label)
        if score > best_score:
            best_score, best_k = score, k
    return hierarchy.fcluster(tree, t=best_k, criterion="maxclust")


def _mean_silhouette(summed: np.ndarray, sizes: np.ndarray, label: np.ndarray) -> float:
    """scikit-learn's mean silhouette from each item's summed distance to each cluster (0 for an item
    alone in its cluster)."""
    items = np.arange(len(label))
    own_size = sizes[label]
    within = summed[items, label] / np.maximum(own_size - 1, 1)
    means = summed / sizes
    means[items, label] = np.inf
    nearest = means.min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = np.nan_to_num((nearest - within) / np.maximum(within, nearest))
    return float(np.mean(np.where(own_size > 1, scores, 0.0)))


def cut_rule(threshold: float | None, num_clusters: int | None) -> str:
    """How :func:`cluster_condensed` cuts the dendrogram, in words, for logs and summaries."""
    if threshold is not None:
        return f"threshold {threshold:g}"
    if num_clusters is not None:
        return f"{num_clusters} cluster{'' if num_clusters == 1 else 's'}"
    return "largest silhouette"


def renumber(labels: np.ndarray) -> np.ndarray:
    """Relabel clusters 0..K-1 in order of their first member."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inverse].astype(np.int64)


def mean_by(values: Mapping[int, float], groups: Mapping[int, str]) -> dict[str, float]:
    """Mean of ``values`` per group name, groups sorted as numbers where they are numbers."""
    grouped: dict[str, list[float]] = {}
    for pid, value in values.items():
        grouped.setdefault(groups[pid], []).append(value)
    return {k: float(np.mean(v)) for k, v in sorted(grouped.items(), key=lambda kv: _group_order(kv[0]))}


def _group_order(name: str) -> tuple[int, float, str]:
    return (0, float(name), "") if name.lstrip("-").isdigit() else (1, 0.0, name)


def purity(true: np.ndarray, predicted: np.ndarray) -> float:
    """Share of clients whose predicted cluster's majority true id is their own."""
    if len(true) == 0:
        return float("nan")
    table = contingency_matrix(true, predicted)
    return float(table.max(axis=0).sum() / table.sum())


def cluster_scores(true: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """Purity, adjusted Rand index and normalized mutual information."""
    if len(true) == 0:
        return {"purity": float("nan"), "ari": float("nan"), "nmi": float("nan")}
    return {
        "purity": purity(true, predicted),
        "ari": float(adjusted_rand_score(true, predicted)),
        "nmi": float(normalized_mutual_info_score(true, predicted)),
    }


def cluster_square(
    distance: np.ndarray, linkage: str, *, threshold: float | None = None, num_clusters: int | None = None
) -> HacResult:
    """Agglomerative clustering of items given their symmetric distance matrix: only the entries above
    the diagonal are read (scipy's condensed form), so the diagonal may hold anything."""
    return cluster_condensed(squareform(distance, checks=False), len(distance), linkage,
                             threshold=threshold, num_clusters=num_clusters)
