"""FL+HC (Briggs et al.): federated learning with a hierarchical clustering of the clients'
updates."""

from .strategy import FLHC

__all__ = ['FLHC']
