"""Strategy registry: ``strategy.name`` in the config selects one of these.

``core`` holds what every strategy shares (instructions, reply validation, the absorb /
after_round hooks), ``directory`` which Flower client is which partition, ``round_log``
the per-round metrics, summary and checkpoints; each other module is one algorithm family.
"""

from .core import ClusteredStrategy, Instruction, Reply, StrategySetup
from .directory import FederationError
from .dac import DAC, PENS, DACVar, OracleGossip, RandomGossip
from .fedavg import FedAvg, LocalOnly, OracleClusters
from .flhc import FLHC
from .ifca import IFCA, GradLoss
from .oneshot_hfl import OneShotHFL, OracleHFL, RandomClusters

STRATEGIES: dict[str, type[ClusteredStrategy]] = {
    cls.name: cls
    for cls in (
        FedAvg, LocalOnly, OracleClusters, FLHC, IFCA, GradLoss, OneShotHFL, RandomClusters, OracleHFL,
        DAC, DACVar, PENS, RandomGossip, OracleGossip,
    )
}

__all__ = ["STRATEGIES", "ClusteredStrategy", "FederationError", "Instruction", "Reply", "StrategySetup"]
