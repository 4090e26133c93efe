"""Flower ServerApp: run config -> experiment config -> strategy from the registry.

Under ``flwr run`` the apps run from an installed copy of this project, with the
working directory and environment of whoever started the SuperLink; so a relative
``output_dir`` is placed under ``~/fedcluster/`` (logged at start), never under an
unpredictable working directory. ``fedcluster run`` resolves paths for the user.

What a ``flwr run`` runs (``app``, this module's ServerApp, whose main is :func:`flwr_run_main`):
Flower's server loop with the strategy :func:`server_fn` builds, or, where the run config asks for
``simulation.engine`` inprocess or batched in Flower's simulation, that engine in the ServerApp's
process (:mod:`fedcluster_flwr.engines.flwr_run`; refused on a deployment).

What a ``flwr run`` logs: a warning naming the config's options that have no effect there
(:func:`flwr_run_notes`), and at the end the summary ``fedcluster run``
prints (:func:`flwr_run_summary`) instead of Flower's History dump (:class:`FlwrRunLogFilter`). A
config error is one line and fails the run (``flwr ls`` shows it ``finished:failed``); Flower's
``flwr run --stream`` itself exits 0 whatever the run's status (flwr 1.42: it only streams logs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.common.logger import FLOWER_LOGGER
from flwr.server import ServerAppComponents
from flwr.serverapp import Grid, ServerApp

from .config import ConfigWarning
from .config_sections import ExperimentConfig, SimulationConfig
from .data import DataError
from .engines.flwr_run import run_here, runs_here
from .experiment import config_from_run_config, run_config_notes, server_components
from .recorder import run_dir_name
from .run_files import RoundRow, format_summary, read_summary
from .schema import ConfigError

FLWR_RUN_OUTPUT_ROOT = Path.home() / "fedcluster"


class RunConfigError(RuntimeError):
    """The run config of a ``flwr run`` is not a valid experiment: the run fails with this message."""


def flwr_run_dir(config: ExperimentConfig, run_id: int) -> Path:
    """Where a ``flwr run`` writes its results (absolute ``output_dir`` kept as is)."""
    base = Path(config.output_dir).expanduser()
    if not base.is_absolute():
        base = FLWR_RUN_OUTPUT_ROOT / base
    name = run_dir_name(config.strategy.name, config.dataset.name, config.partition.name)
    return base / f"{name}_run{run_id}"


# Options of the experiment config that a `flwr run` cannot honour: there the SuperLink's own runtime
# (Flower's simulation runtime with the federation's settings, or real SuperNodes) runs the clients.
# (simulation.engine inprocess/batched and the batched options do apply: flwr_run_main runs that engine.)
IGNORED_UNDER_FLWR_RUN = {
    "ray_address": "Flower's simulation runtime starts its own Ray",
    "num_cpus_per_client": "use flwr run --federation-config \"client-resources-num-cpus=N\"",
    "num_gpus_per_client": "use flwr run --federation-config \"client-resources-num-gpus=X\"",
}


def flwr_run_notes(config: ExperimentConfig) -> list[str]:
    """``simulation.KEY=value (why)`` for each option of ``config`` set away from its default that
    has no effect under ``flwr run`` (a default says nothing the user asked for)."""
    defaults = SimulationConfig()
    return [
        f"simulation.{key}={getattr(config.simulation, key)} ({why})"
        for key, why in IGNORED_UNDER_FLWR_RUN.items()
        if getattr(config.simulation, key) != getattr(defaults, key)
    ]


def flwr_run_summary(run_dir: Path) -> str:
    """What a ``flwr run`` logs at its end: ``fedcluster run``'s summary of a finished run, or the
    round an unfinished one stopped after and where its results are."""
    summary = read_summary(run_dir)
    if not summary.get("finished"):
        done = summary.get("completed_rounds", 0)
        return f"fedcluster: the run stopped after round {done}; its results so far are in {run_dir}"
    return f"fedcluster: {summary.get('completed_rounds', '?')} rounds done\n{format_summary(summary, run_dir)}"


class FlwrRunLogFilter(logging.Filter):
    """Flower's log under ``flwr run``, made the length of ``fedcluster run``'s output: drops the
    History dump after "[SUMMARY]" (a line per round and metric, ~300 lines for the default run;
    the summary that follows says it in 10), and the traceback Flower logs for a config error (the
    ServerApp already logged it in one line). Anything else, other errors included, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RunConfigError):
            return False
        history_line = record.funcName == "run_fl" and record.msg == "\t%s"  # flwr/server/server.py, 1.41-1.42
        return not history_line


FLWR_RUN_LOG_FILTER = FlwrRunLogFilter()
_RUN_DIRS: dict[int, Path] = {}  # run id -> its results folder: server_fn knows it, the lifespan's end reads it


@contextmanager
def config_errors_fail_the_run() -> Iterator[None]:
    """A configuration or data mistake: one logged line, and a :class:`RunConfigError` that fails the run."""
    try:
        yield
    except (ConfigError, DataError) as err:
        # An Exception, not SystemExit: Flower's ServerApp thread passes only Exceptions on, and
        # only then marks the run failed (a SystemExit ended the thread silently: "completed").
        log(ERROR, "fedcluster configuration error: %s", err)
        raise RunConfigError(str(err)) from None


def start_flwr_run(context: Context) -> tuple[ExperimentConfig, Path]:
    """The run's config and results folder, with the notes ``fedcluster run`` would print logged."""
    config = config_from_run_config(context.run_config)
    run_dir = flwr_run_dir(config, context.run_id)
    log(INFO, "fedcluster: %s; results in %s", config.strategy.name, run_dir)
    for note in run_config_notes(context.run_config):  # what fedcluster run prints as note: / warning:
        log(WARNING if isinstance(note, ConfigWarning) else INFO, "fedcluster: %s", note)
    notes = flwr_run_notes(config)
    if notes:
        log(WARNING, "fedcluster: no effect under flwr run: %s", "; ".join(notes))
    return config, run_dir


def server_fn(context: Context) -> ServerAppComponents:
    with config_errors_fail_the_run():
        config, run_dir = start_flwr_run(context)
        components = server_components(config, run_dir)
    _RUN_DIRS[context.run_id] = run_dir
    return components


FLOWER_SERVER_LOOP = ServerApp(server_fn=server_fn)  # Flower's compatibility mode: its server loop on the grid


def flwr_run_main(grid: Grid, context: Context) -> None:
    """What ``flwr run`` runs: Flower's server loop with :func:`server_fn`'s strategy on ``grid``, or
    ``simulation.engine`` inprocess/batched in this process where ``grid`` is the simulation's
    (refused on a deployment's; :mod:`fedcluster_flwr.engines.flwr_run`)."""
    with config_errors_fail_the_run():
        here = runs_here(grid, config_from_run_config(context.run_config))
    if not here:
        FLOWER_SERVER_LOOP(grid, context)
        return
    with config_errors_fail_the_run():
        config, run_dir = start_flwr_run(context)
        try:
            run_here(config, run_dir)
        finally:
            if (run_dir / "summary.json").is_file():  # the lifespan's end then logs the summary
                _RUN_DIRS[context.run_id] = run_dir


def flwr_run_lifespan(context: Context) -> Iterator[None]:
    """Around a ``flwr run``'s ServerApp: the log filter, then the summary once the rounds are over
    (also after a failure, from what the run wrote). The filter stays on: Flower logs a failed run's
    exception after the ServerApp has returned, and the process ends with the run."""
    FLOWER_LOGGER.addFilter(FLWR_RUN_LOG_FILTER)  # a second add of the same filter is a no-op
    yield
    run_dir = _RUN_DIRS.pop(context.run_id, None)
    if run_dir is not None:  # None: server_fn failed, and said why
        for line in flwr_run_summary(run_dir).splitlines():
            log(INFO, "%s", line)


def make_server_app(
    config: ExperimentConfig,
    run_dir: Path,
    on_round: Callable[[RoundRow], None] | None = None,
    resume: bool = False,
    stop_after: int | None = None,
) -> ServerApp:
    """ServerApp bound to an already validated config (used by ``fedcluster run``/``resume``)."""
    return ServerApp(server_fn=lambda context: server_components(config, run_dir, on_round, resume, stop_after))


app = ServerApp()
app.main()(flwr_run_main)
app.lifespan()(flwr_run_lifespan)
