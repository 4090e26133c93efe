"""Declarations several strategies' options dataclasses share (the config's ``strategy`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The role every declaration of client_fraction and num_clusters gives them (they mean the same in
# every strategy: kept when an override changes strategy.name), beside the constraints they share.
from ...declarations.roles import SAME_MEANING  # noqa: F401
from ...declarations.schema import ConfigError, Condition, Interval, NoMoreThan, as_yaml, lookup, option_key

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


@dataclass(frozen=True)
class StableUnderSGD:
    """An experiment rule: field ``name``, the weight λ of a pull (λ/2)||w − a||² in a local
    objective (FedProx's μ, Ditto's λ), times the learning rate (field ``lr`` where given, else
    ``client.lr``) is below 2(1 + ``client.momentum``) when ``client.optimizer`` is sgd.

    On the pull alone an SGD step with heavy-ball momentum m moves w − a by the roots of
    z² − (1 + m − lr·λ) z + m, which leave the unit circle once lr·λ ≥ 2(1 + m): every client's
    model then diverges to inf/NaN and every reply is refused, the run going on at chance. The
    loss's own curvature adds to λ's, so below the bound a run can still diverge (the reply checks
    count it). Adam normalises its steps: no such bound."""

    name: str
    lr: str | None = None

    def check(self, options: Any, prefix: str, context: Any) -> None:
        client, weight = context.client, getattr(options, self.name)
        lr = getattr(options, self.lr) if self.lr and getattr(options, self.lr) is not None else client.lr
        bound = 2 * (1 + client.momentum)
        if client.optimizer != "sgd" or weight * lr < bound:
            return
        raise ConfigError(option_key(options, self.name, prefix),
                          f"{weight:g} × learning rate {lr:g} = {weight * lr:g} is not below 2(1 + client.momentum) = "
                          f"{bound:g}: SGD on the pull (weight/2)||w − a||² alone diverges (every model inf or NaN, every "
                          f"reply refused); take it below {bound / lr:g} or lower the learning rate")
