"""Experiment tracking (``tracking: tensorboard | mlflow | none``): each round's numeric results and
the final summary, sent to TensorBoard or MLflow as :class:`~fedcluster_flwr.results.recorder.RunRecorder`
records them, so every engine and ``flwr run`` track alike; strategies know nothing of it.

What is logged: every numeric field of a ``rounds.jsonl`` row at step = the round (nested ones by
path: ``per_cluster_accuracy/0``, ``client_accuracy/7``; null values are left out), and at the end
the summary's numeric fields as ``summary/<field>`` at step = the last round.

One run of the tracker per run directory: ``tracking.json`` in the run directory holds its id, and a
resume reopens it (TensorBoard: the same ``tensorboard/`` folder, the rounds after the checkpoint
purged; MLflow: the same run). A branch (``resume --out``) starts a new one linked to its source's
(MLflow tags ``fedcluster.branch_of_run_id`` / ``fedcluster.branch_round``; TensorBoard text
``fedcluster/branch_of``).

A tracker that fails mid-run (a full disk, an unreachable MLflow server) is dropped with one
warning: the run and its files go on. A missing package is a :class:`ConfigError` naming the key
and the extra to install, raised before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import uuid
from collections.abc import Mapping
from logging import WARNING
from pathlib import Path
from typing import Any

from .files import atomic_write
from ..declarations.schema import ConfigError

TRACKING_FILE = "tracking.json"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_EXPERIMENT = "fedcluster"  # unless $MLFLOW_EXPERIMENT_NAME names another
# tracking value -> the module it needs (the pip extra has the value's name)
NEEDS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}


def check_tracking(name: str) -> None:
    """Raise a one-line :class:`ConfigError` when the package ``tracking: name`` needs is missing."""
    module = NEEDS.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ConfigError(
            "tracking",
            f"is '{name}' but the {module} package is not installed: pip install 'fedcluster-flwr[{name}]' "
            "(or set tracking: none)",
        )


def numeric_fields(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a row or summary, nested ones by path (``per_cluster_accuracy/0``); booleans,
    strings, lists and nulls are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numeric_fields(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _warn(message: str) -> None:
    from flwr.common import log

    log(WARNING, "fedcluster tracking: %s", message)


class _TensorBoard:
    def __init__(self, run_dir: Path, record: dict[str, Any], completed_round: int, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides what an earlier writer logged from that step on (rounds redone on resume).
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=completed_round + 1 if completed_round else None)
        self.run_id = record.get("run_id") or uuid.uuid4().hex
        if not record.get("run_id"):
            import yaml

            self.writer.add_text("fedcluster/run_id", self.run_id, 0)
            self.writer.add_text("fedcluster/config", "    " + yaml.safe_dump(dict(config), sort_keys=False).replace("\n", "\n    "), 0)
            if record.get("branch_of_run_id"):
                self.writer.add_text("fedcluster/branch_of", f"{record['branch_of_run_id']} (round {record['branch_round']})", 0)
            self.writer.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: Path, record: dict[str, Any], completed_round: int, config: Mapping[str, Any]):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if record.get("run_id"):
            self.run_id = record["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or MLFLOW_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        tags = {"fedcluster.run_dir": str(run_dir)}
        if record.get("branch_of_run_id"):
            tags |= {"fedcluster.branch_of_run_id": record["branch_of_run_id"], "fedcluster.branch_round": str(record["branch_round"])}
        run = self.client.create_run(experiment_id, run_name=run_dir.name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in _flat_config(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        entries = [Metric(key, value, stamp, step) for key, value in metrics.items()]
        for start in range(0, len(entries), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=entries[start:start + 1000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


BACKENDS = {"tensorboard": _TensorBoard, "mlflow": _MLflow}


def _flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Tracker:
    """The run's tracker behind a guard: the first failure is warned about once and ends tracking."""

    def __init__(self, name: str, backend: Any):
        self.name = name
        self.backend = backend

    def _guarded(self, action: str, call: Any) -> None:
        if self.backend is None:
            return
        try:
            call()
        except Exception as err:  # noqa: BLE001 - tracking must never end a run
            self.backend = None
            _warn(f"{self.name} failed while {action} ({type(err).__name__}: {' '.join(str(err).split())[:300]}); "
                  "the run goes on untracked, its results files are complete")

    def log_round(self, row: Mapping[str, Any]) -> None:
        self._guarded(f"logging round {row.get('round')}",
                      lambda: self.backend.log(numeric_fields({k: v for k, v in row.items() if k != "round"}), int(row["round"])))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The final summary (only once ``finished``: it is rewritten every round), then close."""
        if not summary.get("finished") or self.backend is None:
            return
        step = int(summary.get("completed_rounds") or 0)
        self._guarded("logging the summary", lambda: self.backend.log(numeric_fields(summary, "summary/"), step))
        self._guarded("closing the run", lambda: self.backend.finish())
        self.backend = None


def open_tracker(run_dir: Path, config: Mapping[str, Any], completed_round: int) -> Tracker | None:
    """The tracker ``config["tracking"]`` names for the run in ``run_dir`` (None for none, or when it
    cannot open): the run ``tracking.json`` records, else a new one (a branch's linked to its
    source's), recorded there. A missing package raises :class:`ConfigError`; any other failure to
    open is warned about and the run goes untracked."""
    name = str(config.get("tracking") or "none")
    if name == "none":
        return None
    check_tracking(name)
    run_dir = Path(run_dir)
    record = _continued_record(run_dir, name)
    try:
        backend = BACKENDS[name](run_dir, record, completed_round, config)
    except Exception as err:  # noqa: BLE001 - tracking must never stop a run
        _warn(f"{name} could not open a run ({type(err).__name__}: {' '.join(str(err).split())[:300]}); the run goes on untracked")
        return None
    tracker = Tracker(name, backend)
    if record.get("run_id") != backend.run_id or record.get("run_dir") != str(run_dir.resolve()):
        saved = {"backend": name, "run_id": backend.run_id, "run_dir": str(run_dir.resolve())}
        saved |= {k: record[k] for k in ("branch_of_run_id", "branch_round") if k in record}
        if name == "tensorboard":
            saved["log_dir"] = TENSORBOARD_DIR
        elif name == "mlflow":
            from mlflow import get_tracking_uri

            saved["tracking_uri"] = get_tracking_uri()
        atomic_write(run_dir / TRACKING_FILE, json.dumps(saved, indent=2) + "\n")
    return tracker


def branch_record(source_dir: Path, completed_round: int) -> dict[str, Any] | None:
    """The ``tracking.json`` a branch of ``source_dir`` starts with: a link to the source's tracker
    run, from which the branch's first open starts a run of its own (None: the source had none)."""
    record = _read_record(Path(source_dir))
    if not record.get("run_id"):
        return None
    return {"backend": record.get("backend"), "branch_of_run_id": record["run_id"], "branch_round": completed_round}


def _continued_record(run_dir: Path, name: str) -> dict[str, Any]:
    """What to open: ``tracking.json``'s run (this directory's, wherever it has moved since), or
    the link a branch starts with; nothing (a new run) for another backend or no record."""
    record = _read_record(run_dir)
    if record.get("backend") != name or not (record.get("run_id") or record.get("branch_of_run_id")):
        return {}
    return record


def _read_record(run_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((run_dir / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
