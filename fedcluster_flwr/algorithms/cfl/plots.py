"""CFL's cluster tree: how the clusters split over the rounds."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def plot_cluster_tree(
    splits: Sequence[Any], assignment: np.ndarray, true_clusters: np.ndarray, rounds: int, path: Path, title: str
) -> None:
    """Clusters as horizontal lines over the rounds, each split (a :class:`~.strategy.Split`: its
    ``round``, ``parent``, ``children``, ``alpha_max_cross``) a fork labelled with its round and
    α_max^cross; each current cluster labelled with its size and how many of its members come from
    each true cluster (``true 0:5, 2:1``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    children = {s.parent: s for s in splits}
    born = {c: s.round for s in splits for c in s.children}
    rows: dict[int, float] = {}

    def place(node: int) -> float:  # leaves top to bottom in tree order, a parent between its children
        if node in children:
            rows[node] = float(np.mean([place(c) for c in children[node].children]))
        else:
            rows[node] = float(len([r for n, r in rows.items() if n not in children]))
        return rows[node]

    place(0)
    fig, ax = plt.subplots(figsize=(8.0, max(2.5, 0.55 * (len(splits) + 1) + 1.2)))
    for node, y in rows.items():
        start = born.get(node, 0)
        end = children[node].round if node in children else rounds
        ax.plot([start, end], [y, y], color="tab:blue", lw=2)
        if node in children:
            split = children[node]
            ys = [rows[c] for c in split.children]
            ax.plot([end, end], [min(ys), max(ys)], color="tab:gray", lw=1)
            ax.annotate(f"r{split.round}  α={split.alpha_max_cross:.2f}", (end, y), xytext=(3, 3),
                        textcoords="offset points", fontsize=7, color="tab:red")
        else:
            truth = np.bincount(true_clusters[assignment == node], minlength=1)
            label = ", ".join(f"{t}:{n}" for t, n in enumerate(truth) if n)
            ax.annotate(f"c{node} ({int(truth.sum())}; true {label})", (end, y), xytext=(4, -3),
                        textcoords="offset points", fontsize=7)
    ax.set(title=title, xlabel="round", yticks=[], xlim=(0, rounds * 1.35))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
