"""Run experiments, each in a process group of its own (:mod:`fedcluster_flwr.run_process`: the
ServerApp on Flower's Ray simulation or on this project's in-process grids, as ``simulation.engine``
says): fresh runs, resumes, branches.

The life of a run directory:

- A fresh run (:func:`run_experiment`) starts in a new or empty directory and writes its resolved
  ``config.yaml``, a ``rounds.jsonl`` row per round, checkpoints (``checkpoint/``, every
  ``checkpoint_every`` rounds, by default every round, and at the end) and ``summary.json``.
- A stop signal (Ctrl-C, SIGTERM, SIGHUP) ends the simulation and every process it started at once
  and raises :class:`Interrupted`, whose message says where the results are and how to resume.
- With ``stop_after=N`` it ends after round N, before ``config.rounds``, checkpointed there: a
  prefix to resume or branch from later, e.g. the rounds every branch of a threshold sweep shares.
- A resume continues the run in its own directory from its checkpoint, to its configured rounds
  or, given ``rounds``, further (its ``config.yaml`` then records the new count).
- A branch copies the run at its checkpoint into a new directory (``branch.json`` says from where)
  and continues the copy, optionally with changed options; the source stays as it ran. A branch
  may change how the run goes on, never what produced the checkpoint: ``dataset``, ``partition``,
  ``model``, ``client``, ``seed`` and ``strategy.name`` are fixed, and so is every strategy option
  the run has already acted on (its strategy's ``options_fixed_by``, e.g. FL+HC's clustering
  options once it has clustered).

Resumes and branches are checked first (:func:`plan_continuation`, no side effects), then run
(:func:`continue_run`). User mistakes raise :class:`ConfigError` naming the key or flag before
Ray starts; a simulation that ends early raises :class:`RunFailed`. Nothing here prints: a caller
watches a run through a :class:`RunProgress` (the CLI's shows a progress bar), which the run's
process feeds round by round.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from .results.checkpoints import check_resumable, check_strategy_names, checkpoint_array_shape, checkpoint_round
from .config.load import config_differences, config_to_dict, left_with_engine, load_config, parse_override, tree_at
from .declarations.roles import EXECUTION, FIXED_ON_BRANCH, keys_with
from .config.sections import ExperimentConfig
from .run_process import OUTPUT, USER, Job, check_ray_address, encode_job
from .results.files import atomic_write, unwritable
from .results.recorder import RunFolderTaken, branch_run, check_run_dir_free, claim_run_dir, holding, release_unused_claim
from .results.run_files import DamagedRunError, RoundRow, read_rounds, read_summary, run_folder_entries
from .results.run_outcome import stop_message, what_was_kept
from .declarations.schema import ConfigError, require
from .results.tracking import check_tracking


class RunFailed(RuntimeError):
    """The simulation ended without finishing all rounds."""


class RunProgress(Protocol):
    """What a caller sees of a run while it runs."""

    def start(self, config: ExperimentConfig, run_dir: Path, completed_round: int, last_round: int) -> None:
        """The run passed its preflight; rounds ``completed_round + 1 .. last_round`` follow."""

    def round_done(self, row: RoundRow) -> None:
        """A round ended; ``row`` is what ``rounds.jsonl`` records of it."""

    def close(self) -> None:
        """The simulation ended, finished or not."""


def run_experiment(
    config: ExperimentConfig,
    run_dir: Path,
    *,
    progress: RunProgress | None = None,
    verbose: bool = False,
    resume_from: int = 0,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Run one experiment in a process of its own, on the engine its config names (see
    :mod:`fedcluster_flwr.run_process`); return its summary.

    ``resume_from`` > 0 continues the run in ``run_dir`` from its checkpoint at that round;
    ``stop_after`` stops it, checkpointed, after that round (before ``config.rounds``);
    ``verbose`` lets Flower's and Ray's logs through. SIGINT, SIGTERM or SIGHUP while it runs
    end the simulation and every process it started, and raise :class:`Interrupted`.
    """
    if stop_after is not None:
        require(
            resume_from < stop_after < config.rounds,
            "--stop-after",
            f"must lie after round {resume_from} and before the last round ({config.rounds}), got {stop_after}",
        )
    preflight(config, run_dir, resuming=resume_from > 0)
    last_round = config.rounds if stop_after is None else stop_after
    with holding(run_dir):
        if progress is not None:
            progress.start(config, run_dir, resume_from, last_round)
        try:
            _run_in_own_process(Job(config, run_dir, resume_from, stop_after, verbose), progress)
        finally:
            if progress is not None:
                progress.close()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    done = summary["completed_rounds"] if summary else 0
    if done != last_round:
        raise RunFailed(
            f"the run stopped after {done} of {last_round} rounds; {what_was_kept(run_dir)} "
            f"(rerun with --verbose for Flower's and Ray's logs)"
        )
    return summary


class Interrupted(Exception):
    """The run was stopped by a signal; its simulation and every process it started have ended."""

    def __init__(self, signum: int, run_dir: Path) -> None:
        self.signum = signum
        self.run_dir = run_dir
        super().__init__(stop_message(signal.Signals(signum).name, run_dir))

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop(BaseException):
    """Raised in the supervisor by the first stop signal (a BaseException: nothing may swallow it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


def _run_in_own_process(job: Job, progress: RunProgress | None) -> None:
    """Start the run's process in its own session, pass on its rounds to ``progress`` and re-raise
    its user-facing errors; on a stop signal (or any error here) end its whole process group.
    Why a separate process group and SIGKILL: see :mod:`fedcluster_flwr.run_process`."""
    events_read, events_write = os.pipe()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)  # the run's process imports this very code
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    stopped: list[int] = []
    armed = [True]  # raise at the first stop signal; during the cleanup only note it

    def on_signal(signum: int, frame: object) -> None:
        stopped.append(signum)
        if armed[0]:
            armed[0] = False  # a second Ctrl-C must not interrupt the cleanup of the first
            raise _Stop(signum)

    handlers = _install(on_signal)
    child = None
    error: dict[str, Any] | None = None
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "fedcluster_flwr.run_process", str(events_write)],
            stdin=subprocess.PIPE, pass_fds=(events_write,), start_new_session=True, env=env,
        )
        os.close(events_write)
        events_write = -1
        child.stdin.write(encode_job(job))
        child.stdin.flush()  # stdin stays open: it is the child's lifeline
        with os.fdopen(events_read, "r", closefd=False) as events:
            for line in events:  # ends when the child (the only writer) exits
                event = json.loads(line)
                if "round" in event and progress is not None:
                    progress.round_done(event["round"])
                error = event if "error" in event else error
    except _Stop:
        pass  # the group is ended below; Interrupted is raised after the cleanup
    finally:
        armed[0] = False
        _end_group(child)
        _restore(handlers)
        if events_write >= 0:
            os.close(events_write)
        os.close(events_read)
    if stopped:
        release_unused_claim(job.run_dir)  # stopped while starting: "start it again with the same command" works
        raise Interrupted(stopped[0], job.run_dir)
    if error is not None:
        raise run_process_error(error, job.run_dir)


def run_process_error(event: dict[str, Any], run_dir: Path) -> Exception:
    """The one-line error for the run process's error event (:func:`.run_process.error_event`)."""
    if event["kind"] == USER:
        return ConfigError("", event["error"])
    if event["kind"] == OUTPUT:
        return RunFailed(f"the results could not be written in {run_dir} ({event['error']}); {what_was_kept(run_dir)}")
    return RunFailed(f"the simulation failed: {event['error']} (its traceback is above); {what_was_kept(run_dir)}")


def _end_group(child: subprocess.Popen | None) -> None:
    """SIGKILL the run process's group (the run's process, Ray and everything Ray started) and reap
    the process. The group is killed before it is reaped: while it is not reaped its pid, which is
    the group's id, cannot be reused by an unrelated process."""
    if child is None:
        return
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()
    if child.stdin is not None:
        child.stdin.close()


def _install(handler: Any) -> dict[int, Any]:
    """Install ``handler`` for the stop signals (only the main thread may; elsewhere none is)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def _restore(handlers: dict[int, Any]) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def preflight(config: ExperimentConfig, run_dir: Path, resuming: bool = False) -> None:
    """Catch user mistakes before Ray starts: data, partition, GPU, a used results directory, a Ray
    cluster that does not answer; then claim a fresh run's directory (recorder.claim_run_dir)."""
    from .experiment import Experiment
    from .numerics import configure_driver_torch

    if not resuming:
        check_run_dir_free(run_dir, "--out")  # what is there, before the data are loaded
    if (problem := unwritable(run_dir)) is not None:  # before the data are read and anything is created
        raise ConfigError("--out", f"{run_dir} cannot hold the results: {problem}; give another directory")
    check_tracking(config.tracking)  # a missing tracker package: one line, before anything starts
    configure_driver_torch(config)  # before this process's first torch operation; Ray workers inherit the pins
    Experiment(config).data()  # loaded here, so that a data mistake is one line before Ray starts
    check_ray_address(config)
    if not resuming:  # last: a mistake found above leaves no folder behind; a race on --out is lost here
        claim_run_dir(run_dir, "--out")


def no_checkpoint_error(run_dir: Path) -> ConfigError:
    """Why ``run_dir``, a run directory without a checkpoint, cannot be resumed, and what to do
    instead: either it stopped before its first checkpoint, or rounds.jsonl records rounds that
    were checkpointed and the checkpoint has since been deleted or moved."""
    try:
        every = yaml.safe_load((run_dir / "config.yaml").read_text()).get("checkpoint_every")
    except (yaml.YAMLError, AttributeError):
        every = None
    when = "only at the end" if every == 0 else f"every {every} round(s)" if isinstance(every, int) else "as configured"
    restart = f"fedcluster run {run_dir / 'config.yaml'} --out NEW_DIR"
    logged = _logged_rounds(run_dir)
    if _checkpointed(every, logged, run_dir):
        missing = run_dir / "checkpoint"
        missing = missing / "state.json" if missing.is_dir() else missing
        return DamagedRunError(
            missing, f"is missing, although rounds.jsonl records rounds 1-{max(logged)} and the run checkpoints {when}: "
            f"it was deleted or moved; put it back to resume, or start again with: {restart}"
        )
    return ConfigError(
        "RUN_DIR",
        f"{run_dir} has no checkpoint/ to resume from: it stopped before its first checkpoint (it checkpoints "
        f"{when}, see checkpoint_every in its config.yaml); start it again with: {restart}",
    )


def _logged_rounds(run_dir: Path) -> list[int]:
    """The rounds ``rounds.jsonl`` records; none where it is missing or damaged (the missing
    checkpoint is the error to report then, not the log)."""
    try:
        return [row["round"] for row in read_rounds(run_dir)]
    except DamagedRunError:
        return []


def _checkpointed(every: Any, logged: Sequence[int], run_dir: Path) -> bool:
    """Whether a run that checkpoints ``every`` rounds and logged ``logged`` must have written a
    checkpoint: a round at a multiple of ``every`` was logged, or (``every`` 0) the run finished."""
    if isinstance(every, bool) or not isinstance(every, int) or not logged:
        return False
    if every > 0:
        return max(logged) >= every
    try:
        return read_summary(run_dir).get("finished") is True
    except DamagedRunError:
        return False


# Keys a resume may change in place: how a round's clients execute (a checkpoint moves between
# engines and machines) and where metrics are also sent, not what the rounds compute; declared with
# roles=(EXECUTION,) where each option is (fedcluster_flwr.declarations.roles).
EXECUTION_KEYS = keys_with(ExperimentConfig, EXECUTION)


@dataclass(frozen=True)
class Continuation:
    """A checked resume or branch of a run, ready for :func:`continue_run`."""

    source: Path  # the run whose checkpoint it continues
    is_branch: bool  # given ``out``: it continues a copy of ``source`` (a resume continues ``source``)
    run_dir: Path  # where it runs: ``source`` for a resume, ``out`` for a branch
    config: ExperimentConfig  # the source's, with the overrides and the new round count applied
    completed_round: int  # the checkpoint's
    overrides: tuple[str, ...]  # as given (KEY=VALUE), recorded in a branch's branch.json
    notes: tuple[str, ...]  # the config's notes on ignored keys, for the caller to show
    extended: bool  # given a round count or an engine: a resume rewrites its config.yaml with it


def plan_continuation(
    run_dir: Path, *, out: Path | None = None, overrides: Sequence[str] = (), rounds: int | None = None
) -> Continuation:
    """Check a resume of ``run_dir`` from its checkpoint (to ``rounds`` if given) or, with ``out``,
    a branch of it there with ``overrides`` (``KEY=VALUE``) applied; changes nothing on disk."""
    run_dir = run_dir.resolve()
    if run_dir.is_dir():  # before anything of it is read: a link out of it, a loop, a FIFO (else check_resumable says)
        run_folder_entries(run_dir)
    if (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoint" / "state.json").is_file():
        raise no_checkpoint_error(run_dir)
    state = check_resumable(run_dir)
    done = state["round"]
    parsed = [parse_override(item) for item in overrides]
    require(
        out is not None or all(key in EXECUTION_KEYS for key, _ in parsed),
        "--set",
        "changed options need --out NEW_DIR: RUN_DIR keeps the run as it ran and the changed continuation is a branch "
        f"of it (only {', '.join(EXECUTION_KEYS)}, which change how the rounds execute or are logged, not what they compute, "
        "may change in place)",
    )
    require(rounds is None or rounds >= 1, "--rounds", f"must be >= 1, got {rounds}")
    before, _ = load_config(run_dir / "config.yaml", [])
    check_checkpoint_fits(before, state, run_dir)
    # --rounds is checked against the checkpoint before the config takes it: a count the run has
    # already done would otherwise surface as whichever option must fall within the rounds.
    require(rounds is None or rounds > done, "--rounds",
            f"{rounds} does not extend the run: its checkpoint is at round {done} (of {before.rounds}); pass --rounds N > {done}")
    left, dropped = left_with_engine(before.simulation, parsed)
    config, notes = _load_continued(run_dir / "config.yaml", parsed + left, rounds)
    notes += dropped
    check_branch(before, config, state)
    if config.rounds <= done:
        raise ConfigError(
            "rounds" if any(key == "rounds" for key, _ in parsed) and not rounds else "--rounds",
            f"the checkpoint is at round {done} of {config.rounds}; pass --rounds N > {done} to extend",
        )
    return Continuation(
        source=run_dir,
        is_branch=out is not None,
        run_dir=run_dir if out is None else out.resolve(),
        config=config,
        completed_round=done,
        overrides=tuple(overrides),
        notes=tuple(notes),
        extended=bool(rounds) or (out is None and bool(parsed)),
    )


def _load_continued(path: Path, parsed: list[tuple[str, Any]], rounds: int | None) -> tuple[ExperimentConfig, list[str]]:
    """The run's config with the overrides and the new round count. An option the new count
    cannot hold (FL+HC's rounds_before_clustering must fall before the last round) is an error of
    --rounds, the flag the user gave, with the option's own message as the reason."""
    try:
        return load_config(path, parsed + ([("rounds", rounds)] if rounds else []), strict=True)
    except ConfigError as err:
        if not rounds:
            raise
        load_config(path, parsed, strict=True)  # the overrides' own mistakes are theirs, not --rounds'
        raise ConfigError("--rounds", f"{rounds} rounds are too few for this run: {err}") from None


def continue_run(
    continuation: Continuation, *, progress: RunProgress | None = None, verbose: bool = False
) -> dict[str, Any]:
    """Run a checked resume or branch to its last round (a branch first copies its source into
    its own directory); return its summary."""
    config, run_dir = continuation.config, continuation.run_dir
    if continuation.is_branch:
        preflight(config, run_dir, resuming=True)  # a missing dataset is reported before anything is copied
        try:
            branch_run(continuation.source, run_dir, config_to_dict(config), continuation.completed_round,
                       continuation.overrides)
        except RunFolderTaken as err:  # a used or contested --out
            raise RunFolderTaken(err.run_dir, err.reason, "--out") from None
        return run_experiment(config, run_dir, progress=progress, verbose=verbose,
                              resume_from=continuation.completed_round)
    with holding(run_dir):
        if checkpoint_round(run_dir) != continuation.completed_round:  # another process went on meanwhile
            raise RunFolderTaken(run_dir, f"changed while this command started: its checkpoint is no longer round "
                                 f"{continuation.completed_round}; run the command again")
        if continuation.extended:
            atomic_write(run_dir / "config.yaml", yaml.safe_dump(config_to_dict(config), sort_keys=False))
        return run_experiment(
            config, run_dir, progress=progress, verbose=verbose, resume_from=continuation.completed_round
        )


def check_checkpoint_fits(config: ExperimentConfig, state: dict[str, Any], run_dir: Path) -> None:
    """The run's ``config.yaml`` must still describe the run that wrote its checkpoint: the same
    strategy (which of config.yaml, state.json and summary.json was edited is named:
    :func:`~fedcluster_flwr.results.checkpoints.check_strategy_names`) and number of clients (an edited
    file would fail inside the simulation)."""
    from .registry import strategies

    path = run_dir / "config.yaml"
    written_by = state["strategy"].get("strategy")
    known = f" ({written_by} is no longer a strategy)" if isinstance(written_by, str) and written_by not in strategies() else ""
    check_strategy_names(run_dir, state, config.strategy.name, known)
    clients = checkpoint_array_shape(run_dir, state, "assignment")
    if clients and clients[0] != config.partition.num_clients:
        raise DamagedRunError(
            path, f"partition.num_clients is {config.partition.num_clients}, but the checkpoint holds "
            f"{clients[0]} clients: restore the run's config.yaml"
        )


# What produced a checkpoint; a branch that changed one of these would continue a run that never
# happened. Declared with roles=(FIXED_ON_BRANCH,): the data, clients, model, seed and strategy name.
BRANCH_FIXED = keys_with(ExperimentConfig, FIXED_ON_BRANCH)


def check_branch(before: ExperimentConfig, after: ExperimentConfig, state: dict[str, Any]) -> None:
    """Refuse a branch that changes what produced the checkpoint: the experiment (data, model,
    training, seed), the strategy, or a strategy option the run already acted on."""
    require(before.strategy.name == after.strategy.name, "strategy.name",
            f"a branch continues the {before.strategy.name} checkpoint of RUN_DIR; start a new run for another strategy")
    old, new = config_to_dict(before), config_to_dict(after)
    for fixed in BRANCH_FIXED:
        changed = next((key for key, _, _ in config_differences(tree_at(old, fixed), tree_at(new, fixed), key=fixed)), None)
        require(
            changed is None,
            changed or fixed,
            "a branch continues the checkpoint of RUN_DIR, so it cannot change what produced it "
            f"({', '.join(BRANCH_FIXED)}); start a new run instead",
        )
    for option in before.strategy.strategy_class.options_fixed_by(state["strategy"]):
        require(
            getattr(before.strategy.options, option) == getattr(after.strategy.options, option),
            f"strategy.{option}",
            f"the run already acted on it by round {state['round']} (the checkpoint); branch from an earlier "
            "checkpoint (fedcluster run --stop-after N) to vary it",
        )
