"""Helpers the benchmark scripts share: run (or reuse) one experiment, and mean ± std cells.

The scripts run as ``python benchmarks/<name>/run.py``; they put this folder on ``sys.path``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

# Flower's telemetry off for the benchmark and every run it starts, before flwr is imported: a
# benchmark sends nothing off the machine, whatever the environment says.
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

import numpy as np  # noqa: E402

from fedcluster_flwr.config.load import config_differences, config_to_dict  # noqa: E402
from fedcluster_flwr.config.sections import ExperimentConfig  # noqa: E402
from fedcluster_flwr.apps.server_app import run_in_process  # noqa: E402
from fedcluster_flwr.runner import EXECUTION_KEYS, continue_run, plan_continuation, run_experiment  # noqa: E402


def finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary of the run in ``run_dir`` if it finished, else None."""
    summary_file = run_dir / "summary.json"
    if summary_file.is_file() and (summary := json.loads(summary_file.read_text())).get("finished"):
        return summary
    return None


ENGINES = ("ray", "inprocess", "batched")  # the choices of every benchmark's --engine (README "Engines")


def run_or_reuse(config: ExperimentConfig, run_dir: Path, engine: str | None = None) -> dict[str, Any]:
    """The summary of ``config`` run into ``run_dir`` on ``engine`` (default: the config's
    ``simulation.engine``): Flower's Ray engine ("ray"), the in-process driver ("inprocess": one
    process, one torch thread, the same rounds bit for bit) or its batched form ("batched"); a run
    that finished there earlier is reused (delete the folder to run it again), and one stopped there
    (Ctrl-C, a crash, a machine taken back) continues from its checkpoint, on ``engine``, if the
    folder holds the same experiment; a folder of another experiment is an error naming both."""
    if (summary := finished_summary(run_dir)) is not None:
        return summary
    engine = engine or config.simulation.engine
    config = dataclasses.replace(config, simulation=dataclasses.replace(config.simulation, engine=engine))
    started = time.perf_counter()
    if (run_dir / "checkpoint" / "state.json").is_file():
        continuation = plan_continuation(run_dir, overrides=[f"simulation.engine={engine}"])
        check_same_experiment(continuation.config, config, run_dir)
        summary = continue_run(continuation)
    elif engine != "ray":
        run_in_process(config, run_dir)
        summary = finished_summary(run_dir)
    else:
        summary = run_experiment(config, run_dir)
    print(f"{run_dir.name}: {time.perf_counter() - started:.0f} s", flush=True)
    return summary


def check_same_experiment(stored: ExperimentConfig, wanted: ExperimentConfig, run_dir: Path) -> None:
    """Refuse to continue a stopped run whose config is not the benchmark's (a folder left from an
    earlier version of the benchmark, or another scale): its rounds would be mixed into the table.
    How the rounds execute (the keys a resume may change in place, ``runner.EXECUTION_KEYS``) may
    differ, as ``fedcluster compare`` allows when it continues a stopped comparison."""
    differing = config_differences(config_to_dict(stored), config_to_dict(wanted), EXECUTION_KEYS)
    if differing:
        raise SystemExit(f"{run_dir}: a stopped run of another experiment (its config.yaml differs in "
                         f"{', '.join(key for key, _, _ in differing)}); delete the folder or give another --out")


def value_at(rows: list[dict[str, Any]], key: str, round_number: int) -> Any:
    """``key`` of the ``rounds.jsonl`` row of ``round_number`` (None if there is no such row)."""
    return next((r.get(key) for r in rows if r["round"] == round_number), None)


def mean_std(values: list[float | None], digits: int = 3, ddof: int = 0) -> str:
    """``mean ± std`` over the values present, with ``(k/n)`` when only k of n have one. ``ddof`` 0 is the
    population std, what every page written before issue #53 printed (the scripts that still pass it keep
    their committed pages' meaning); 1 is the sample std, as a paper reports the spread of its seeds."""
    present = [v for v in values if v is not None]
    if not present:
        return f"– (0/{len(values)})"
    if len(present) == 1 and ddof:  # no sample spread from one value
        return f"{present[0]:.{digits}f}" + ("" if len(values) == 1 else f" (1/{len(values)})")
    text = f"{np.mean(present):.{digits}f} ± {np.std(present, ddof=ddof):.{digits}f}"
    return text if len(present) == len(values) else f"{text} ({len(present)}/{len(values)})"
