"""The ServerApp: one route from its main to a strategy's ``start``, whatever grid it is given.

:func:`serve` is that route: the run planned by :func:`plan_run` (the strategy from the registry,
connected to the round log that records it, resumed from its checkpoint where asked) is played on
the grid by the strategy's own ``start``. Every way of running takes it:

* ``fedcluster run`` on Ray: :class:`ExperimentServerApp` under Flower's simulation runtime, whose
  grid reaches the ClientApp on Ray's actors;
* ``fedcluster run`` on ``inprocess`` / ``batched``: the same ServerApp called with this process's
  grid (:func:`run_in_process`, :func:`engine_grid`);
* ``flwr run``: this module's ``app`` (:func:`flwr_run_main`), with the run config's experiment, on
  the SuperLink's grid (Flower's simulation runtime, or the SuperNodes of a deployment) or, for
  ``simulation.engine`` inprocess/batched in Flower's simulation, on this process's grid;
* a user's own ServerApp, which builds a strategy and calls its ``start`` (docs/how-to/own-app.md).

Under ``flwr run`` the apps run from an installed copy of this project, with the working directory
and environment of whoever started the SuperLink; so a relative ``output_dir`` is placed under
``~/fedcluster/`` (logged at start), never under an unpredictable working directory. What a ``flwr
run`` logs: a warning naming the config's options that have no effect there
(:func:`flwr_run_notes`), each round, and at the end the summary ``fedcluster run`` prints
(:func:`flwr_run_summary`). A config error is one line and fails the run (``flwr ls`` shows it
``finished:failed``); Flower's ``flwr run --stream`` itself exits 0 whatever the run's status
(flwr 1.42: it only streams logs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.common import log
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from ..algorithms.base import ClusteredStrategy, StrategySetup
from .. import flower_patches
from ..results.checkpoints import load_checkpoint
from ..client import kept_state, restore_kept_state
from ..config.load import ConfigWarning
from ..declarations.roles import NO_EFFECT_UNDER_FLWR_RUN, declared, default_of
from ..config.sections import ExperimentConfig
from ..data import DataError
from ..engines.batched import BatchedCompute
from ..engines.inprocess import BatchedGrid, InProcessGrid, batched_rendezvous, node_id_of, partition_node_configs
from ..engines.sharded import ShardedGrid, sharded_grid
from ..experiment import Experiment
from ..numerics import configure_driver_torch, torch_threads
from ..results.recorder import run_dir_name
from ..results.round_log import resume as resume_strategy
from ..results.run_files import RoundRow, format_summary, read_summary
from ..declarations.schema import ConfigError, lookup
from .client_app import FedclusterClientApp
from .run_config import config_from_run_config, experiment_from_run_config, run_config_notes

# ---- the one route ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """A run ready to be served: its strategy (connected to its round log, resumed where asked), the
    rounds still to play, each exchange's timeout (None: wait for every reply) and, for a resumed
    run, what its clients kept on their nodes at the checkpoint (by partition id; None where the
    checkpoint could not hold it: made under ``flwr run`` or on devices)."""

    strategy: ClusteredStrategy
    num_rounds: int
    timeout: float | None
    client_states: Mapping[int, Mapping[str, Any]] | None = field(default_factory=dict)


def plan_run(
    experiment: Experiment,
    run_dir: Path,
    on_round: Callable[[RoundRow], None] | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    make_strategy: Callable[[StrategySetup], Any] | None = None,
) -> RunPlan:
    """The strategy of one run writing to ``run_dir`` (:meth:`Experiment.strategy`: the config's,
    or ``make_strategy``'s from the experiment's setup); with ``resume``, continuing the run there
    from its checkpoint; with ``stop_after``, stopping (checkpointed) after that round, leaving the
    run to be resumed or branched."""
    config = experiment.config
    strategy = experiment.strategy(run_dir, on_round=on_round, fresh=not resume, stop_after=stop_after,
                                   make_strategy=make_strategy)
    client_states: dict[int, Any] | None = {}
    if resume:
        checkpoint = load_checkpoint(run_dir)
        resume_strategy(strategy, strategy.observer, checkpoint)
        client_states = checkpoint.get("clients")
    remaining = (config.rounds if stop_after is None else stop_after) - strategy.round_offset
    return RunPlan(strategy, remaining, config.simulation.round_timeout_s, client_states)


@dataclass(frozen=True)
class NodeStates:
    """How to read what each node keeps (its ``Context.state``: :func:`~fedcluster_flwr.client.kept_state`'s
    plain values, by partition id) and how to give a checkpoint's back."""

    read: Callable[[], dict[int, dict[str, Any]]]
    restore: Callable[[Mapping[int, Mapping[str, Any]]], None]

    @classmethod
    def of_contexts(cls, contexts: Callable[[], Mapping[int, RecordDict]]) -> NodeStates:
        """Of node states held in this process (``contexts()``: partition id -> its node's state)."""

        def restore(kept: Mapping[int, Mapping[str, Any]]) -> None:
            for pid, records in contexts().items():
                restore_kept_state(records, kept.get(pid, {}))

        return cls(lambda: {pid: kept_state(records) for pid, records in contexts().items()}, restore)


def node_states(grid: Grid) -> NodeStates | None:
    """How to reach each node's ``Context.state`` on ``grid``: our grids' contexts (a sharded grid's
    through its actors), the contexts Flower's simulation engine keeps in this process (where
    ``fedcluster run`` noted them, :mod:`fedcluster_flwr.flower_patches`); None elsewhere (a
    deployment: the state stays on the devices)."""
    if isinstance(grid, ShardedGrid):
        return NodeStates(grid.node_states, grid.restore_states)
    if isinstance(grid, InProcessGrid):
        return NodeStates.of_contexts(lambda: {int(c.node_config["partition-id"]): c.state for c in grid.contexts.values()})
    # Imported here, not at the top: flwr.superlink costs start-up ~0.8 s (SQLAlchemy) that the
    # in-process engines never need; where this line runs on Flower's engine it is loaded already.
    from flwr.superlink.grid import InMemoryGrid

    if isinstance(grid, InMemoryGrid) and flower_patches.noting_node_states():
        return NodeStates.of_contexts(lambda: flower_patches.node_states(grid.run.run_id) or {})
    return None


def serve(grid: Grid, plan: RunPlan) -> Result:
    """Play the planned run on ``grid``: the strategy's ``start``. Where the grid shows its nodes'
    states, the run's checkpoints hold what the clients keep there and a resumed run's clients get
    theirs back before the first round; elsewhere a checkpoint's client states cannot be given back,
    which is said."""
    states, kept = node_states(grid), plan.client_states
    if states is not None:
        plan.strategy.observer.client_states = lambda: {pid: values for pid, values in sorted(states.read().items())
                                                          if values}
        states.restore(kept or {})
    if plan.strategy.keeps_client_state and (kept is None or kept and states is None):
        where = "this checkpoint holds none (it was made under flwr run or on devices)" if kept is None else \
            "this grid (a deployment) cannot be given theirs back"
        log(WARNING, "fedcluster: %s keeps client state on the nodes, but %s: the clients start without what they "
                     "kept at the checkpoint", plan.strategy.name, where)
    return plan.strategy.start(grid, num_rounds=plan.num_rounds, timeout=plan.timeout)


class ExperimentServerApp(ServerApp):
    """The ServerApp of one experiment (``fedcluster run``/``resume``): its main plans the run
    (:func:`plan_run`, with ``plan_options``: ``on_round``, ``resume``, ``stop_after``,
    ``make_strategy``) and serves it on the grid it is given (:func:`serve`); ``plan`` is the run it played."""

    def __init__(self, experiment: Experiment, run_dir: Path, **plan_options: Any) -> None:
        super().__init__()
        self.plan: RunPlan | None = None
        self.main()(functools.partial(self.run, experiment, run_dir, plan_options))

    def run(self, experiment: Experiment, run_dir: Path, plan_options: dict[str, Any], grid: Grid,
            context: Context) -> None:
        self.plan = plan_run(experiment, run_dir, **plan_options)
        serve(grid, self.plan)


# ---- this process's grids ----------------------------------------------------------------------------


@contextmanager
def engine_grid(experiment: Experiment, shard: bool = True) -> Iterator[InProcessGrid]:
    """The grid of the experiment's in-process engine (``inprocess``, or ``batched``: the round's clients
    executed together; over Ray actors with ``simulation.batched_actors`` or ``ray_address``), over the
    ClientApp with every client built before the first round, so that a client that cannot be built
    (its data, its device) is an error before anything runs. ``shard`` False: no actors, whatever the
    config says (``flwr run``, where the simulation runtime owns Ray)."""
    config = experiment.config
    sharded = config.simulation.batched_actors is not None or config.simulation.ray_address is not None
    if config.simulation.engine == "batched" and shard and sharded:
        with sharded_grid(config, functools.partial(shard_grid, experiment)) as sharded:
            yield sharded
        return
    nodes = partition_node_configs(config.partition.num_clients)
    if config.simulation.engine == "batched":
        grid: InProcessGrid = shard_grid(experiment, range(config.partition.num_clients))
        rendezvous = grid.rendezvous
    else:
        rendezvous = None
        app = FedclusterClientApp(experiment, keep_clients=True)
        grid = InProcessGrid(app, nodes)
        for context in grid.contexts.values():
            app.client(context)
    try:
        yield grid
    finally:
        if rendezvous is not None:
            rendezvous.close()


def shard_grid(experiment: Experiment, pids: Sequence[int], cores: int | None = None) -> BatchedGrid:
    """The batched grid of partitions ``pids`` (all of a single-process run, or one shard of a sharded
    one, in its Ray actor), every client built; ``cores``: the CPU cores its workers may take."""
    config = experiment.config
    pids = list(pids)
    rendezvous = batched_rendezvous(config, cores)
    app = FedclusterClientApp(experiment, keep_clients=True, compute=functools.partial(BatchedCompute, rendezvous))
    nodes = [{"partition-id": pid, "num-partitions": config.partition.num_clients} for pid in pids]
    grid = BatchedGrid(app, nodes, node_ids=[node_id_of(pid) for pid in pids], rendezvous=rendezvous)
    try:
        for context in grid.contexts.values():
            app.client(context)
    except BaseException:
        rendezvous.close()
        raise
    return grid


def run_in_process(
    config: ExperimentConfig | Experiment,
    run_dir: Path,
    make_strategy: Callable[[StrategySetup], Any] | None = None,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    on_round: Callable[[RoundRow], None] | None = None,
    shard: bool = True,
) -> ClusteredStrategy:
    """Run ``config``'s experiment (or the ``Experiment`` given) to the end (or to ``stop_after``,
    checkpointed; ``resume``: from the checkpoint in ``run_dir``) on its engine's grid
    (``simulation.engine`` ``batched``: the round's clients executed together, in this process or,
    with ``shard`` and ``simulation.batched_actors`` / ``ray_address``, in Ray actors, the server
    side here; any other: one after another, in this process); return the strategy (its
    models, assignment; its round log is ``observer``). torch runs one thread inside, as in each of
    the Ray engine's clients (the caller's count is restored).

    ``make_strategy`` builds another strategy from the experiment's setup (a strategy that is not in
    the registry, e.g. a test's own); ``on_round`` is called with each round's row as it is recorded
    (as ``fedcluster run``'s progress is)."""
    experiment = config if isinstance(config, Experiment) else Experiment(config)
    app = ExperimentServerApp(experiment, run_dir, on_round=on_round, resume=resume, stop_after=stop_after,
                              make_strategy=make_strategy)
    with torch_threads(1), engine_grid(experiment, shard) as grid:
        app(grid, Context(grid.run.run_id, SUPERLINK_NODE_ID, {}, RecordDict(), {}))
    assert app.plan is not None
    return app.plan.strategy


# ---- flwr run ---------------------------------------------------------------------------------------

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


# Options of the experiment config that a `flwr run` cannot honour, with what to use instead: there
# the SuperLink's own runtime (Flower's simulation runtime with the federation's settings, or real
# SuperNodes) runs the clients. Declared with roles=(no_effect_under_flwr_run(reason),).
# (simulation.engine inprocess/batched and the batched options do apply: flwr_run_main runs that engine.)
IGNORED_UNDER_FLWR_RUN = {key: role.reason for key, role in declared(ExperimentConfig, NO_EFFECT_UNDER_FLWR_RUN).items()}


def flwr_run_notes(config: ExperimentConfig) -> list[str]:
    """``KEY=value (why)`` for each option of ``config`` set away from its default that has no
    effect under ``flwr run`` (a default says nothing the user asked for)."""
    return [
        f"{key}={lookup(config, key)} ({why})"
        for key, why in IGNORED_UNDER_FLWR_RUN.items()
        if lookup(config, key) != default_of(ExperimentConfig, key)
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
    """Flower's log under ``flwr run`` without the traceback Flower logs for a config error (the
    ServerApp already logged it in one line). Anything else, other errors included, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RunConfigError))


FLWR_RUN_LOG_FILTER = FlwrRunLogFilter()
_RUN_DIRS: dict[int, Path] = {}  # run id -> its results folder: the main knows it, the lifespan's end reads it


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


def runs_here(grid: Grid, config: ExperimentConfig) -> bool:
    """Whether ``config``'s engine runs the clients in the ServerApp's process under ``flwr run``:
    ``inprocess`` / ``batched`` on Flower's simulation grid. Flower 1.42's simulation runtime has no
    backend a third party can add, but a ServerApp's main runs in the simulation's process, with
    Flower's run status, log streaming and ``flwr stop``; Flower's Ray still starts its actor pool,
    which stays idle (set ``client-resources-num-cpus`` to the core count to keep it at one actor).
    On any other grid (a deployment) they are refused: there the engine would train every client on
    the server, from the server's copy of the data, while the SuperNodes wait."""
    engine = config.simulation.engine
    if engine == "ray":
        return False
    # Imported here: flwr.superlink loads SQLAlchemy, ~0.8 s that no `fedcluster run` needs.
    from flwr.superlink.grid import InMemoryGrid

    if isinstance(grid, InMemoryGrid):
        return True
    raise ConfigError(
        "simulation.engine",
        f"'{engine}' runs every client inside the ServerApp, which only Flower's simulation runtime may do; this "
        f"run's grid is a {type(grid).__name__} (a deployment), where it would train every client on the server "
        f"while the SuperNodes wait: use simulation.engine ray (the default) there",
    )


def log_round(row: RoundRow) -> None:
    """Each round's progress in the ``flwr run`` log."""
    accuracy = row.get("mean_client_accuracy")
    shown = "n/a" if accuracy is None else f"{100 * accuracy:.1f} %"
    log(INFO, "fedcluster: round %s: mean client accuracy %s, %s clients trained, %s failed fits",
        row.get("round"), shown, row.get("num_fit_clients"), row.get("fit_failures"))


def flwr_run_main(grid: Grid, context: Context) -> None:
    """What ``flwr run`` runs: the run config's experiment served on ``grid``, or on this process's
    grid for ``simulation.engine`` inprocess/batched in Flower's simulation (:func:`runs_here`)."""
    with config_errors_fail_the_run():
        config, run_dir = start_flwr_run(context)
        _RUN_DIRS[context.run_id] = run_dir
        if not runs_here(grid, config):
            serve(grid, plan_run(experiment_from_run_config(context.run_config), run_dir, on_round=log_round))
            return
        log(INFO, "fedcluster: simulation.engine %s: the ServerApp runs the %s clients in this process (Flower's "
                  "Ray actors stay idle)", config.simulation.engine, config.partition.num_clients)
        configure_driver_torch(config)
        run_in_process(experiment_from_run_config(context.run_config), run_dir, on_round=log_round, shard=False)


def flwr_run_lifespan(context: Context) -> Iterator[None]:
    """Around a ``flwr run``'s ServerApp: the log filter, then the summary once the rounds are over
    (also after a failure, from what the run wrote). The filter stays on: Flower logs a failed run's
    exception after the ServerApp has returned, and the process ends with the run."""
    FLOWER_LOGGER.addFilter(FLWR_RUN_LOG_FILTER)  # a second add of the same filter is a no-op
    yield
    run_dir = _RUN_DIRS.pop(context.run_id, None)
    if run_dir is not None and (run_dir / "summary.json").is_file():  # else the run failed before it started, and said why
        for line in flwr_run_summary(run_dir).splitlines():
            log(INFO, "%s", line)


app = ServerApp()
app.main()(flwr_run_main)
app.lifespan()(flwr_run_lifespan)
