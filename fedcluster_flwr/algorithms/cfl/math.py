"""Clustered FL's bi-partition (Sattler et al.): split clients in two by the cosine similarity
of their updates."""

from __future__ import annotations

import numpy as np
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from ...clustering import renumber

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


def cosine_similarity(updates: np.ndarray) -> np.ndarray:
    """α_ij of the rows (float64; a zero update is orthogonal to everything, α = 0)."""
    rows = updates.astype(np.float64)
    norms = np.linalg.norm(rows, axis=1)
    unit = np.divide(rows, norms[:, None], out=np.zeros_like(rows), where=norms[:, None] > 0)
    return np.clip(unit @ unit.T, -1.0, 1.0)
