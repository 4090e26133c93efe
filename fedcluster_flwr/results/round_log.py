"""The round log: a run's per-round accounting and everything it writes; the runner's observer of
a strategy (:meth:`~fedcluster_flwr.algorithms.base.ClusteredStrategy.connect`).

From each round's :class:`~fedcluster_flwr.algorithms.base.RoundReport` (the round's counters:
traffic, failures, rejected replies, training loss; every client's evaluation) it keeps the run's
totals (also per phase) and wall time, the metrics row of every round (mean, per assigned
cluster and per *true* cluster accuracy, clustering scores against the true ids, traffic), the
summary, and when checkpoints, artifacts and plots are due. Files are written through
:class:`~fedcluster_flwr.results.recorder.RunRecorder`. The strategy is only read, through its public
hooks (phase, assignment, round_metrics, summary, state_dict, artifacts); it writes nothing
and never sees this log.

A checkpoint is ``{"round", "strategy": strategy.state_dict(), "log": log.state_dict()}``, and,
where the engine lets the runner see its nodes (every simulation engine), ``"clients"``: what each
client keeps on its node (:attr:`RoundLog.client_states`); self-contained: :func:`resume` continues a
freshly built strategy and log from it, and the runner gives the clients theirs back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.common import log

from ..algorithms.base import UNASSIGNED, ClusteredStrategy
from ..algorithms.base.directory import UNKNOWN_CLUSTER
from ..algorithms.base.strategy import RoundReport
from ..clustering import cluster_scores, mean_by
from .recorder import RunRecorder


TOTALS = ("bytes_up", "bytes_down", "bytes_eval", "fit_failures", "rejected_updates")
PHASE_TOTALS = ("bytes_up", "bytes_down")  # also summed per phase (e.g. one-shot HFL's clustering rounds)


def no_better_than_majority(accuracy: Mapping[int, float], majority: Mapping[int, float]) -> list[int]:
    """The clients whose ``accuracy`` is at most ``majority`` (always answering their most common
    test label): what a collapsed model scores. A client whose test set holds one label is left
    out: there a constant answer is as right as a perfect model."""
    return [p for p, value in sorted(accuracy.items()) if majority.get(p, 1.0) < 1.0 and value <= majority[p]]


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
        software: Mapping[str, str] | None = None,
        title: str = "",
        majority_accuracy: Mapping[int, float] | None = None,
    ) -> None:
        self.recorder = recorder
        # per client, the accuracy of always answering its own most common test label: a model no
        # better than that has collapsed (or never learned), whatever the client's label mix
        self.majority_accuracy = dict(majority_accuracy or {})
        self.title = title
        self.numeric_platform = dict(numeric_platform or {})
        self.software = dict(software or {})  # the code that computed the numbers (results.provenance)
        self.stop_round = stop_round
        self.experiment_true_clusters = true_clusters
        self.true_clusters = true_clusters  # the experiment's, with what devices on their own data reported
        self.target_accuracy = target_accuracy
        self.rounds = rounds
        self.checkpoint_every = checkpoint_every
        self.totals = {key: 0 for key in TOTALS}
        self.totals_by_phase: dict[str, dict[str, int]] = {}
        self.latest_accuracy: dict[int, float] = {}
        self._started = time.perf_counter()
        self._seconds_before = 0.0  # wall time of the rounds before a resumed checkpoint
        # what each client keeps on its node, by partition id, where the engine can show it (the runner sets it)
        self.client_states: Callable[[], dict[int, dict[str, Any]]] | None = None

    def finished(self, server_round: int) -> bool:
        return server_round >= self.rounds

    def checkpoint_due(self, server_round: int) -> bool:
        every = self.checkpoint_every
        return (
            self.finished(server_round) or server_round == self.stop_round or bool(every and server_round % every == 0)
        )

    def metrics_row(
        self, report: RoundReport, phase: str, assignment: np.ndarray, connected: Sequence[int]
    ) -> dict[str, Any]:
        """The round's metrics; the report's ``accuracy`` and ``loss`` by partition id, in partition-id order."""
        server_round, accuracy, loss, eval_failures = report.server_round, report.accuracy, report.loss, report.eval_failures
        target = self.target_accuracy
        values = np.asarray(list(accuracy.values()), dtype=float)
        cluster_names = {
            pid: str(int(assignment[pid])) if assignment[pid] != UNASSIGNED else "unassigned" for pid in accuracy
        }
        assigned = [p for p in connected if assignment[p] != UNASSIGNED]
        counters = report.counters
        for key in self.totals:
            self.totals[key] += getattr(counters, key)
        by_phase = self.totals_by_phase.setdefault(phase, {key: 0 for key in PHASE_TOTALS})
        for key in PHASE_TOTALS:
            by_phase[key] += getattr(counters, key)
        self.latest_accuracy = dict(accuracy)
        true = self.true_clusters
        unknown = [p for p in connected if true[p] == UNKNOWN_CLUSTER]
        per_true = mean_by({p: a for p, a in accuracy.items() if true[p] != UNKNOWN_CLUSTER},
                           {p: str(int(true[p])) for p in accuracy})
        # A device that did not give its true cluster makes the scores against the true clusters
        # unavailable (None), never a number computed as if it had one.
        scores = cluster_scores(true[assigned], assignment[assigned]) if not unknown else dict.fromkeys(
            ("purity", "ari", "nmi"))
        row = {
            "round": server_round,
            "phase": phase,
            "mean_client_accuracy": float(values.mean()) if len(values) else float("nan"),
            "pct_clients_over_target": float(100 * (values >= target).mean()) if len(values) else float("nan"),
            "per_cluster_accuracy": mean_by(accuracy, cluster_names),
            "per_true_cluster_accuracy": per_true,
            "per_true_cluster_accuracy_std": float(np.std(list(per_true.values()))) if per_true else float("nan"),
            "num_clusters": len({int(assignment[p]) for p in assigned}),
            **scores,
            "mean_test_loss": float(np.mean(list(loss.values()))) if loss else float("nan"),
            "mean_train_loss": counters.train_loss,
            "num_fit_clients": len(counters.fit_clients),
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
        if unknown:
            row["true_cluster_unavailable"] = unknown
        return row

    def summary(self, server_round: int, strategy: str, assignment: np.ndarray) -> dict[str, Any]:
        rows = self.recorder.rows
        last = rows[-1] if rows else {}
        # Round 1 (DAC's pre-training) is the level later rounds are read against: best-validation
        # selection keeps the round-1 model as a candidate, so that reading starts there (issue #53).
        first = rows[0] if rows else {}
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
            "first_round_mean_client_accuracy": first.get("mean_client_accuracy"),
            "per_true_cluster_first_round_accuracy": first.get("per_true_cluster_accuracy"),
            "num_clusters": last.get("num_clusters"),
            "purity": last.get("purity"),
            "ari": last.get("ari"),
            "nmi": last.get("nmi"),
            "assignment": assignment.tolist(),
            "true_clusters": [None if c == UNKNOWN_CLUSTER else c for c in self.true_clusters.tolist()],
            "client_accuracy": {str(p): a for p, a in sorted(self.latest_accuracy.items())},
            "clients_no_better_than_majority": self.clients_no_better_than_majority(),
            **self.totals,
            "bytes_by_phase": self.totals_by_phase,
            "wall_seconds": self.wall_seconds(),
            "numeric_platform": self.numeric_platform,
            "software": self.software,
        }

    def clients_no_better_than_majority(self) -> list[int]:
        """:func:`no_better_than_majority` of the last evaluation, over the clients of a known label
        mix (a device on its own data has none)."""
        known = {p for p, c in enumerate(self.true_clusters) if c != UNKNOWN_CLUSTER}
        return no_better_than_majority(
            {p: a for p, a in self.latest_accuracy.items() if p in known}, self.majority_accuracy)

    def round_ended(self, strategy: ClusteredStrategy, report: RoundReport) -> None:
        """Record the round: its row, the files the algorithm returned, a checkpoint with the
        strategy's artifacts when one is due, the plots at the end, and the summary (last:
        ``finished`` means all is written)."""
        server_round = report.server_round
        self.true_clusters = strategy.directory.true_clusters(self.experiment_true_clusters)
        row = self.metrics_row(report, strategy.phase(server_round), strategy.assignment, strategy.directory.connected)
        row.update(strategy.model_selection_metrics())
        row.update(strategy.round_metrics(server_round))
        self.recorder.log_round(row)
        self.recorder.write_artifacts(report.counters.artifacts)
        if self.checkpoint_due(server_round):
            checkpoint = {"round": server_round, "strategy": strategy.state_dict(), "log": self.state_dict()}
            if self.client_states is not None:
                checkpoint["clients"] = self.client_states()
            self.recorder.save_checkpoint(checkpoint)
        if self.finished(server_round) or server_round == self.stop_round:
            # Where the run ends, not with every checkpoint: a checkpoint (every round by default)
            # costs ~5 ms on the default config, FL+HC's dendrogram ~110 ms. Files that describe a
            # new state at once (a clustering's dendrogram) come from absorb, in the round's artifacts.
            self.recorder.write_artifacts(strategy.artifacts())
        if self.finished(server_round):
            self.recorder.plot(self.target_accuracy, self.title)
            log(INFO, "results written to %s", self.recorder.run_dir)
        summary = self.summary(server_round, strategy.name, strategy.assignment) | strategy.summary_entries()
        self.recorder.write_summary(summary)

    def wall_seconds(self) -> float:
        return self._seconds_before + time.perf_counter() - self._started

    def state_dict(self) -> dict[str, Any]:
        return {
            "totals": dict(self.totals),
            "totals_by_phase": self.totals_by_phase,
            "wall_seconds": self.wall_seconds(),
        }

    def load_state_dict(self, state: Mapping[str, Any], completed_round: int) -> None:
        """Continue the totals of ``state`` after ``completed_round``; later rows are dropped."""
        self.totals.update(state["totals"])
        self.totals_by_phase = {phase: dict(totals) for phase, totals in state["totals_by_phase"].items()}
        self._seconds_before = float(state["wall_seconds"])
        self.recorder.resume(completed_round)


def resume(strategy: ClusteredStrategy, log: RoundLog, checkpoint: Mapping[str, Any]) -> None:
    """Continue ``strategy`` (freshly built from the run's config) and its ``log`` from ``checkpoint``
    (:func:`~fedcluster_flwr.results.checkpoints.load_checkpoint`): its state, the log's totals, and the
    round numbering (Flower counts the remaining rounds from 1 again; ``round_offset`` maps them)."""
    completed = int(checkpoint["round"])
    strategy.load_state_dict(checkpoint["strategy"])
    strategy.round_offset = completed
    log.load_state_dict(checkpoint["log"], completed)
