"""What every family's strategy builds on: the round protocol behind Flower's Strategy API
(:mod:`.strategy`), instructions and checked replies (:mod:`.messages`), which Flower client is which
partition (:mod:`.directory`), shared option declarations (:mod:`.options`) and the cluster-selection
tasks several families use (:mod:`.selection`), the local objectives several methods share
(:mod:`.objectives`)."""

from . import objectives  # noqa: F401 - registers the shared local objectives
from .directory import FederationError
from .strategy import HOOKS, UNASSIGNED, Artifacts, ClusteredStrategy, Instruction, Reply, StrategySetup

__all__ = ["HOOKS", "UNASSIGNED", "Artifacts", "ClusteredStrategy", "FederationError", "Instruction", "Reply",
           "StrategySetup"]
