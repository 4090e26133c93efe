"""Ditto (Li et al., 2021): FedAvg's global model, and a personal model per client trained towards it,
kept on the client's node."""

from .strategy import Ditto

__all__ = ["Ditto"]
