"""The round log: a run's per-round accounting and what it writes.

It owns the round's counters (traffic, failures, rejected replies, training loss), the run's
totals and wall time, the metrics row of every round (mean, per assigned cluster and per
*true* cluster accuracy, clustering scores against the true ids, traffic), the summary, and
when checkpoints and plots are due. Files are written through
:class:`~fedcluster_flwr.results.RunRecorder`; the strategy supplies what only it knows
(phase, assignment, its models and state).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.common import log

from ..clustering import cluster_scores
from ..results import RunRecorder

UNASSIGNED = -1


@dataclass
class RoundCounters:
    started: float = 0.0
    num_fit_clients: int = 0
    fit_clients: tuple[int, ...] = ()
    fit_failures: int = 0
    rejected_updates: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_eval: int = 0
    train_loss: float = float("nan")


TOTALS = ("bytes_up", "bytes_down", "bytes_eval", "fit_failures", "rejected_updates")


def mean_by(values: Mapping[int, float], groups: Mapping[int, str]) -> dict[str, float]:
    """Mean of ``values`` per group name, groups sorted as numbers where they are numbers."""
    grouped: dict[str, list[float]] = {}
    for pid, value in values.items():
        grouped.setdefault(groups[pid], []).append(value)
    return {k: float(np.mean(v)) for k, v in sorted(grouped.items(), key=lambda kv: _group_order(kv[0]))}


def _group_order(name: str) -> tuple[int, float, str]:
    return (0, float(name), "") if name.lstrip("-").isdigit() else (1, 0.0, name)


class RoundLog:
    """Counters, totals, metrics rows and the summary of one run; see the module docstring."""

    def __init__(
        self,
        recorder: RunRecorder,
        true_clusters: np.ndarray,
        target_accuracy: float,
        rounds: int,
        checkpoint_every: int,
        stop_round: int | None = None,
        numeric_platform: Mapping[str, str] | None = None,
    ) -> None:
        self.recorder = recorder
        self.numeric_platform = dict(numeric_platform or {})
        self.stop_round = stop_round
        self.true_clusters = true_clusters
        self.target_accuracy = target_accuracy
        self.rounds = rounds
        self.checkpoint_every = checkpoint_every
        self.round = RoundCounters()
        self.totals = {key: 0 for key in TOTALS}
        self.latest_accuracy: dict[int, float] = {}
        # Per client: (lowest validation loss so far, test accuracy of the model that had it).
        self.best_validated: dict[int, tuple[float, float]] = {}
        self._started = time.perf_counter()
        self._seconds_before = 0.0  # wall time of the rounds before a resumed checkpoint

    def start_round(self) -> None:
        self.round = RoundCounters(started=time.perf_counter())

    def finished(self, server_round: int) -> bool:
        return server_round >= self.rounds

    def checkpoint_due(self, server_round: int) -> bool:
        every = self.checkpoint_every
        return (
            self.finished(server_round) or server_round == self.stop_round or bool(every and server_round % every == 0)
        )

    def metrics_row(
        self,
        server_round: int,
        phase: str,
        accuracy: Mapping[int, float],
        loss: Mapping[int, float],
        eval_failures: int,
        assignment: np.ndarray,
        connected: Sequence[int],
        val_loss: Mapping[int, float] | None = None,
    ) -> dict[str, Any]:
        """The round's metrics; ``accuracy`` and ``loss`` by partition id, in partition-id order.

        Where clients report a validation loss, the row also holds the test accuracy of each
        client's model with the lowest validation loss so far (model selection as in Zec et al.).
        """
        target = self.target_accuracy
        values = np.asarray(list(accuracy.values()), dtype=float)
        cluster_names = {
            pid: str(int(assignment[pid])) if assignment[pid] != UNASSIGNED else "unassigned" for pid in accuracy
        }
        assigned = [p for p in connected if assignment[p] != UNASSIGNED]
        counters = self.round
        for key in self.totals:
            self.totals[key] += getattr(counters, key)
        self.latest_accuracy = dict(accuracy)
        for pid, value in (val_loss or {}).items():
            if pid not in self.best_validated or value < self.best_validated[pid][0]:
                self.best_validated[pid] = (value, accuracy[pid])
        per_true = mean_by(accuracy, {p: str(int(self.true_clusters[p])) for p in accuracy})
        row = {
            "round": server_round,
            "phase": phase,
            "mean_client_accuracy": float(values.mean()) if len(values) else float("nan"),
            "pct_clients_over_target": float(100 * (values >= target).mean()) if len(values) else float("nan"),
            "per_cluster_accuracy": mean_by(accuracy, cluster_names),
            "per_true_cluster_accuracy": per_true,
            "per_true_cluster_accuracy_std": float(np.std(list(per_true.values()))) if per_true else float("nan"),
            "num_clusters": len({int(assignment[p]) for p in assigned}),
            **cluster_scores(self.true_clusters[assigned], assignment[assigned]),
            "mean_test_loss": float(np.mean(list(loss.values()))) if loss else float("nan"),
            "mean_train_loss": counters.train_loss,
            "num_fit_clients": counters.num_fit_clients,
            "fit_clients": list(counters.fit_clients),
            "client_accuracy": {str(pid): value for pid, value in accuracy.items()},
            "num_evaluated": len(accuracy),
            "fit_failures": counters.fit_failures,
            "rejected_updates": counters.rejected_updates,
            "eval_failures": eval_failures,
            "bytes_up": counters.bytes_up,
            "bytes_down": counters.bytes_down,
            "bytes_eval": counters.bytes_eval,
            "seconds": time.perf_counter() - counters.started if counters.started else 0.0,
        }
        if self.best_validated:
            best = {p: acc for p, (_, acc) in sorted(self.best_validated.items())}
            row["mean_best_val_accuracy"] = float(np.mean(list(best.values())))
            row["per_true_cluster_best_val_accuracy"] = mean_by(best, {p: str(int(self.true_clusters[p])) for p in best})
        return row

    def summary(self, server_round: int, strategy: str, assignment: np.ndarray) -> dict[str, Any]:
        rows = self.recorder.rows
        last = rows[-1] if rows else {}
        accuracies = [r["mean_client_accuracy"] for r in rows if r.get("mean_client_accuracy") is not None]
        reached = [
            r["round"] for r in rows
            if r.get("mean_client_accuracy") is not None and r["mean_client_accuracy"] >= self.target_accuracy
        ]
        return {
            "strategy": strategy,
            "finished": self.finished(server_round),
            "completed_rounds": server_round,
            "rounds": self.rounds,
            "mean_client_accuracy": last.get("mean_client_accuracy"),
            "best_mean_client_accuracy": max(accuracies) if accuracies else None,
            "pct_clients_over_target": last.get("pct_clients_over_target"),
            "target_accuracy": self.target_accuracy,
            "rounds_to_target": reached[0] if reached else None,
            "per_cluster_accuracy": last.get("per_cluster_accuracy"),
            "per_true_cluster_accuracy": last.get("per_true_cluster_accuracy"),
            "per_true_cluster_accuracy_std": last.get("per_true_cluster_accuracy_std"),
            "mean_best_val_accuracy": last.get("mean_best_val_accuracy"),
            "per_true_cluster_best_val_accuracy": last.get("per_true_cluster_best_val_accuracy"),
            "num_clusters": last.get("num_clusters"),
            "purity": last.get("purity"),
            "ari": last.get("ari"),
            "nmi": last.get("nmi"),
            "assignment": assignment.tolist(),
            "true_clusters": self.true_clusters.tolist(),
            "client_accuracy": {str(p): a for p, a in sorted(self.latest_accuracy.items())},
            **self.totals,
            "wall_seconds": self.wall_seconds(),
            "numeric_platform": self.numeric_platform,
        }

    def wall_seconds(self) -> float:
        return self._seconds_before + time.perf_counter() - self._started

    def state(self) -> dict[str, Any]:
        best = {str(p): list(v) for p, v in self.best_validated.items()}
        return {"totals": self.totals, "wall_seconds": self.wall_seconds(), "best_validated": best}

    def restore(self, state: Mapping[str, Any], completed_round: int) -> None:
        self.totals.update(state["totals"])
        self.best_validated = {int(p): (v[0], v[1]) for p, v in state.get("best_validated", {}).items()}
        self._seconds_before = float(state["wall_seconds"])
        self.recorder.resume(completed_round)

    def announce_results(self) -> None:
        log(INFO, "results written to %s", self.recorder.run_dir)
