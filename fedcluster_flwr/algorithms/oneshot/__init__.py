"""One-shot data-similarity clustering and hierarchical LPS/GPS training (Ali & Arafa), with its
random and oracle clusterings."""

from .strategy import OneShotHFL, OracleHFL, RandomClusters

__all__ = ['OneShotHFL', 'OracleHFL', 'RandomClusters']
