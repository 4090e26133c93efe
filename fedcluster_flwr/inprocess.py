"""Run a strategy against real ClusterClients in this process, without Ray.

Flower's server loop, reduced to what a strategy sees: configure_fit -> each client's
``fit`` (an exception is a failure) -> aggregate_fit -> configure_evaluate -> evaluate ->
aggregate_evaluate. The clients are the real NumPyClients behind Flower's ``Client``
wrapper, so parameters travel serialized exactly as in a simulation; only the transport
and the thread pool are missing (replies are handed over in partition-id order, which the
strategies do not depend on). Fast and deterministic: the behaviour-preservation test,
seed sweeps (``benchmarks/multimodel --paper``) and quick studies use it; a slow test shows it gives
the Ray engine's rounds bit for bit, and end-to-end tests use Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.common import Code
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from .config import ExperimentConfig
from .experiment import make_client, server_components
from .numerics import torch_threads
from .results import RoundRow
from .strategies import StrategySetup


class InProcessProxy(ClientProxy):
    """A Flower client proxy that calls a real ClusterClient directly."""

    def __init__(self, config: ExperimentConfig, pid: int):
        super().__init__(f"node-{1000 + 7 * pid}")  # node ids unrelated to partition ids, as Flower's are
        self.pid = pid
        self.client = make_client(config, pid, config.partition.num_clients).to_client()

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


def _call_all(instructions, method: str) -> tuple[list, list]:
    results, failures = [], []
    for proxy, ins in sorted(instructions, key=lambda item: item[0].pid):
        try:
            res = getattr(proxy, method)(ins, None, None)
        except Exception as err:  # noqa: BLE001 - a raising client is a failure, as in Flower
            failures.append(err)
            continue
        (results if res.status.code == Code.OK else failures).append((proxy, res))
    return results, failures


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
    checkpoint in ``run_dir``); return the strategy (its models, assignment, log). torch runs
    one thread inside, as in each of the Ray engine's clients (the caller's count is restored).

    ``make_strategy`` builds another strategy from the experiment's setup (a strategy that
    is not in the registry, e.g. a test's own); ``on_round`` is called with each round's row as
    it is recorded (as ``fedcluster run``'s progress is).
    """
    with torch_threads(1):
        components = server_components(
            config, run_dir, on_round, resume=resume, stop_after=stop_after, make_strategy=make_strategy
        )
        strategy = components.strategy
        manager = SimpleClientManager()
        for pid in range(config.partition.num_clients):
            manager.register(InProcessProxy(config, pid))
        for server_round in range(1, components.config.num_rounds + 1):
            results, failures = _call_all(strategy.configure_fit(server_round, None, manager), "fit")
            strategy.aggregate_fit(server_round, results, failures)
            instructions = strategy.configure_evaluate(server_round, None, manager)
            if instructions:  # as Flower's server: no evaluation round without instructions
                strategy.aggregate_evaluate(server_round, *_call_all(instructions, "evaluate"))
    return strategy
