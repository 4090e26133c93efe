"""The baselines every table compares with (Briggs et al.): FedAvg (one global model), local
training only, and the oracle that knows the true clusters."""

from .strategy import FedAvg, LocalOnly, OracleClusters

__all__ = ['FedAvg', 'LocalOnly', 'OracleClusters']
