"""PENS (Onoszko et al., "Decentralized federated learning of deep neural networks on non-iid
data"), the DAC paper's baseline: performance-based neighbour selection, then gossip."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...registry import register
from ..base.strategy import StrategySetup
from .math import same_true_cluster_share
from .strategy import Gossip, PENSOptions
from . import tasks as gossip
from ...aggregation import lowest

@register
class PENS(Gossip):
    """PENS (Onoszko et al., 2021): performance-based neighbour selection, then gossip.

    * Selection (the first ``selection_rounds`` exchange rounds): each participating client draws
      n = ``num_neighbours`` peers uniformly, measures their models' loss on its training data and
      merges only the m = ``num_kept`` of lowest loss with its own (``merge_lowest``); the relay
      counts how often i kept j.
    * Then i gossips only with the peers it kept more often than expected by chance: more than
      (m / N) · ``selection_rounds`` times, N the number of clients (the reference code's
      ``train_pens`` + ``gossip``). Each round it draws min(n, its kept set) of them uniformly
      and merges them all.

    **Which PENS this is**: the PENS *baseline of the DAC paper*, as the DAC reference code runs it
    (github.com/edvinli/DAC utils.py ``train_pens``, then main_fed.py's kept-set threshold
    ``(top_m / num_clients) · n_rounds_pens`` and ``gossip``). Choices taken from it: the same n in
    both phases (unless ``selection_candidates``); the threshold counts N with every client (online
    or not) and the nominal number of selection rounds, also for a client that missed some; a
    client whose kept set is empty (e.g. one that joined after the selection) trains alone, as the
    reference's ``gossip`` does with no neighbours. n = 5 (the DAC paper's five per round), m = 2
    and 10 selection rounds (options.py ``--top_m 2``, ``--n_rounds_pens 10`` at its commit bbe3c08).

    How Onoszko et al.'s own code (github.com/guskarls/dfl-pens: train_utils.py
    ``clients_to_communicate_with``, ``performance_based`` + ``greedy``; train_functions.py
    ``train_edu``) differs:

    * n: it scores ``n_clients_to_consider`` = 20 random peers per selection round and keeps the
      m = ``n_neighbours`` = 2 best; afterwards (``train_edu``'s second phase sets ``n_neighbours =
      20``) it gossips with up to 20 of the kept ones per round, as many as there are below that.
      This changes the selection materially (a 20-client cluster among 100 sees at least two of its
      own among 5 candidates in 24 % of the rounds, among 20 in 94 %: hypergeometric), so it is an
      option here: ``selection_candidates: 20``, ``num_kept: 2``, ``num_neighbours: 20`` (capped at
      the kept set's size, as there).
    * direction: it evaluates client i's *own* model on candidate j's training data (ours and the
      DAC reference: j's model on i's data). Not an option: here a client holds only its own data,
      so it would need a task in which j scores i's model; documented instead.
    * metric: accuracy by default (``--neighbour_selection_metric acc``; 1/(loss + 1e-5) optional);
      ours the loss (the DAC reference's). Not an option (the reply carries losses only).
    * 20 selection rounds (``train_edu`` sets ``n_comrounds = 20``): ``selection_rounds: 20``.
    * its cut-off ("above_average") is count > m · rounds / (N − 1) − 1, ours count > (m / N) ·
      rounds; at m = 2, N = 100 both keep every peer kept at least once for up to 49 rounds.
    * it averages the kept models with equal weights (ours by sample counts, equal here).
    """

    name = "pens"
    phase_words = {**Gossip.phase_words, "pens_selection": "PENS neighbour selection",
                   "pens_gossip": "gossip with the kept neighbours"}
    Options = PENSOptions

    def __init__(self, options: PENSOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        n = setup.num_clients
        self.kept_counts = np.zeros((n, n), dtype=np.int64)  # how often i kept j in the selection rounds
        self.neighbour_sets = np.zeros((n, n), dtype=bool)  # after the selection: whom i gossips with

    @property
    def selecting(self) -> bool:
        return self.exchanges < self.options.selection_rounds

    def exchange_phase(self) -> str:
        return "pens_selection" if self.selecting else "pens_gossip"

    def exchange_config(self) -> dict[str, int]:
        return {gossip.MERGE_LOWEST_KEY: self.options.num_kept} if self.selecting else {}

    def neighbour_count(self) -> int:
        candidates = self.options.selection_candidates
        return candidates if self.selecting and candidates is not None else self.options.num_neighbours

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        if self.selecting:
            return np.zeros(len(candidates))
        return np.where(self.neighbour_sets[pid, candidates], 0.0, -np.inf)

    def after_exchange(self, pid: int, neighbours: Sequence[int], losses: Sequence[float]) -> None:
        if self.round_phase == "pens_selection":  # the client merged these: the same rule, on the same losses
            for j in lowest(losses, self.options.num_kept):
                self.kept_counts[pid, neighbours[j]] += 1

    def turns_ended(self, server_round: int) -> None:
        super().turns_ended(server_round)
        if self.round_phase == "pens_selection" and not self.selecting:  # the last selection round
            expected = self.options.num_kept / self.setup.num_clients * self.options.selection_rounds
            self.neighbour_sets = self.kept_counts > expected

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        sizes = self.neighbour_sets.sum(axis=1)
        return super().round_metrics(server_round) | {"mean_neighbour_set": float(sizes.mean())}

    def summary_entries(self) -> dict[str, Any]:
        """Whom each client gossips with after the selection (``neighbour_sets``: partition ids per
        client) and, per true cluster, the share of its members' kept peers that are of the same
        true cluster: how well the loss-based selection found each client's own cluster."""
        return super().summary_entries() | {
            "neighbour_sets": [np.flatnonzero(row).tolist() for row in self.neighbour_sets],
            "neighbour_set_same_true_cluster": same_true_cluster_share(self.neighbour_sets, self.setup.true_clusters),
        }

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"kept_counts": self.kept_counts, "neighbour_sets": self.neighbour_sets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.kept_counts = np.array(state["kept_counts"], dtype=np.int64)
        self.neighbour_sets = np.array(state["neighbour_sets"], dtype=bool)

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Once a selection round ran, its n, m and length shaped the counts."""
        selection = ("num_kept", "selection_rounds", "selection_candidates") if state.get("exchanges", 0) >= 1 else ()
        return super().options_fixed_by(state) + selection
