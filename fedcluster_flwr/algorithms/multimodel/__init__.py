"""Multi-model per-cluster aggregation: IFCA (Ghosh et al.) and Lin et al.'s joint
gradient-and-loss clustering (``gradloss``)."""

from .strategy import IFCA, GradLoss

__all__ = ['IFCA', 'GradLoss']
