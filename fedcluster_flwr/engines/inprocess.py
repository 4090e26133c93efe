"""Run a strategy against real ClusterClients in this process, without Ray: the ``inprocess`` and
``batched`` engines (``simulation.engine``).

Flower's server loop, reduced to what a strategy sees: configure_fit -> each client's
``fit`` (an exception is a failure) -> aggregate_fit -> configure_evaluate -> evaluate ->
aggregate_evaluate. The clients are the real NumPyClients behind Flower's ``Client``
wrapper, so parameters travel serialized exactly as in a simulation; only the transport
and the thread pool are missing (replies are handed over in partition-id order, which the
strategies do not depend on). Fast and deterministic: the behaviour-preservation test,
seed sweeps (``benchmarks/multimodel --paper``) and quick studies use it; a slow test shows it gives
the Ray engine's rounds bit for bit, and end-to-end tests use Ray. :func:`play_round` is the one
round loop: the tests drive strategies with it too, through synthetic clients.

With ``simulation.engine: batched`` each client's handler runs in a thread of its own and the torch
work of a round's clients executes together (:mod:`fedcluster_flwr.engines.batched`), spread over
one worker thread per core (each on one torch thread, as every client is on the other engines).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.common import Code
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from ..algorithms.base import StrategySetup
from ..config_sections import ExperimentConfig
from ..experiment import client_device, make_client, server_components
from ..numerics import torch_threads
from ..protocol import TASK_KEY
from ..run_files import RoundRow
from .batched import (
    CPU_UNSTACKED_MODELS, BatchedCompute, BatchPolicy, EngineError, Rendezvous, cpu_threads, default_memory_bytes, execute,
)


class InProcessProxy(ClientProxy):
    """A Flower client proxy that calls a real ClusterClient directly."""

    def __init__(self, config: ExperimentConfig, pid: int, rendezvous: Rendezvous | None = None):
        super().__init__(f"node-{1000 + 7 * pid}")  # node ids unrelated to partition ids, as Flower's are
        self.pid = pid
        client = make_client(config, pid, config.partition.num_clients)
        if rendezvous is not None:
            client.compute = BatchedCompute(rendezvous, pid)
        self.client = client.to_client()

    def get_properties(self, ins, timeout, group_id):
        return self.client.get_properties(ins)

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        return self.client.fit(ins)

    def evaluate(self, ins, timeout, group_id):
        return self.client.evaluate(ins)

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


Arrival = Callable[[list], Any]  # reorders a round's results in place, as arrival order would


def play_round(
    strategy: Any,
    manager: ClientManager,
    server_round: int,
    rendezvous: Rendezvous | None = None,
    arrival: Arrival | None = None,
) -> None:
    """One round as Flower's server plays it: configure_fit, every instructed client's ``fit`` (an
    exception is a failure), aggregate_fit, configure_evaluate, ``evaluate``, aggregate_evaluate.
    ``arrival`` reorders the fit and the evaluate results before the strategy sees them.

    A strategy whose clients take turns (``fit_turns`` gives them, :mod:`fedcluster_flwr.algorithms.base.turns`)
    instead gets each client's result through aggregate_fit before the next client is instructed."""
    turns = getattr(strategy, "fit_turns", lambda *_: None)(server_round, manager)
    if turns is None:
        results, failures = _call_all(strategy.configure_fit(server_round, None, manager), "fit", rendezvous)
        if arrival is not None:
            arrival(results)
        strategy.aggregate_fit(server_round, results, failures)
    elif rendezvous is not None:
        raise ValueError("a round whose clients take turns cannot run on the batched engine: set simulation.engine: inprocess")
    else:
        for turn in turns:
            strategy.aggregate_fit(server_round, *_call_all([turn], "fit"))
    instructions = strategy.configure_evaluate(server_round, None, manager)
    if instructions:  # as Flower's server: no evaluation round without instructions
        results, failures = _call_all(instructions, "evaluate", rendezvous)
        if arrival is not None:
            arrival(results)
        strategy.aggregate_evaluate(server_round, results, failures)


def _call_all(instructions, method: str, rendezvous: Rendezvous | None = None) -> tuple[list, list]:
    """Every instruction's call, in partition-id order (with ``rendezvous``: in threads that meet
    at their torch work, replies still taken in partition-id order)."""
    ordered = sorted(instructions, key=lambda item: item[0].pid)
    calls = [lambda proxy=proxy, ins=ins: getattr(proxy, method)(ins, None, None) for proxy, ins in ordered]
    if rendezvous is None:
        outcomes = []
        for call in calls:
            try:
                outcomes.append((True, call()))
            except Exception as err:  # noqa: BLE001 - a raising client is a failure, as in Flower
                outcomes.append((False, err))
    else:
        tasks = sorted({str(ins.config.get(TASK_KEY, method)) for _, ins in ordered})
        outcomes = rendezvous.run_all(calls, task=",".join(tasks))
    results, failures = [], []
    for (proxy, _), (ok, value) in zip(ordered, outcomes):
        if not ok:
            # KeyboardInterrupt, SystemExit and the batched engine's own errors are not a client's failure
            if not isinstance(value, Exception) or isinstance(value, EngineError):
                raise value
            failures.append(value)
        else:
            (results if value.status.code == Code.OK else failures).append((proxy, value))
    return results, failures


def batched_rendezvous(config: ExperimentConfig) -> Rendezvous:
    """The meeting point of a batched run's clients, with its stacking policy and memory budget."""
    device = client_device(config)
    memory = config.simulation.batched_memory_gb
    policy = BatchPolicy(
        stack_on_cpu=config.model.name not in CPU_UNSTACKED_MODELS,
        memory_bytes=default_memory_bytes(device) if memory is None else int(memory * 1024**3),
        workers=(config.simulation.batched_workers or cpu_threads()) if device.type == "cpu" else 1,
    )
    return Rendezvous(lambda batch: execute(batch, policy), close=policy.close)


def run_in_process(
    config: ExperimentConfig,
    run_dir: Path,
    make_strategy: Callable[[StrategySetup], Any] | None = None,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    on_round: Callable[[RoundRow], None] | None = None,
) -> Any:
    """Run ``config`` to the end (or to ``stop_after``, checkpointed; ``resume``: from the
    checkpoint in ``run_dir``); return the strategy (its models, assignment; its round log is ``observer``). torch runs
    one thread inside, as in each of the Ray engine's clients (the caller's count is restored).

    ``make_strategy`` builds another strategy from the experiment's setup (a strategy that
    is not in the registry, e.g. a test's own); ``on_round`` is called with each round's row as
    it is recorded (as ``fedcluster run``'s progress is). ``config.simulation.engine`` ``batched``
    executes the round's clients together; any other value runs them one after another.
    """
    batched = config.simulation.engine == "batched"
    with torch_threads(1):
        components = server_components(
            config, run_dir, on_round, resume=resume, stop_after=stop_after, make_strategy=make_strategy
        )
        strategy = components.strategy
        rendezvous = batched_rendezvous(config) if batched else None
        try:
            manager = SimpleClientManager()
            for pid in range(config.partition.num_clients):
                manager.register(InProcessProxy(config, pid, rendezvous))
            for server_round in range(1, components.config.num_rounds + 1):
                play_round(strategy, manager, server_round, rendezvous)
        finally:
            if rendezvous is not None:
                rendezvous.close()
    return strategy
