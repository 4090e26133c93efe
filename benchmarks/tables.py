"""Paper tables as resumable sets of runs: each run is (setting, method, seed) in a folder of its own.

A table command calls :func:`advance` with its runs in the order they should happen. Each run is
in one of three states, read from its folder:

- **finished** (``summary.json`` says ``finished``): skipped; its small files are copied into the
  table's committed results folder (``benchmarks/<paper>/results/full/<run>/``) if not there yet;
- **kept** (no finished run folder, but the results folder holds a finished copy of the run: the
  machine that ran it is gone): skipped, never run again nor overwritten, so long as the copy was
  made with the run's config (``simulation``, where it ran, aside; a copy of more rounds holds the
  rounds asked for, one of fewer is run again, longer); a copy made with another config stops the
  command with the keys that differ. (A caller that needs the run folder itself, as a
  sweep's probe does, passes ``reuse_kept=False``.)
- **checkpointed** (a ``checkpoint/`` from an earlier, stopped attempt): resumed from its checkpoint,
  on the engine asked for now (the engine is how rounds execute, not what they compute);
- **new** (no folder, or a folder stopped before its first checkpoint, which is set aside as
  ``<run>.incomplete-<n>``): started, from scratch or, for a run with a :class:`Branch`, from the
  checkpoint of another run (a threshold sweep's shared rounds) with the branch's options changed.

One more state is only seen, never acted on: **in use**, a run another process is running or
starting (its folder held, or claimed by a live process and not yet checkpointed:
:func:`fedcluster_flwr.results.recorder.in_use_elsewhere`): skipped, left to it. So several table
commands can share one queue, each taking the next run nobody runs (a machine with more cores than
one command's workers use; a run is never set aside, resumed or recorded by two of them); a race
for the same run between the check and the start is lost by one of them, which skips the run.

Ctrl-C or SIGTERM stops the run in progress at its last checkpoint (every round by default) and
the command with exit code 130/143; running the same command again continues. The run folders
live outside the work tree by default (``$FEDCLUSTER_TABLES_DIR``, else ``~/fedcluster-tables``):
they hold checkpoints of every model. The table page is written from whatever runs have finished,
with ``render`` (each table's own), after each finished run and at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower's telemetry off here and in every run started: nothing leaves the machine

from fedcluster_flwr.results.checkpoints import checkpoint_round
from fedcluster_flwr.config.load import (
    apply_overrides, build_config, config_differences, config_to_dict, left_with_engine, load_config, parse_override,
)
from fedcluster_flwr.config.sections import ExperimentConfig
from fedcluster_flwr.runner import Interrupted, continue_run, plan_continuation, run_experiment
from fedcluster_flwr.numerics import cpu_identity
from fedcluster_flwr.results.files import atomic_write, written_aside
from fedcluster_flwr.results.provenance import code_version
from fedcluster_flwr.results.recorder import RunFolderTaken, in_use_elsewhere
from fedcluster_flwr.results.run_files import DamagedRunError, read_summary
from fedcluster_flwr.declarations.schema import ConfigError

IN_USE = "in use"  # a run another process (another table command) is running or starting: left to it

# What the repository keeps of a run (branch.json: the run a branch continued, and what it changed).
SMALL_FILES = ("summary.json", "rounds.jsonl", "config.yaml", "machine.json", "branch.json")


def default_runs_root() -> Path:
    """Where the table commands keep their run folders unless told: outside any work tree."""
    return Path(os.environ.get("FEDCLUSTER_TABLES_DIR") or Path.home() / "fedcluster-tables")


@dataclass(frozen=True)
class Branch:
    """A run that starts from another run's checkpoint (``source``: its folder) with ``overrides``
    (``KEY=VALUE``) applied, as ``fedcluster resume SOURCE --out RUN --set ...`` would."""

    source: Path
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class TableRun:
    """One run of a table: its folder name (unique within the table), its resolved config, and
    for a branch where it starts from."""

    name: str
    config: ExperimentConfig
    labels: dict[str, Any] = dataclasses.field(default_factory=dict)  # setting, method, seed: for the page
    branch: Branch | None = None


def run_state(run_dir: Path) -> str:
    """``finished``, ``checkpointed`` or ``new`` (see the module docstring)."""
    try:
        if read_summary(run_dir).get("finished") is True:
            return "finished"
    except (DamagedRunError, FileNotFoundError, OSError):
        pass
    if checkpoint_round(run_dir) is not None:
        return "checkpointed"
    return "new"


class StaleCopyError(RuntimeError):
    """The results folder holds a finished copy of a run made with another config."""


def kept_copy(run: TableRun, results_dir: Path) -> Path | None:
    """``results_dir/<run>`` if it holds a finished copy of ``run`` (see the module docstring)."""
    copy = results_dir / run.name
    try:
        if read_summary(copy).get("finished") is not True:
            return None
    except (DamagedRunError, FileNotFoundError, OSError):
        return None
    try:
        made_with, _ = load_config(copy / "config.yaml", [])
    except ConfigError as err:  # e.g. made by a version of the project with keys it no longer has
        raise StaleCopyError(f"{copy}/config.yaml no longer loads ({err}): move it aside to run it again") from None
    differ = config_differences(config_to_dict(made_with), config_to_dict(run.config), ("simulation",))
    if [key for key, _, _ in differ] == ["rounds"]:  # a longer copy holds the rounds asked for; a shorter one is run again
        return copy if differ[0][1] > differ[0][2] else None
    if differ:
        shown = "; ".join(f"{key}: {there!r} there, {now!r} now" for key, there, now in differ[:5])
        raise StaleCopyError(
            f"{copy} holds a finished {run.name} made with another config ({shown}"
            f"{f'; {len(differ) - 5} more' if len(differ) > 5 else ''}): move it aside to run it again, "
            "or give another --results-dir"
        )
    return copy


def listed_state(run: TableRun, runs_root: Path, results_dir: Path) -> str:
    """A run's state as ``--list`` shows it: :func:`run_state`, ``in use`` (another process runs it)
    or ``kept`` (:func:`kept_copy`)."""
    state = run_state(runs_root / run.name)
    if state != "finished" and in_use_elsewhere(runs_root / run.name) is not None:
        return IN_USE
    return "kept" if state != "finished" and kept_copy(run, results_dir) else state


def machine_description(engine: str) -> dict[str, Any]:
    """What ran a stretch of a run: engine, host, processor, CPU model and core count, torch and its
    device, and the code (``results.provenance.code_version``: a run resumed after a pull names both)."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "engine": engine,
        "code": code_version(),
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_identity()[1],
        "cpu_count": os.cpu_count(),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def set_aside(run_dir: Path) -> Path:
    """Move a folder that stopped before its first checkpoint out of the way (never deleted)."""
    for n in range(1, 1000):
        target = run_dir.with_name(f"{run_dir.name}.incomplete-{n}")
        if not target.exists():
            run_dir.rename(target)
            return target
    raise RuntimeError(f"too many incomplete attempts beside {run_dir}")


def execution_overrides(engine: str, workers: int | None) -> list[str]:
    """The ``--set`` items that move a run onto ``engine`` (a continuation drops the settings only
    another engine takes by itself: :func:`fedcluster_flwr.config.load.left_with_engine`)."""
    return [f"simulation.engine={engine}"] + ([f"simulation.batched_workers={workers}"] if engine == "batched" and workers else [])


def with_engine(config: ExperimentConfig, engine: str, workers: int | None) -> ExperimentConfig:
    """``config`` on ``engine``, by :func:`execution_overrides`, less the settings only another
    engine takes (checked as any override is)."""
    items = [parse_override(item) for item in execution_overrides(engine, workers)]
    left, _ = left_with_engine(config.simulation, items)
    return build_config(apply_overrides(config_to_dict(config), items + left))[0]


def recorded_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """The attempts ``machine.json`` records for a run, oldest first (none: ``[]``)."""
    path = run_dir / "machine.json"
    return json.loads(path.read_text())["attempts"] if path.is_file() else []


def engine_label(attempt: Mapping[str, Any]) -> str:
    """How a page names where an attempt ran: its engine, and its device where that is not the CPU."""
    return attempt["engine"] + ("" if attempt["device"] == "cpu" else f" ({attempt['device']})")


def collapsed_clients(copy: Path) -> list[int]:
    """A finished run's clients no better than always answering their most common test label
    (``summary.json``'s ``clients_no_better_than_majority``; for a copy made before the summary had
    it, worked out from its config's partition and last accuracies, by the same rule)."""
    summary = read_summary(copy)
    if "clients_no_better_than_majority" in summary:
        return summary["clients_no_better_than_majority"]
    from fedcluster_flwr.experiment import Experiment
    from fedcluster_flwr.results.round_log import no_better_than_majority

    experiment = Experiment(load_config(copy / "config.yaml", [])[0])
    accuracy = {int(pid): value for pid, value in summary["client_accuracy"].items()}
    return no_better_than_majority(accuracy, experiment.majority_accuracy())


def record_attempt(run_dir: Path, engine: str, seconds: float, resumed_from: int) -> None:
    """Append this attempt to ``machine.json`` (a run resumed elsewhere has several)."""
    attempts = recorded_attempts(run_dir)
    attempts.append(machine_description(engine) | {"seconds": round(seconds, 1), "resumed_from_round": resumed_from})
    atomic_write(run_dir / "machine.json", json.dumps({"attempts": attempts}, indent=1) + "\n")


def keep_small_files(run_dir: Path, results_dir: Path) -> Path:
    """Copy a finished run's small files into ``results_dir/<run>/`` (the repository's copy), each
    whole at once: another table command may be reading them for its page meanwhile."""
    target = results_dir / run_dir.name
    target.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (run_dir / name).is_file():
            with (run_dir / name).open("rb") as source, written_aside(target / name, "wb") as copy:
                shutil.copyfileobj(source, copy)
            shutil.copystat(run_dir / name, target / name)
    return target


def advance(
    runs: Sequence[TableRun],
    *,
    runs_root: Path,
    results_dir: Path,
    engine: str,
    workers: int | None = None,
    render: Callable[[], None] | None = None,
    only: Iterable[str] | None = None,
    max_runs: int | None = None,
    reuse_kept: bool = True,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, str]:
    """Run, resume or skip each of ``runs`` in order (see the module docstring); return each run's
    state afterwards (``in use``: another process was running or starting it). ``max_runs`` stops
    after that many runs were started or resumed (a stretch of work); ``only`` restricts to those
    names; ``reuse_kept`` skips a run whose finished copy is in ``results_dir`` though its folder is
    gone. Raises :class:`Interrupted` on a stop signal, after
    the page is written from what finished."""
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"run names repeat: {sorted(n for n in names if names.count(n) > 1)}")
    wanted = set(only) if only is not None else None
    runs_root.mkdir(parents=True, exist_ok=True)
    states: dict[str, str] = {}
    worked = 0
    kept = {run.name for run in runs
            if reuse_kept and run_state(runs_root / run.name) != "finished" and kept_copy(run, results_dir)}
    try:
        for run in runs:
            run_dir = runs_root / run.name
            state = run_state(run_dir)
            if run.name in kept:
                log(f"{run.name}: kept (finished in {results_dir / run.name}; its run folder is gone)")
                states[run.name] = "kept"
                continue
            if state == "finished" or (wanted is not None and run.name not in wanted) or (
                max_runs is not None and worked >= max_runs
            ):
                if state == "finished":
                    keep_small_files(run_dir, results_dir)
                states[run.name] = state
                continue
            if (why := in_use_elsewhere(run_dir)) is not None:
                log(f"{run.name}: in use, skipped ({why})")
                states[run.name] = IN_USE
                continue
            worked += 1
            started = time.perf_counter()
            execution = execution_overrides(engine, workers)
            ran = True  # False: another process took the run between the check above and this one's start
            if state == "checkpointed":
                done = checkpoint_round(run_dir) or 0
                log(f"{run.name}: resuming from round {done} on {engine}")
                try:
                    continue_run(plan_continuation(run_dir, overrides=execution))
                except RunFolderTaken as taken:
                    ran = False
                    log(f"{run.name}: in use, skipped ({taken.reason})")
                finally:
                    if ran:
                        record_attempt(run_dir, engine, time.perf_counter() - started, done)
            else:
                existed = run_dir.exists()
                if existed:
                    log(f"{run.name}: set aside {set_aside(run_dir).name} (stopped before its first checkpoint)")
                branch = run.branch
                done = (checkpoint_round(branch.source) or 0) if branch else 0
                log(f"{run.name}: {f'branching {branch.source.name} at round {done}' if branch else 'starting'} on {engine}")
                try:
                    if branch is None:
                        run_experiment(with_engine(run.config, engine, workers), run_dir)
                    else:
                        continue_run(plan_continuation(branch.source, out=run_dir, overrides=[*branch.overrides, *execution]))
                except RunFolderTaken as taken:
                    if existed or not run_dir.is_dir():
                        raise  # not a race: the folder was there before this start, or never made
                    ran = False  # another table command claimed the new folder first: its run
                    log(f"{run.name}: in use, skipped ({taken.reason})")
                finally:
                    if ran and run_dir.is_dir():
                        record_attempt(run_dir, engine, time.perf_counter() - started, done)
            if not ran:
                worked -= 1  # not this command's work
                states[run.name] = IN_USE
                continue
            states[run.name] = run_state(run_dir)
            log(f"{run.name}: {states[run.name]} ({time.perf_counter() - started:.0f} s)")
            if states[run.name] == "finished":
                keep_small_files(run_dir, results_dir)
                if render is not None:
                    render()
    finally:
        if render is not None:
            render()
    return states


def add_table_arguments(parser: Any, default_engine: str = "batched") -> None:
    """The flags every table command shares."""
    parser.add_argument("--engine", choices=("ray", "inprocess", "batched"), default=default_engine)
    parser.add_argument("--workers", type=int, default=1,
                        help="batched engine worker threads (1 leaves a core free on a 2-core machine; "
                             "0 = one per core)")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where run folders (with checkpoints) live; default $FEDCLUSTER_TABLES_DIR or "
                             "~/fedcluster-tables/<table>")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where finished runs' small files and the page go (default: the table's "
                             "results/full/ in the repository)")
    parser.add_argument("--only", default=None, help="comma-separated run names to advance (others are skipped)")
    parser.add_argument("--max-runs", type=int, default=None, help="stop after starting or resuming this many runs")
    parser.add_argument("--list", action="store_true", help="print every run and its state, and stop")
    parser.add_argument("--render", action="store_true", help="only rewrite the page from the finished runs")


def main_loop(runs: Sequence[TableRun], args: Any, table: str, default_results: Path,
              render: Callable[[Path], None]) -> int:
    """The body of a table command: list, render, or advance; exit code as the shell expects."""
    runs_root = args.runs_dir or default_runs_root() / table
    results_dir = args.results_dir or default_results
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        render(results_dir)
        return 0
    try:
        if args.list:
            for run in runs:
                print(f"{listed_state(run, runs_root, results_dir):12s} {run.name}")
            return 0
        states = advance(
            runs, runs_root=runs_root, results_dir=results_dir, engine=args.engine,
            workers=args.workers or None, render=lambda: render(results_dir),
            only=args.only.split(",") if args.only else None, max_runs=args.max_runs,
        )
    except Interrupted as stop:
        print(f"stopped: {stop}; run the same command again to continue", file=sys.stderr)
        return stop.exit_code
    except StaleCopyError as stale:
        print(f"error: {stale}", file=sys.stderr)
        return 2
    for run in runs:  # a run skipped as in use may have finished in the other process since
        if states.get(run.name) == IN_USE:
            states[run.name] = listed_state(run, runs_root, results_dir)
    done = sum(state in ("finished", "kept") for state in states.values())
    elsewhere = sum(state == IN_USE for state in states.values())
    print(f"{done} of {len(runs)} runs finished{f', {elsewhere} running in another process' if elsewhere else ''}; "
          f"runs in {runs_root}, page in {results_dir}")
    return 0
