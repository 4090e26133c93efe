"""FedAvg and the two yardsticks every clustered strategy is compared with.

* ``fedavg`` (McMahan et al.): one model; each round a fraction of all clients trains
  it and the server takes the sample-weighted average.
* ``local``: every client trains only its own model, in every round, never averaged.
* ``oracle``: FedAvg run independently inside each *true* cluster, i.e. clustered FL
  with a perfect clustering.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...protocol import MODEL, TRAIN
from ...declarations.options import DeclaredOptions
from ...declarations.schema import option
from ..base.strategy import ClusteredStrategy, Instruction, Reply, StrategySetup
from ..base.options import SAME_MEANING, SHARE_OF_CLIENTS
from ...registry import register


@dataclass(frozen=True)
class FractionOptions(DeclaredOptions):
    """Share of clients (per cluster, where there are clusters) that train each round."""

    client_fraction: float = option(0.1, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))


@dataclass(frozen=True)
class LocalOptions(DeclaredOptions):
    """None: every online client trains its own model in every round."""


@register
class FedAvg(ClusteredStrategy):
    """One global model trained by a sampled fraction of all clients each round."""

    name = "fedavg"
    Options = FractionOptions

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        return self.train_cluster_models(self.sample(online, self.options.client_fraction))


@register
class LocalOnly(ClusteredStrategy):
    """Every client trains only its own (personal) model, every round; for the per-cluster
    metrics each client is a cluster of one."""

    name = "local"
    Options = LocalOptions

    def __init__(self, options: LocalOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.assignment[:] = range(setup.num_clients)
        self.models = {}
        self.client_models = {p: [a.copy() for a in setup.initial_weights] for p in range(setup.num_clients)}

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        return [Instruction(p, TRAIN, {MODEL: [self.client_models[p]]}) for p in online]

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        for reply in replies:
            self.client_models[reply.pid] = reply.model()


@register
class OracleClusters(ClusteredStrategy):
    """FedAvg inside each true cluster, every cluster starting from the same model."""

    name = "oracle"
    Options = FractionOptions

    def __init__(self, options: FractionOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.start_clusters(setup.true_clusters)

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        return self.per_cluster_training(online, self.options.client_fraction)
