"""Rounds whose clients take turns: each client is instructed only when its turn comes, from the
state the turns before it left (their replies already absorbed), as in the DAC reference code's
round (github.com/edvinli/DAC ``utils.py``: the clients go one after another, each averaging its
neighbours' *current* models).

A grid sends what it is given and returns the replies, so a round of turns is one exchange per
turn: :meth:`TakesTurns.play_round` sends one client's message, absorbs its reply, and only then
makes the next client's. It runs on every grid (Flower's simulation, a deployment, the in-process
and batched engines), one client at a time.

A strategy mixes :class:`TakesTurns` in before :class:`~.strategy.ClusteredStrategy` and
implements its hooks: :meth:`~TakesTurns.takes_turns`, :meth:`~TakesTurns.turn_order`,
:meth:`~TakesTurns.turn_instruction`, :meth:`~TakesTurns.absorb_turn` and
:meth:`~TakesTurns.turns_ended`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.app import MetricRecord
from flwr.serverapp import Grid

from ...protocol import content_nbytes
from .messages import Instruction, Reply, train_losses
from .round_report import RoundCounters


class TakesTurns:
    """Turn-taking rounds for a :class:`~.strategy.ClusteredStrategy` (mixed in before it)."""

    turns_setting = "the strategy's rounds are turns"  # the setting that makes them turns, for messages

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

    # ---- on the grid -----------------------------------------------------------------------------------

    def play_round(self: Any, grid: Grid, server_round: int, timeout: float | None = None) -> tuple[MetricRecord, MetricRecord]:
        """Flower's round ``server_round``: as :meth:`~.strategy.ClusteredStrategy.play_round` where
        rounds are not turns; otherwise one exchange per turn, then the evaluation."""
        if not self.takes_turns():
            return super().play_round(grid, server_round, timeout)  # type: ignore[misc]
        absolute = server_round + self.round_offset
        counters = self.counters = RoundCounters(started=time.perf_counter())
        online = self.directory.online_clients(absolute, grid)
        self.messages.train_sizes = self.directory.train_sizes(self.setup.train_sizes)
        accepted: list[Reply] = []
        for pid in self.turn_order(absolute, online):
            messages = self.messages.make([self.turn_instruction(absolute, pid)], absolute, self.directory.node)
            counters.bytes_down += sum(content_nbytes(message.content) for message in messages)
            counters.fit_clients = tuple(sorted((*counters.fit_clients, pid)))
            for reply in self.checked_replies(absolute, grid.send_and_receive(messages, timeout=timeout)):
                self.absorb_turn(absolute, reply)
                accepted.append(reply)
        self.turns_ended(absolute)
        counters.train_loss = float(np.mean(losses)) if (losses := train_losses(accepted)) else float("nan")
        return self.train_metrics(len(accepted)), self.evaluate_round(grid, server_round, timeout)
