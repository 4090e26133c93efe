"""Model selection by validation loss (Zec et al.'s protocol for personal models): each client's
reported test accuracy is that of its model with the lowest validation loss so far, not of its
latest model. It applies where clients hold a validation split (``partition.val_fraction``) and
report its loss; the DAC family's strategies and ``local`` (their baseline) keep it.

Mixed in before :class:`~.strategy.ClusteredStrategy`: ``class Gossip(ValidatedSelection, ClusteredStrategy)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...clustering import mean_by
from .directory import UNKNOWN_CLUSTER
from .strategy import ClusteredStrategy, RoundReport


class ValidatedSelection(ClusteredStrategy):
    """Adds ``mean_best_val_accuracy`` and ``per_true_cluster_best_val_accuracy`` to the rows and
    the summary, and the bookkeeping to the strategy's state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per client: (lowest validation loss so far, test accuracy of the model that had it).
        self.best_validated: dict[int, tuple[float, float]] = {}

    def evaluated(self, server_round: int, report: RoundReport) -> None:
        super().evaluated(server_round, report)
        for pid, value in report.val_loss.items():
            if pid not in self.best_validated or value < self.best_validated[pid][0]:
                self.best_validated[pid] = (value, report.accuracy[pid])

    def best_validated_metrics(self) -> dict[str, Any]:
        if not self.best_validated:
            return {}
        true = self.directory.true_clusters(self.setup.true_clusters)
        best = {p: acc for p, (_, acc) in sorted(self.best_validated.items())}
        return {
            "mean_best_val_accuracy": float(np.mean(list(best.values()))),
            "per_true_cluster_best_val_accuracy": mean_by(
                {p: a for p, a in best.items() if true[p] != UNKNOWN_CLUSTER}, {p: str(int(true[p])) for p in best}),
        }

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return super().round_metrics(server_round) | self.best_validated_metrics()

    def summary(self) -> dict[str, Any]:
        return super().summary() | dict.fromkeys(
            ("mean_best_val_accuracy", "per_true_cluster_best_val_accuracy")) | self.best_validated_metrics()

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"best_validated": {p: list(v) for p, v in self.best_validated.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.best_validated = {int(p): (v[0], v[1]) for p, v in state.get("best_validated", {}).items()}
