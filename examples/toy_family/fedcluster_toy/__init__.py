"""A toy algorithm family from outside fedcluster_flwr: FedAvg with server momentum (FedAvgM, Hsu et
al., "Measuring the effects of non-identical data distribution for federated visual
classification", 2019), as the worked example of docs/how-to/add-algorithm.md.

Each round a ``client_fraction`` of the online clients trains the global model w (task ``train``);
with Δ = w − FedAvg(replies), the server keeps a velocity v ← β·v + Δ (β = ``server_momentum``)
and steps w ← w − η·v (η = ``server_lr``). β = 0, η = 1 is FedAvg.

Used with ``FEDCLUSTER_ALGORITHMS=fedcluster_toy`` (this folder on ``PYTHONPATH``), or installed
with an entry point ``[project.entry-points."fedcluster_flwr.algorithms"] toy = "fedcluster_toy"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedcluster_flwr.algorithms.base import ClusteredStrategy, Instruction, Reply, StrategySetup
from fedcluster_flwr.algorithms.base.options import SAME_MEANING, SHARE_OF_CLIENTS
from fedcluster_flwr.declarations.options import DeclaredOptions
from fedcluster_flwr.protocol import MODEL
from fedcluster_flwr.registry import register
from fedcluster_flwr.declarations.schema import Interval, above, option


@dataclass(frozen=True)
class ServerMomentumOptions(DeclaredOptions):
    client_fraction: float = option(0.3, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))
    server_momentum: float = option(0.9, Interval(0, 1, closed="left"), note="β; 0 with server_lr 1 is FedAvg")
    server_lr: float = option(1.0, above(0), note="η")


@register
class ServerMomentum(ClusteredStrategy):
    """FedAvgM: one global model, moved by the server's momentum of the averaged updates."""

    name = "toy"
    Options = ServerMomentumOptions

    def __init__(self, options: ServerMomentumOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.velocity = [np.zeros_like(a) for a in self.models[0]]

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        return self.train_cluster_models(self.sample(online, self.options.client_fraction))

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        trained = [r for r in replies if MODEL in r.task.reply]
        if not trained:
            return
        average = self.average(trained)
        beta, lr = self.options.server_momentum, self.options.server_lr
        for k, (weights, mean) in enumerate(zip(self.models[0], average)):
            self.velocity[k] = (beta * self.velocity[k] + (weights - mean)).astype(weights.dtype)
            self.models[0][k] = (weights - lr * self.velocity[k]).astype(weights.dtype)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"velocity_norm": float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in self.velocity)))}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"velocity": self.velocity}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = [np.array(v) for v in state["velocity"]]
