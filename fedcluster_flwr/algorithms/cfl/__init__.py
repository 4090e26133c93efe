"""Clustered FL (Sattler et al.): recursive bi-partitions by the cosine similarity of updates."""

from .strategy import CFL

__all__ = ['CFL']
