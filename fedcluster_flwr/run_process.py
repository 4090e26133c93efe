"""A run's own process: ``fedcluster run`` / ``resume`` run the ServerApp here, on Flower's Ray
simulation or on this process's grid (``simulation.engine`` inprocess, batched), never in the CLI's
process, and can therefore always stop it (:func:`fedcluster_flwr.runner.run_experiment` starts and
supervises this process).

Why a process of its own, in a session of its own. Measured with flwr 1.41 and ray 2.55 when the
simulation ran inside the CLI's process:

- Ctrl-C: the terminal sends SIGINT to its whole foreground process group, Ray's workers included;
  they die, and Flower's executor threads wait forever for their replies (a hang in
  ``threading._shutdown``).
- SIGTERM: Ray's core worker in the driver installs a C++ failure-signal handler that prints
  "*** SIGTERM received ... PC: ..." and aborts (exit 134).
- kill -9: ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` are the raylet's children with no
  tie to the driver: they are re-parented to pid 1 and live on. (Ray ties gcs_server and the raylet
  to the driver with PR_SET_PDEATHSIG, not their children.)

So the CLI process (the supervisor) starts this process with ``start_new_session=True``. It and
every process Ray starts (gcs_server, raylet, its agents, the workers: none of them leaves the
process group, checked with ray 2.55) form one process group that no terminal signal reaches, and
that ends as a whole with one ``killpg(SIGKILL)``:

- the supervisor kills the group when it is told to stop (SIGINT, SIGTERM, SIGHUP) and after this
  process exits (a sweep for anything Ray left);
- this process kills its own group when the supervisor disappears, even by kill -9: its stdin is a
  pipe whose only writer is the supervisor, so a read returns end-of-file the moment the supervisor
  is gone (:func:`_end_group_when_orphaned`).

Killing rather than asking Ray to stop loses only the round in progress, and is immediate and
certain (no Ray process can ignore SIGKILL or hang): rounds are checkpointed as they end
(``checkpoint_every: 1`` by default; a checkpoint costs ~5 ms on the default config) and every file
is written atomically, so the last complete round is always there to resume from.

Protocol: the supervisor writes the pickled :class:`Job` (8-byte length, then the bytes) to this
process's stdin and keeps stdin open; this process writes one JSON object per line to the file
descriptor named on its command line: ``{"round": row}`` per round, then ``{"error": message,
"kind": ...}`` if the simulation raised (:func:`error_event`: a configuration or data mistake, the
results not writable, or a bug, whose traceback this process prints).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .config.sections import ExperimentConfig

LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class Job:
    """What the engine runs: ``config`` in ``run_dir``, from the checkpoint at ``resume_from`` (0: a
    fresh run), to ``stop_after`` (None: to ``config.rounds``)."""

    config: ExperimentConfig
    run_dir: Path
    resume_from: int = 0
    stop_after: int | None = None
    verbose: bool = False


def encode_job(job: Job) -> bytes:
    data = pickle.dumps(job)
    return LENGTH.pack(len(data)) + data


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the supervisor closed the job pipe early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_job(fd: int) -> Job:
    (size,) = LENGTH.unpack(_read_exactly(fd, LENGTH.size))
    return pickle.loads(_read_exactly(fd, size))


def _end_group_when_orphaned(fd: int) -> None:
    """Block on the supervisor's pipe; at end-of-file (the supervisor exited or was killed) end this
    process group: the simulation, Ray and everything Ray started."""
    try:
        while os.read(fd, 4096):
            pass
    finally:
        os.killpg(os.getpgid(0), signal.SIGKILL)


def simulate(job: Job, on_round: Any) -> None:
    """Run ``job`` in this process: the experiment's ServerApp on Flower's Ray simulation runtime,
    or (``simulation.engine`` ``inprocess`` / ``batched``) on this process's grid, with the same
    results directory.

    The Ray route is Flower's ``run_simulation``, which Flower 1.42 marks deprecated in favour of
    ``flwr run`` (no removal version is named) and whose notice is logged, not hidden: ``flwr run``
    needs a SuperLink process and an installed app (a FAB) per run, which ``fedcluster run``'s
    supervision of one process group would have to start, watch and stop (docs/how-to/flwr-run.md,
    "Which Flower API")."""
    from .experiment import Experiment
    from .numerics import configure_driver_torch

    configure_driver_torch(job.config)  # before this process's first torch operation; Ray workers inherit the pins
    experiment = Experiment(job.config)  # this process's one
    if job.config.simulation.engine != "ray":
        from .apps.server_app import run_in_process

        with _quiet(job.verbose):
            run_in_process(
                experiment, job.run_dir, resume=job.resume_from > 0, stop_after=job.stop_after, on_round=on_round
            )
        return
    from flwr.simulation import run_simulation

    from . import flower_patches
    from .apps.client_app import FedclusterClientApp
    from .apps.server_app import ExperimentServerApp

    flower_patches.install()  # Flower's engine with less of its own work between the clients' (see there)
    config = job.config
    with _quiet(job.verbose):
        run_simulation(
            server_app=ExperimentServerApp(
                experiment, job.run_dir, on_round=on_round, resume=job.resume_from > 0, stop_after=job.stop_after
            ),
            client_app=FedclusterClientApp(experiment),
            num_supernodes=config.partition.num_clients,
            backend_config=backend_config(config, job.verbose),
            verbose_logging=job.verbose,
        )


def backend_config(config: ExperimentConfig, verbose: bool) -> dict[str, Any]:
    """Flower's Ray backend config: each client's Ray resources, and where Ray runs.

    Without ``simulation.ray_address`` Ray starts on this machine for this run, in this process group,
    and ends with it (see above). ``address="local"`` says so to Ray: otherwise ``RAY_ADDRESS``, or a
    ``ray start`` on this machine, would make the run join that cluster instead.

    With it, this process joins that cluster as one more driver. Ray then refuses ``num_cpus``,
    ``num_gpus``, ``resources`` and ``object_store_memory`` (each node got its own from ``ray start``),
    and none is passed. The cluster's processes are not in this process group, so ending the run
    leaves the cluster running; the clients' actors belong to this driver, and Ray ends them when it
    exits. Flower's ``ray.init`` adds ``runtime_env={"env_vars": {"PYTHONPATH": <this process's
    sys.path>}}`` (flwr 1.41), so a ``runtime_env`` here would be passed twice; other machines need
    the package installed at the same path (see docs/how-to/ray-cluster-gpu.md).
    """
    address = config.simulation.ray_address
    return {
        "client_resources": {
            "num_cpus": config.simulation.num_cpus_per_client,
            "num_gpus": config.simulation.num_gpus_per_client,
        },
        "init_args": {
            "address": "local" if address is None else address,
            "logging_level": "INFO" if verbose else "ERROR",
            "log_to_driver": verbose,
        },
    }


def check_ray_address(config: ExperimentConfig, timeout_s: float = 5.0) -> None:
    """Refuse a ``simulation.ray_address`` at which nothing answers, before the run starts: Ray's
    ``ray.init`` retries such an address for minutes (still retrying after 120 s, ray 2.55)."""
    from .declarations.schema import ConfigError

    address = config.simulation.ray_address
    if address is None:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(
            "simulation.ray_address",
            f"no Ray cluster answers at {address} ({err.strerror or err}): is its head running "
            f"(ray start --head --port={port} on that machine), and is this the address it printed?",
        ) from None


# What kind of error ended a simulation (the ``kind`` of its error event).
USER = "user"  # a configuration or data mistake: one line
OUTPUT = "output"  # the results could not be written (a full or read-only disk): one line
BUG = "bug"  # anything else: the traceback, then one line
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def error_event(err: BaseException) -> dict[str, Any]:
    """The event that tells the supervisor why the simulation stopped."""
    from .data import DataError
    from .declarations.schema import ConfigError

    if isinstance(err, (ConfigError, DataError)):
        return {"error": str(err), "kind": USER}
    if isinstance(err, OSError) and err.errno in OUTPUT_ERRNOS:  # the file it names may be a removed temporary
        return {"error": err.strerror or os.strerror(err.errno), "kind": OUTPUT}
    return {"error": f"{type(err).__name__}: {err}", "kind": BUG}


def main(events_fd: int) -> None:
    try:
        job = read_job(0)
    except EOFError:  # the supervisor was stopped before it handed over the job: nothing started
        os._exit(1)
    threading.Thread(target=_end_group_when_orphaned, args=(0,), daemon=True, name="lifeline").start()
    events: IO[str] = os.fdopen(events_fd, "w", buffering=1)

    def send(event: dict[str, Any]) -> None:
        events.write(json.dumps(event) + "\n")

    code = 0
    try:
        simulate(job, lambda row: send({"round": row}))
    except BaseException as err:  # noqa: BLE001 - told to the supervisor, which says it in one line
        event = error_event(err)
        if event["kind"] == BUG:
            traceback.print_exc()  # for the developer
        send(event)
        code = 2 if event["kind"] == USER else 1
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: Flower may leave non-daemon threads waiting on its queues, and Ray is already
    # shut down by Flower's backend; the supervisor sweeps the process group after this exit anyway.
    os._exit(code)


class _quiet:
    """Keep Flower's per-round INFO logs and known-harmless notices off the caller's output (all of
    them with ``verbose``). Flower's warnings, its deprecation notice among them, pass."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self._filter = _DropClientTracebacks()

    def __enter__(self) -> None:
        from flwr.common.logger import FLOWER_LOGGER

        self._level = FLOWER_LOGGER.level
        if not self.verbose:
            FLOWER_LOGGER.setLevel(logging.WARNING)
            FLOWER_LOGGER.addFilter(self._filter)
            warnings.filterwarnings("ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO.*")

    def __exit__(self, *exc: object) -> None:
        from flwr.common.logger import FLOWER_LOGGER

        FLOWER_LOGGER.setLevel(self._level)
        FLOWER_LOGGER.removeFilter(self._filter)


class _DropClientTracebacks(logging.Filter):
    """Without ``--verbose``, a failed client is the strategy's one warning line ("round 6: client 3
    failed: ...") rather than also Flower's ~90 lines of Ray and Flower tracebacks (with
    ``faults.drop_rate: 0.3`` that was ~4,500 lines per run)."""

    CLIENT_FAILURE = ("An exception was raised when processing a message by", "ClientAppException")

    def filter(self, record: logging.LogRecord) -> bool:
        flower_traceback = record.levelno >= logging.ERROR  # the strategy's own line is a WARNING
        return not (flower_traceback and any(marker in record.getMessage() for marker in self.CLIENT_FAILURE))


if __name__ == "__main__":
    main(int(sys.argv[1]))
