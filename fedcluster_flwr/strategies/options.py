"""Checks that several strategies' options dataclasses share (the config's ``strategy`` section).

Each raises a :class:`~fedcluster_flwr.schema.ConfigError` naming the key and what was expected.
"""

from __future__ import annotations

from typing import Any

from ..schema import require


def require_fraction(value: float, key: str) -> None:
    """A share of clients: in (0, 1]."""
    require(0.0 < value <= 1.0, key, f"must be in (0, 1], got {value}")


def require_clusters_fit(num_clusters: int, config: Any, key: str) -> None:
    """No more clusters than clients."""
    clients = config.partition.num_clients
    require(num_clusters <= clients, key, f"cannot exceed partition.num_clients ({clients})")
