"""Rounds whose clients take turns: each client is instructed only when its turn comes, from the
state the turns before it left (their replies already absorbed), as in the DAC reference code's
round (github.com/edvinli/DAC ``utils.py``: the clients go one after another, each averaging its
neighbours' *current* models).

Flower's server instructs a round's clients all at once, so only an engine that runs them one
after another can play such a round: the in-process engine (``simulation.engine: inprocess``)
asks :meth:`TakesTurns.fit_turns` for one client's ``FitIns`` at a time and hands that client's
result to ``aggregate_fit`` before it asks for the next
(:func:`fedcluster_flwr.engines.inprocess.play_round`). A strategy that takes turns refuses
Flower's ``configure_fit``, so it never runs synchronously by mistake on another engine; its
options declare the engine it needs, so a config asking for another stops before anything starts.

A strategy mixes :class:`TakesTurns` in before :class:`~.strategy.ClusteredStrategy` and
implements its hooks: :meth:`~TakesTurns.takes_turns`, :meth:`~TakesTurns.turn_order`,
:meth:`~TakesTurns.turn_instruction`, :meth:`~TakesTurns.absorb_turn` and
:meth:`~TakesTurns.turns_ended`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from flwr.common import FitIns
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from .messages import Instruction, Reply, parameters_nbytes, train_losses
from .strategy import RoundCounters

Turn = tuple[ClientProxy, FitIns]


class TakesTurns:
    """Turn-taking rounds for a :class:`~.strategy.ClusteredStrategy` (mixed in before it)."""

    turns_setting = "the strategy's rounds are turns"  # the setting that makes them turns, for messages
    _turn_losses: list[float] | None = None  # the round's training losses while its turns are played

    # ---- hooks ---------------------------------------------------------------------------------------

    def takes_turns(self) -> bool:
        """Whether this run's rounds are played as turns (default: no, Flower's round)."""
        return False

    def turn_order(self, server_round: int, online: list[int]) -> list[int]:
        """Who takes a turn this round, in order."""
        raise NotImplementedError

    def turn_instruction(self, server_round: int, pid: int) -> Instruction:
        """``pid``'s instruction, made when its turn comes."""
        raise NotImplementedError

    def absorb_turn(self, server_round: int, reply: Reply) -> None:
        """Take one turn's validated reply into the state the next turns see."""
        raise NotImplementedError

    def turns_ended(self, server_round: int) -> None:
        """After the round's last turn (before its evaluation)."""

    # ---- Flower's side ---------------------------------------------------------------------------------

    def fit_turns(self: Any, server_round: int, client_manager: ClientManager) -> Iterator[Turn] | None:
        """None where rounds are not turns (the engine plays Flower's round); otherwise the round's
        fits one at a time: each ``(proxy, FitIns)`` is made when the previous turn's result has
        been handed to ``aggregate_fit``."""
        if not self.takes_turns():
            return None
        server_round += self.round_offset
        self.counters = RoundCounters(started=time.perf_counter())
        online = self.directory.online_clients(server_round, client_manager)
        self.messages.train_sizes = self.directory.train_sizes(self.setup.train_sizes)
        return self._turns(server_round, self.turn_order(server_round, online))

    def _turns(self: Any, server_round: int, order: list[int]) -> Iterator[Turn]:
        counters = self.counters
        self._turn_losses = []
        try:
            for pid in order:
                ((_, ins),) = self.messages.pack_fit([self.turn_instruction(server_round, pid)], server_round)
                counters.bytes_down += parameters_nbytes(ins.parameters)
                counters.fit_clients = tuple(sorted((*counters.fit_clients, pid)))
                yield self.directory.proxy(pid), ins
            losses = self._turn_losses
        finally:
            self._turn_losses = None
        self.turns_ended(server_round)
        counters.train_loss = float(np.mean(losses)) if losses else float("nan")

    def configure_fit(self: Any, server_round: int, parameters: Any, client_manager: ClientManager) -> list[Turn]:
        if self.takes_turns():
            raise RuntimeError(
                f"{self.name}: this run's rounds are turns ({self.turns_setting}), which only an engine that runs a "
                "round's clients one after another can play: set simulation.engine: inprocess")
        return super().configure_fit(server_round, parameters, client_manager)  # type: ignore[misc]

    def aggregate_fit(self: Any, server_round: int, results: list, failures: list) -> tuple[None, dict[str, Any]]:
        if self._turn_losses is None:  # Flower's round
            return super().aggregate_fit(server_round, results, failures)  # type: ignore[misc]
        server_round += self.round_offset
        replies = self.checked_replies(server_round, results, failures)
        for reply in replies:
            self.absorb_turn(server_round, reply)
        self._turn_losses += train_losses(replies)
        return None, {"accepted_updates": len(replies), "fit_failures": self.counters.fit_failures}
