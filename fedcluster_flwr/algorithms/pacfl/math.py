"""Principal angles between client data subspaces (PACFL, Vahidian et al.): the server's proximity
matrix and where a newcomer joins."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
