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

from ...training import Parameters


@dataclass(frozen=True)
class ProximalTerm:
    """(μ/2) ||w − w^t||² over every parameter (eq. 2's second term); ``start`` is w^t."""

    mu: float

    def __call__(self, parameters: Parameters, start: Parameters) -> torch.Tensor:
        squared = [(parameters[name] - start[name]).square().sum() for name in parameters]
        return 0.5 * self.mu * torch.stack(squared).sum()
