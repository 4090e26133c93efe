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
        return f"{num_clusters} clusters"
    return "largest silhouette"


def renumber(labels: np.ndarray) -> np.ndarray:
    """Relabel clusters 0..K-1 in order of their first member."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    return rank[inverse].astype(np.int64)


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


# ---- one-shot data-similarity clustering (Ali & Arafa) ------------------------------------------

RELEVANCE_FLOOR = 1e-3


RELEVANCE_RULES = ("paper", "amiri")  # which eigenvalue eq. 3 compares λ̂_k with; see relevance_row


def relevance_row(
    gram: np.ndarray,
    eigenvectors: Sequence[np.ndarray],
    eigenvalues: Sequence[np.ndarray] | None = None,
    floor: float = RELEVANCE_FLOOR,
) -> np.ndarray:
    """Row r(i, ·) of the relevance matrix, for client i with Gram matrix ``gram`` (d × d), given
    every client j's top eigenvectors v_k^(j) (``eigenvectors[j]``: rows of a k × d array).

    Ali & Arafa, eqs. 2-4 (and Algorithm 2, lines 8-11):

    * eq. 2: λ̂_k = ‖G_i v_k^(j)‖, how much of client i's data lies along j's k-th direction;
    * eq. 3: its agreement with λ_k^(i), client i's *own* k-th largest eigenvalue:
      min(λ_k^(i), λ̂_k) / max(λ_k^(i), λ̂_k). Users share only their eigenvectors (the paper's
      rule, ``strategy.relevance: paper``). Given ``eigenvalues`` (client j's own λ_k^(j), one
      array per client, shared along with the vectors), λ̂_k is compared with λ_k^(j) instead:
      Amiri et al.'s original form (``strategy.relevance: amiri``);
    * eq. 4: r(i, j) = the geometric mean of the k agreements.

    r(i, i) = 1 under either rule: v_k^(i) is an eigenvector of G_i, so λ̂_k = λ_k^(i).

    Tiny eigenvalues (the paper's own warning): a direction in which one side has (numerically)
    no variance would make its ratio 0 and zero the whole geometric mean. Each ratio is therefore
    taken as (min + ε) / (max + ε), with ε = ``floor`` · the largest eigenvalue compared (λ_1, or
    the largest λ̂): such a direction lowers r by a factor of at most about floor^(1/k), and
    directions at the scale of the data are unaffected. ``floor`` is ``strategy.eigen_floor``
    (ours; measured at k = 5 and 200 in benchmarks/oneshot/README.md).
    """
    if eigenvalues is not None and len(eigenvalues) != len(eigenvectors):
        raise ValueError(f"{len(eigenvalues)} eigenvalue arrays for {len(eigenvectors)} clients' eigenvectors")
    deepest = max((len(v) for v in eigenvectors), default=0)
    # λ_k^(i), descending; round-off negatives are no variance
    own_values = np.clip(np.linalg.eigvalsh(gram)[::-1][:deepest], 0.0, None)
    row = np.empty(len(eigenvectors))
    for j, vectors in enumerate(eigenvectors):
        vectors = np.asarray(vectors, dtype=np.float64)
        projected = np.linalg.norm(gram @ vectors.T, axis=0)  # eq. 2
        compared = own_values[: len(vectors)] if eigenvalues is None else np.asarray(eigenvalues[j], dtype=np.float64)
        eps = floor * max(float(compared.max(initial=0.0)), float(projected.max(initial=0.0)), np.finfo(float).tiny)
        smaller, larger = np.minimum(compared, projected) + eps, np.maximum(compared, projected) + eps
        # eq. 3; at floor 0 past the Gram matrix's rank both sides are 0: no variance on either, equal
        ratios = np.divide(smaller, larger, out=np.ones_like(larger), where=larger > 0)
        with np.errstate(divide="ignore"):  # floor 0 (no guard) may take log(0) = -inf: r = 0
            row[j] = float(np.exp(np.mean(np.log(ratios))))  # eq. 4
    return row


def relevance_matrix(rows: np.ndarray) -> np.ndarray:
    """R = (r + rᵀ) / 2 (eq. 5): symmetric, in [0, 1], 1 on the diagonal."""
    rows = np.asarray(rows, dtype=np.float64)
    return (rows + rows.T) / 2


def cluster_square(
    distance: np.ndarray, linkage: str, *, threshold: float | None = None, num_clusters: int | None = None
) -> HacResult:
    """Agglomerative clustering of items given their symmetric distance matrix (diagonal ignored)."""
    distance = distance.copy()
    np.fill_diagonal(distance, 0.0)
    return cluster_condensed(squareform(distance, checks=False), len(distance), linkage,
                             threshold=threshold, num_clusters=num_clusters)


def cluster_by_relevance(
    relevance: np.ndarray, linkage: str, *, threshold: float | None = None, num_clusters: int | None = None
) -> HacResult:
    """Agglomerative clustering of 1 − R (a distance: 0 for identical data)."""
    return cluster_square(np.clip(1.0 - relevance, 0.0, None), linkage, threshold=threshold, num_clusters=num_clusters)


def within_and_across(matrix: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """Mean off-diagonal entry of ``matrix`` between items of the same group, and of different groups."""
    groups = np.asarray(groups)
    same = groups[:, None] == groups[None, :]
    off_diagonal = ~np.eye(len(groups), dtype=bool)
    within = matrix[same & off_diagonal]
    across = matrix[~same]
    return (float(within.mean()) if within.size else float("nan"), float(across.mean()) if across.size else float("nan"))


# ---- bi-partition by similarity (Sattler et al.'s CFL) --------------------------------------------

BIPARTITION_LINKAGES = ("single", "complete")


def bipartition(similarity: np.ndarray, linkage: str = "single") -> tuple[np.ndarray, float]:
    """Split items into two groups given their symmetric pairwise ``similarity`` (e.g. cosine);
    returns the labels (0 for the group of item 0, else 1) and the largest similarity across the
    two groups, max_{i in c1, j in c2} similarity[i, j].

    ``single``: agglomerative clustering of 1 - similarity with single linkage, stopped at two
    groups. Merging the most similar pair first until two groups remain is Sattler et al.'s
    "optimal bipartition" algorithm, and its result minimises the largest cross similarity over
    all 2^(n-1) - 1 bi-partitions (it cuts the weakest edge of the maximum spanning tree of the
    similarity graph; any other cut leaves a tree edge at least as strong across). ``complete``:
    complete linkage instead, what the authors' reference code runs (sklearn's
    AgglomerativeClustering on -similarity): not the minimiser, and less prone to cutting off a
    single outlier.
    """
    if linkage not in BIPARTITION_LINKAGES:
        raise ValueError(f"unknown linkage {linkage!r}; expected one of {BIPARTITION_LINKAGES}")
    similarity = np.asarray(similarity, dtype=np.float64)
    if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1] or len(similarity) < 2:
        raise ValueError(f"a bi-partition needs a square similarity matrix of at least 2 items, got {similarity.shape}")
    distance = np.maximum(1.0 - (similarity + similarity.T) / 2, 0.0)
    np.fill_diagonal(distance, 0.0)
    tree = hierarchy.linkage(squareform(distance, checks=False), method=linkage)
    labels = renumber(hierarchy.cut_tree(tree, n_clusters=2).ravel())
    cross = float(similarity[np.ix_(labels == 0, labels == 1)].max())
    return labels, cross


# ---- principal angles between client data subspaces (PACFL, Vahidian et al.) ---------------------

# How two clients' subspaces (orthonormal bases U_i, U_j, d × p) are compared, in degrees:
# smallest_angle: θ_1(U_i, U_j), the smallest principal angle (the paper's eq. 2);
# sum_of_angles: θ_1 + ... + θ_p, every principal angle (the paper's trace form, eq. 3, read with
#   true principal angles);
# elementwise_min_angle: min over a, b of arccos(u_a^(i) · u_b^(j)), the reference code's
#   ``calculating_adjacency``: the smallest angle between two *basis vectors*, not a principal angle
#   (it is never below θ_1, and a basis vector's sign, which an SVD leaves arbitrary, changes it).
PROXIMITIES = ("smallest_angle", "sum_of_angles", "elementwise_min_angle")
LINKAGE_OVER_MEMBERS = {"single": np.min, "complete": np.max, "average": np.mean}


def principal_angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The principal angles θ_1 ≤ θ_2 ≤ ... between the column spans of ``a`` (d × p) and ``b``
    (d × q), in degrees (scipy's ``subspace_angles``: cos θ_k are the singular values of AᵀB for
    orthonormal A, B, and small angles come from their sines, so identical subspaces give 0)."""
    from scipy.linalg import subspace_angles

    return np.sort(np.degrees(subspace_angles(np.asarray(a, np.float64), np.asarray(b, np.float64))))


def subspace_proximity(a: np.ndarray, b: np.ndarray, rule: str) -> float:
    """Proximity of two clients' subspaces (bases as columns, d × p) under ``rule`` (see
    :data:`PROXIMITIES`), in degrees: 0 for identical subspaces (or basis vectors), larger apart."""
    if rule == "smallest_angle":
        return float(principal_angles(a, b)[0])  # eq. 2: A(i, j) = θ_1(U_i, U_j)
    if rule == "sum_of_angles":
        return float(principal_angles(a, b).sum())  # eq. 3: A(i, j) = Σ_k θ_k(U_i, U_j)
    if rule == "elementwise_min_angle":
        cosines = np.clip(np.asarray(a, np.float64).T @ np.asarray(b, np.float64), -1.0, 1.0)
        return float(np.degrees(np.arccos(cosines)).min())
    raise ValueError(f"unknown proximity {rule!r}; expected one of {PROXIMITIES}")


def proximity_matrix(bases: Sequence[np.ndarray], rule: str) -> np.ndarray:
    """The server's proximity matrix A (N × N, degrees) of N clients' bases (d × p each) under
    ``rule``: symmetric (each pair computed once), 0 on the diagonal."""
    count = len(bases)
    proximity = np.zeros((count, count))
    for i in range(count):
        for j in range(i + 1, count):
            proximity[i, j] = proximity[j, i] = subspace_proximity(bases[i], bases[j], rule)
    return proximity


def closest_cluster(distances: np.ndarray, labels: np.ndarray, linkage: str) -> int:
    """The cluster a newcomer joins, given its ``distances`` to the clustered clients and their
    cluster ``labels``: the one at the smallest linkage distance from it (single: its nearest
    member; complete: its farthest; average: the mean over members), i.e. the cluster agglomerative
    clustering with that linkage would join it to first. Ties go to the lowest cluster id."""
    if linkage not in LINKAGE_OVER_MEMBERS:
        raise ValueError(f"unknown linkage {linkage!r}; expected one of {tuple(LINKAGE_OVER_MEMBERS)}")
    distances, labels = np.asarray(distances, np.float64), np.asarray(labels)
    clusters = np.unique(labels)
    if not len(clusters):
        raise ValueError("no clustered clients to place a newcomer among")
    by_cluster = [LINKAGE_OVER_MEMBERS[linkage](distances[labels == k]) for k in clusters]
    return int(clusters[int(np.argmin(by_cluster))])
