"""FedProx (Li et al., 2020): FedAvg whose clients minimise their loss plus a proximal term."""

from .strategy import FedProx

__all__ = ["FedProx"]
