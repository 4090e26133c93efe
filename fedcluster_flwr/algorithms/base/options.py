"""Declarations several strategies' options dataclasses share (the config's ``strategy`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...schema import ConfigError, Condition, Interval, NoMoreThan, as_yaml, lookup, option_key

# A share of clients (``client_fraction``, a quorum): some, at most all.
SHARE_OF_CLIENTS = Interval(0, 1, closed="right")

# An experiment rule: no more clusters than clients. A cluster count left null (a distance
# threshold decides it instead) passes.
CLUSTERS_FIT_CLIENTS = NoMoreThan("num_clusters", "partition.num_clients")


@dataclass(frozen=True)
class NeedsSetting:
    """An experiment rule: where ``condition`` holds, the experiment's dotted ``key`` holds one of
    ``values``; ``why`` says what needs it. ``NeedsSetting(Is("round_order", "sequential"),
    "simulation.engine", ("inprocess",), "plays a round's clients one after another")``."""

    condition: Condition
    key: str
    values: tuple[Any, ...]
    why: str

    def check(self, options: Any, prefix: str, context: Any) -> None:
        actual = lookup(context, self.key)
        if not self.condition.holds(options) or actual in self.values:
            return
        wanted = " or ".join(map(as_yaml, self.values))
        raise ConfigError(option_key(options, self.condition.name, prefix),
                          f"{self.condition.text(options)} {self.why}, which only {self.key} {wanted} can do "
                          f"({self.key} is {as_yaml(actual)}): set {self.key}: {as_yaml(self.values[0])}")
