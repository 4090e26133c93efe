"""Declarations several strategies' options dataclasses share (the config's ``strategy`` section)."""

from __future__ import annotations

from ...schema import Interval, NoMoreThan

# A share of clients (``client_fraction``, a quorum): some, at most all.
SHARE_OF_CLIENTS = Interval(0, 1, closed="right")

# An experiment rule: no more clusters than clients. A cluster count left null (a distance
# threshold decides it instead) passes.
CLUSTERS_FIT_CLIENTS = NoMoreThan("num_clusters", "partition.num_clients")
