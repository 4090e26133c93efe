"""PACFL (Vahidian et al.): one-shot clustering by principal angles between client data subspaces."""

from .strategy import PACFL

__all__ = ['PACFL']
