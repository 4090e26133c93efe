"""Ditto (Li, Hu, Beirami, Smith: "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021), Algorithm 1 with FedAvg as the global solver:

    input: T rounds, λ, the initial model w^0 = v_k^0 for every client k
    for t = 0 .. T-1:
        the server samples a fraction of the clients, S_t, and sends them w^t
        for k in S_t (on the clients):
            w_k^t ← w^t trained on F_k (FedAvg's local update)                         UPDATE_GLOBAL
            v_k   ← v_k trained on h_k(v; w^t) = F_k(v) + (λ/2)||v − w^t||²           line 7, eq. 2
            send w_k^t                                                               (v_k stays on k)
        w^{t+1} ← the sample-weighted average of the w_k^t                           AGGREGATE (FedAvg)
    output: every v_k

The clients' work is :mod:`.tasks` (``ditto_train``). The personal model v_k is kept on the client's
node (its ``Context.state``): it never travels, so a round uploads what FedAvg's does; a client the
server never sampled is sent v_k^0 = w^0 (the ``start`` block) with its first instruction, once.
Every online client evaluates its personal model (task ``personal``; where it never trained, v_k^0,
sent again), and the global model beside it (``global_accuracy`` in each round's row).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...declarations.options import DeclaredOptions
from ...protocol import MODEL
from ...registry import register
from ...declarations.schema import at_least, option
from ...training import FLOAT32_STEP, LEARNING_RATE
from ..base.options import SAME_MEANING, SHARE_OF_CLIENTS, StableUnderSGD
from ..base.strategy import Instruction, Reply, StrategySetup
from ..baselines.strategy import FedAvg
from .tasks import DITTO_TRAIN, GLOBAL_ACCURACY, LAMBDA_KEY, PERSONAL_EPOCHS_KEY, PERSONAL_EVALUATE, PERSONAL_LR_KEY, START


@dataclass(frozen=True)
class DittoOptions(DeclaredOptions):
    """FedAvg's sampling, λ of eq. 2 and the personal training's own settings."""

    client_fraction: float = option(0.1, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))
    # λ: Li et al. tune it per dataset over {0.01, 0.1, 1, 2} (Sec. 5); 0.1 is ours, from that grid
    lambda_: float = option(0.1, at_least(0), key="lambda")
    # the personal update's epochs and learning rate; null: the client's own (client.epochs, client.lr),
    # as Algorithm 1, where both updates take the same local iterations at the same step size
    personal_epochs: int | None = option(None, at_least(1), note="null: client.epochs")
    personal_lr: float | None = option(None, LEARNING_RATE, note=f"null: client.lr; {FLOAT32_STEP}")

    experiment_rules = (StableUnderSGD("lambda_", lr="personal_lr"),)


@register
class Ditto(FedAvg):
    """The global model by FedAvg; each sampled client also trains its personal model towards it (eq. 2)."""

    name = "ditto"
    Options = DittoOptions
    keeps_client_state = True  # the personal models (tasks.PERSONAL)

    def __init__(self, options: DittoOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.trained = np.zeros(setup.num_clients, dtype=bool)  # whose node keeps a personal model (was sent work)
        self.global_accuracy: float | None = None  # the round's mean accuracy of the global model

    def personal_start(self, pid: int) -> dict[str, list]:
        """v_k^0 = w^0 for a client that keeps no personal model yet; nothing for one that does."""
        return {} if self.trained[pid] else {START: [self.initial_model()]}

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        config: dict[str, Any] = {LAMBDA_KEY: float(self.options.lambda_)}
        if self.options.personal_epochs is not None:
            config[PERSONAL_EPOCHS_KEY] = int(self.options.personal_epochs)
        if self.options.personal_lr is not None:
            config[PERSONAL_LR_KEY] = float(self.options.personal_lr)
        return [Instruction(pid, DITTO_TRAIN, {MODEL: [self.models[0]], **self.personal_start(pid)}, config)
                for pid in self.sample(online, self.options.client_fraction)]

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        for reply in replies:
            self.trained[reply.pid] = True
        return super().absorb(server_round, replies)

    def evaluation_instruction(self, pid: int) -> Instruction:
        return Instruction(pid, PERSONAL_EVALUATE, {MODEL: [self.models[0]], **self.personal_start(pid)})

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        accuracies = [float(m[GLOBAL_ACCURACY]) for m in self.evaluations.values()]
        self.global_accuracy = float(np.mean(accuracies)) if accuracies else None
        return {"mean_global_model_accuracy": self.global_accuracy}

    def summary_entries(self) -> dict[str, Any]:
        return {"mean_global_model_accuracy": self.global_accuracy}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"trained": self.trained, "global_accuracy": self.global_accuracy}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.trained[:] = state["trained"]
        self.global_accuracy = state["global_accuracy"]
