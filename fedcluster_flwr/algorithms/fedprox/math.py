"""FedProx's local objective (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith: "Federated Optimization in
Heterogeneous Networks", MLSys 2020), Algorithm 2, step "each chosen device k finds a w_k^{t+1}
which is a γ-inexact minimizer of"

    h_k(w; w^t) = F_k(w) + (μ/2) ||w − w^t||²                                   (eq. 2)

where w^t is the global model the round started from. F_k is the client's loss (here each
mini-batch's mean cross-entropy); the local solver is the client's usual optimizer for
``client.epochs`` epochs (the paper's inexactness γ is set by the number of local steps). No flwr here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...training import START, Parameters


@dataclass(frozen=True)
class ProximalTerm:
    """(μ/2) ||w − a||² over every parameter, a the anchor named ``anchor``: FedProx's eq. 2 with
    a = w^t, the model the round's training started from (:data:`~fedcluster_flwr.training.START`);
    Ditto's personal objective (its eq. 2) with a = the global model the server sent."""

    mu: float
    anchor: str = START

    def __call__(self, parameters: Parameters, anchor: Parameters) -> torch.Tensor:
        squared = [(parameters[name] - anchor[name]).square().sum() for name in parameters]
        return 0.5 * self.mu * torch.stack(squared).sum()
