"""One-shot data-similarity clustering (Ali & Arafa): the relevance of one client's data to
another's from their Gram matrices' eigenvectors (eqs. 2-5), and clustering by it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...clustering import HacResult, cluster_square

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
