"""DAC's similarity arithmetic (Zec et al.): the temperature schedules of DAC-var, the two
two-hop estimates of unknown similarities (the paper's text and the reference code's), and the
share of exchanges inside the true clusters (the paper's Figure 4 in one number per cluster)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...clustering import cluster_square


def reference_tau(t: float, tau: float) -> float:
    """DAC-var's τ after exchange t (t = 0 the first), as the reference code's
    ``tau_function(t, a=τ, b=0.2)`` = 2a / (1 + e^(−0.2 t)) − a + 1 = a · tanh(0.1 t) + 1:
    1 at t = 0, ≈ 0.8 a + 1 at t = 10, ≈ a + 1 for t ≳ 30."""
    return tau * math.tanh(0.1 * t) + 1.0


def centred_tau(server_round: int, tau_max: float, rounds: int) -> float:
    """The earlier, centred schedule: τ = τ_max · σ((t − T/2) / (T/10)) with t the server round and
    T = ``rounds``: ≈ 0.7 % of τ_max at t = 0, its half at T/2 (≈ 0.5 at round 10 of 100)."""
    return tau_max / (1.0 + math.exp(-(server_round - rounds / 2) / max(rounds / 10, 1e-9)))


def two_hop_similarities(similarity: np.ndarray, met: np.ndarray) -> np.ndarray:
    """The paper's two-hop estimate: ``similarity`` with each unknown entry (i, k) filled from i's
    most similar met neighbour j that has met k: s_ik = s_jk. Measured entries are kept; entries
    with no such j stay NaN."""
    filled = similarity.copy()
    for i in range(len(similarity)):
        known = np.flatnonzero(met[i])
        if not len(known):
            continue
        by_similarity = known[np.argsort(-similarity[i, known], kind="stable")]
        for k in np.flatnonzero(~met[i]):
            if k == i:
                continue
            lender = next((j for j in by_similarity if met[j, k] and j != k), None)
            if lender is not None:
                filled[i, k] = similarity[lender, k]
    return filled


def reference_two_hop_update(table: np.ndarray, met: np.ndarray, i: int, neighbours: Sequence[int]) -> None:
    """The reference code's two-hop step for client i after an exchange with ``neighbours``, in
    place on the similarity ``table`` (measured and estimated entries; NaN unknown): every k that
    i has never sampled and that some neighbour's row knows takes that neighbour's entry, from the
    neighbour i finds most similar (ties: the first drawn)."""
    neighbours = np.asarray(neighbours, dtype=np.int64)
    if not len(neighbours):
        return
    known = ~np.isnan(table[neighbours])  # neighbours x clients
    for k in np.flatnonzero(known.any(axis=0) & ~met[i]):
        if k == i:
            continue
        holders = neighbours[known[:, k]]
        lender = holders[int(np.argmax(table[i, holders]))]
        table[i, k] = table[lender, k]


def implied_clusters(similarity: np.ndarray, num_clusters: int) -> np.ndarray:
    """Hard clusters from the relay's similarities (NaN: unknown): average linkage of the distances
    1 / s (a loss: both directions' mean, or the one known), unknown pairs at the largest known.
    Called once a pair has met; every s is a measured 1 / loss or a copy of one, of any age."""
    loss = 1.0 / similarity
    distance = np.where(np.isnan(loss), loss.T, np.where(np.isnan(loss.T), loss, (loss + loss.T) / 2))
    distance = np.nan_to_num(distance, nan=np.nanmax(distance))
    return cluster_square(distance, "average", num_clusters=num_clusters).labels


# The summary key under which a gossip run reports :func:`same_true_cluster_share` of its draws.
SAME_CLUSTER_DRAWS = "exchanges_same_true_cluster"


def same_true_cluster_share(counts: np.ndarray, true_clusters: np.ndarray) -> dict[str, float]:
    """Per true cluster c, the share of its members' exchanges (``counts[i, j]``: how often i took
    j's model, or whether it keeps j) that went to members of c: Σ_{i, j ∈ c} counts / Σ_{i ∈ c, j}
    counts, keyed by ``str(c)``; a cluster whose members exchanged nothing is left out. What the
    paper's communication heatmap (Figure 4) shows as its diagonal blocks; about (|c| − 1) / (N − 1)
    for draws uniform over the N − 1 other clients."""
    counts = np.asarray(counts)
    true_clusters = np.asarray(true_clusters)
    share = {}
    for cluster in np.unique(true_clusters):
        rows = counts[true_clusters == cluster]
        total = rows.sum()
        if total:
            share[str(int(cluster))] = float(rows[:, true_clusters == cluster].sum() / total)
    return share
