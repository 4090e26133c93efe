"""``simulation.engine: inprocess`` or ``batched`` under ``flwr run``: the ServerApp runs the engine.

Flower 1.42's simulation runtime has no backend a third party can add (``start_vce`` builds its Ray
backend whatever the federation says), but a ServerApp's registered main runs in the simulation's
process, with Flower's run status, log streaming and ``flwr stop`` as for any ServerApp. So
:func:`~fedcluster_flwr.server_app.flwr_run_main` asks :func:`runs_here` first:

1. ``simulation.engine: ray`` (the default): no, Flower's server loop runs on the grid (its Ray
   engine in simulation, the SuperNodes in a deployment).
2. ``inprocess`` / ``batched`` and the grid is the simulation's in-memory grid: yes, and
   :func:`run_here` runs the experiment exactly as ``fedcluster run`` runs it with that engine
   (:func:`~.inprocess.run_in_process`: the same clients, ClientApp code and results folder), logging
   each round. Flower's Ray still starts its actor pool, which stays idle: set
   ``client-resources-num-cpus`` to the core count to keep it at one actor.
3. ``inprocess`` / ``batched`` on any other grid (a deployment): refused, a :class:`ConfigError` on
   ``simulation.engine``. Run there, the engine would train every client on the server, from the
   server's copy of the data, while the SuperNodes wait.
"""

from __future__ import annotations

from logging import INFO
from pathlib import Path
from typing import Any

from flwr.common import log
from flwr.superlink.grid import InMemoryGrid

from ..config_sections import ExperimentConfig
from ..experiment import configure_driver_torch
from ..run_files import RoundRow
from ..schema import ConfigError
from .inprocess import run_in_process


def runs_here(grid: Any, config: ExperimentConfig) -> bool:
    """Whether the ServerApp runs ``config``'s engine itself on ``grid`` (see the module docstring)."""
    engine = config.simulation.engine
    if engine == "ray":
        return False
    if isinstance(grid, InMemoryGrid):
        return True
    raise ConfigError(
        "simulation.engine",
        f"'{engine}' runs every client inside the ServerApp, which only Flower's simulation runtime may do; this "
        f"run's grid is a {type(grid).__name__} (a deployment), where it would train every client on the server "
        f"while the SuperNodes wait: use simulation.engine ray (the default) there",
    )


def log_round(row: RoundRow) -> None:
    """Each round's progress in the ``flwr run`` log, as Flower logs its rounds on the Ray path."""
    accuracy = row.get("mean_client_accuracy")
    shown = "n/a" if accuracy is None else f"{100 * accuracy:.1f} %"
    log(INFO, "[ROUND %s] fedcluster: mean client accuracy %s, %s clients trained, %s failed fits",
        row.get("round"), shown, row.get("num_fit_clients"), row.get("fit_failures"))


def run_here(config: ExperimentConfig, run_dir: Path) -> None:
    """Run ``config`` to its end on its engine in this process, writing ``run_dir``."""
    log(INFO, "fedcluster: simulation.engine %s: the ServerApp runs the %s clients in this process (Flower's Ray "
              "actors stay idle)", config.simulation.engine, config.partition.num_clients)
    configure_driver_torch(config)
    run_in_process(config, run_dir, on_round=log_round)
