"""What a round produces, as the strategy hands it to whoever records the run: the counters of the
round in progress (:class:`RoundCounters`), the finished round (:class:`RoundReport`) and who takes
it (:class:`RoundObserver`, the runner's round log)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RoundCounters:
    """What the round in progress has produced so far, as the Flower side of the strategy counts it."""

    started: float = 0.0
    fit_clients: tuple[int, ...] = ()
    fit_failures: int = 0
    rejected_updates: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_eval: int = 0
    train_loss: float = float("nan")
    artifacts: dict[str, Any] = field(default_factory=dict)  # files the algorithm returned this round


@dataclass(frozen=True)
class RoundReport:
    """A finished round, as the strategy hands it to the runner's observer: its counters and every
    evaluated client's results (by partition id, in partition-id order)."""

    server_round: int
    counters: RoundCounters
    accuracy: Mapping[int, float]
    loss: Mapping[int, float]
    eval_failures: int
    val_loss: Mapping[int, float] = field(default_factory=dict)


class RoundObserver(Protocol):
    """Who records a strategy's rounds (the runner's round log)."""

    def round_ended(self, strategy: Any, report: RoundReport) -> None:  # strategy: the ClusteredStrategy that played it
        ...
