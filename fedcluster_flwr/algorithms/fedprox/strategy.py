"""FedProx (Li et al., 2020) as the paper's Algorithm 2: each round a fraction of the clients starts
from the global model w^t and trains on h_k(w; w^t) = F_k(w) + (μ/2)||w − w^t||² (:mod:`.math`,
eq. 2); the server takes the sample-weighted average of their models (as FedAvg).

The proximal term travels as the ``train`` task's local objective (``objective: proximal`` with
``mu``), which every engine applies in its own training step (stacked on the batched engine): no
client handler of its own. With μ = 0 FedProx is FedAvg, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...protocol import OBJECTIVE_KEY
from ...registry import objective, register
from ...declarations.options import DeclaredOptions
from ...declarations.schema import at_least, option
from ...training import Objective
from ...types import Scalar
from ..base.options import SAME_MEANING, SHARE_OF_CLIENTS, StableUnderSGD
from ..baselines.strategy import FedAvg
from .math import ProximalTerm

PROXIMAL = "proximal"
MU_KEY = "mu"


@objective(PROXIMAL, config=(MU_KEY,))
def proximal_objective(config: Mapping[str, Scalar]) -> Objective:
    """Cross-entropy + (μ/2)||w − w^t||² (eq. 2), μ from the instruction."""
    return Objective(terms=(ProximalTerm(float(config[MU_KEY])),))


@dataclass(frozen=True)
class FedProxOptions(DeclaredOptions):
    """FedAvg's sampling and the proximal term's weight."""

    client_fraction: float = option(0.1, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))
    # μ: Li et al. tune it per dataset over {0.001, 0.01, 0.1, 1} (Sec. 5.3); 0.01 is ours, from that grid
    mu: float = option(0.01, at_least(0))

    experiment_rules = (StableUnderSGD("mu"),)


@register
class FedProx(FedAvg):
    """FedAvg whose sampled clients train on the proximal objective (eq. 2)."""

    name = "fedprox"
    Options = FedProxOptions

    def local_objective(self) -> Mapping[str, Scalar]:
        return {OBJECTIVE_KEY: PROXIMAL, MU_KEY: self.options.mu}
