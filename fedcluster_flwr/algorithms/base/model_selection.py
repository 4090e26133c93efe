"""Model selection by validation loss (Zec et al.'s protocol for personal models): each client's
reported accuracy is also given for its model with the lowest validation loss so far, not only its
latest. It applies to every strategy whose clients hold a validation split
(``partition.val_fraction``) and report its loss; the rows then carry ``mean_best_val_accuracy``
and ``per_true_cluster_best_val_accuracy``. The record is part of the strategy's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...clustering import mean_by
from .directory import UNKNOWN_CLUSTER


class BestValidated:
    """Per client: the lowest validation loss so far and the test accuracy of the model that had it."""

    def __init__(self) -> None:
        self.best: dict[int, tuple[float, float]] = {}

    def update(self, accuracy: Mapping[int, float], val_loss: Mapping[int, float]) -> None:
        for pid, value in val_loss.items():
            if pid not in self.best or value < self.best[pid][0]:
                self.best[pid] = (value, accuracy[pid])

    def metrics(self, true_clusters: np.ndarray) -> dict[str, Any]:
        """The row's entries (none before any client reported a validation loss)."""
        if not self.best:
            return {}
        best = {p: acc for p, (_, acc) in sorted(self.best.items())}
        return {
            "mean_best_val_accuracy": float(np.mean(list(best.values()))),
            "per_true_cluster_best_val_accuracy": mean_by(
                {p: a for p, a in best.items() if true_clusters[p] != UNKNOWN_CLUSTER},
                {p: str(int(true_clusters[p])) for p in best}),
        }

    def state_dict(self) -> dict[str, list[float]]:
        return {p: list(v) for p, v in self.best.items()}

    def load_state_dict(self, state: Mapping[Any, Any]) -> None:
        self.best = {int(p): (v[0], v[1]) for p, v in state.items()}
