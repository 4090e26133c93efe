"""DAC: decentralized adaptive clustering by similarity-weighted gossip (Zec et al., "Decentralized
adaptive clustering of deep nets is beneficial for client collaboration"), PENS (Onoszko et al.,
"Decentralized federated learning of deep neural networks on non-iid data") and the gossip baselines.

Peer-to-peer learning, simulated through Flower: Flower has no peer-to-peer transport, so the
server is only a *relay*. It keeps every client's personal model as that client's mailbox, plus
the relay's state (similarities, who met whom); it never averages anything itself. Traffic is
counted as if peers sent models to each other: each participating client downloads its m
neighbours' models (and its own, from its mailbox) and uploads its new model.

Round 1, pretraining (``pretrain_epochs``; default ``client.epochs``, as the reference code
github.com/edvinli/DAC does before its first exchange; 0: none): every online client trains its
own model alone (task ``train``), so that the first exchange scores trained models, not untrained
ones whose losses are all about ln 10. A client that misses it (it failed, or joined later)
pretrains the first round it is online and is nobody's neighbour until then. Then each round, for
each participating client i (``client_fraction`` of the online, pretrained clients):

1. the relay samples m = ``num_neighbours`` other clients *without replacement*, with
   p_i = softmax(τ · s_i) over the others (never i itself; uniform while i knows nobody);
2. client i receives its own model and the m neighbour models, computes each neighbour model's
   loss on its *training* data, merges own + neighbours by FedAvg (weighted by sample counts),
   trains ``client.epochs`` local epochs and returns its model and the m losses (task
   ``gossip_train``);
3. the relay records s_ij = 1 / loss_ij for the sampled pairs. For pairs i, k never sampled it
   uses a two-hop estimate (``two_hop: false`` switches it off, the paper's "DAC −"):

   * ``two_hop_estimate: paper`` (the paper's text): among the clients j that i has met and that
     have *measured* k, the one most similar to i lends its similarity, s_ik = s_jk, recomputed
     from the measured similarities every round;
   * ``reference`` (the reference code's ``train_DAC``): after its exchange, i takes, for every k
     it has never sampled, the entry of k in the tables of *this round's* neighbours — measured or
     themselves estimated — from the neighbour most similar to i, and keeps it until overwritten.
     Estimates of estimates travel further than two hops. Clients update in partition-id order
     within a round (with ``round_order: sequential`` in the round's turn order, as the reference),
     each seeing the tables updated before it.

``round_order``: ``synchronous`` (default) instructs the round's clients at once, each merging its
neighbours' models as the round before left them. ``sequential`` is the reference code's round
(``utils.py`` ``train_DAC``, ``gossip``: the clients shuffled by ``np.random.choice``, each in turn
drawing its neighbours and averaging their *current* ``local_model`` s, this round's updates included,
then training): turns in an order drawn from the seed and the round (:mod:`..base.turns`: one message at
a time, on every engine). The paper's two-hop estimates are recomputed at the round's end in both orders.

``dac_var`` grows τ with the exchanges (``tau_schedule``; see :func:`.math.reference_tau` and
:func:`.math.centred_tau`); ``random_gossip`` samples neighbours uniformly; ``oracle_gossip`` only from
the client's true cluster; ``pens`` selects its neighbours by loss first (see :class:`.pens.PENS`).
``local`` (no communication) is the existing strategy.

Personal models start from different initialisations (the paper's setting) or, with
``same_init: true``, from one. Soft clusters are made comparable with the other strategies' by
clustering the relay's latest similarities, however old, into the true number of clusters
(``assignment``, hence purity/ARI in ``rounds.jsonl``). Whom the clients talk to is the paper's
Figure 4: ``communication.png`` (how often i sampled j, clients ordered by true cluster) and, per
true cluster, the share of its members' draws inside it (summary ``exchanges_same_true_cluster``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from ...types import NDArrays

from ... import protocol
from ...protocol import MODEL, MODELS, TRAIN
from . import tasks as gossip
from .tasks import GOSSIP_TRAIN
from ...plots import plot_client_matrix
from ...declarations.options import DeclaredOptions
from ...declarations.schema import Is, IsNot, LessThan, OnlyWith, at_least, join_key, option, require
from ..base.strategy import Artifacts, ClusteredStrategy, Instruction, Reply, StrategySetup
from ..base.options import SAME_MEANING, SHARE_OF_CLIENTS
from ..base.turns import TakesTurns
from ...registry import register
from .math import centred_tau, implied_clusters, reference_tau, reference_two_hop_update, same_true_cluster_share
from .math import SAME_CLUSTER_DRAWS, two_hop_similarities


MIN_LOSS = 1e-6  # a neighbour model with (numerically) zero loss scores s = 1e6, not infinity
TURN_ORDER_STREAM = 11  # the random stream of sequential rounds' client orders (seed, round, stream)
PRETRAIN_PHASE = "pretrain"


@dataclass(frozen=True)
class GossipOptions(DeclaredOptions):
    num_neighbours: int = option(5, at_least(1))
    client_fraction: float = option(1.0, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))
    same_init: bool = False
    # local epochs before the first exchange; null takes client.epochs, as the reference code does
    pretrain_epochs: int | None = option(None, at_least(0), note="0: no pretraining; null: client.epochs")
    # synchronous: every client merges the models of the round before; sequential: the reference code's
    # round, the clients one after another in a shuffled order, each merging its neighbours' current models
    round_order: Literal["synchronous", "sequential"] = "synchronous"

    experiment_rules = (
        LessThan("num_neighbours", "partition.num_clients", why="a client never samples itself"),
    )

    def check_experiment(self, config: Any, prefix: str) -> None:
        if self.pretrain_epochs != 0:  # round 1 only pretrains
            require(config.rounds >= 2, "rounds",
                    f"round 1 only pretrains ({prefix}.pretrain_epochs); give 2 or more, got {config.rounds}")


@dataclass(frozen=True)
class DACCommonOptions(GossipOptions):
    two_hop: bool = True
    two_hop_estimate: Literal["paper", "reference"] = "paper"

    rules = (
        OnlyWith(IsNot("two_hop_estimate", "paper"), Is("two_hop", True),
                 message="'{two_hop_estimate}' chooses how two-hop estimates are made, but two_hop is false"),
    )


@dataclass(frozen=True)
class DACOptions(DACCommonOptions):
    tau: float = option(30.0, at_least(0))


@dataclass(frozen=True)
class DACVarOptions(DACCommonOptions):
    tau_max: float = option(30.0, at_least(0))
    tau_schedule: Literal["reference", "centred"] = "reference"


@dataclass(frozen=True)
class PENSOptions(GossipOptions):
    num_kept: int = option(2, at_least(1))  # m: of the peers drawn in a selection round, the lowest-loss ones merged
    selection_rounds: int = option(10, at_least(1))
    # peers drawn per selection round; null: num_neighbours, as the DAC reference's PENS baseline
    # (utils.py train_pens draws n_sampled in both phases). Onoszko et al.'s own code draws
    # n_clients_to_consider = 20 (guskarls/dfl-pens main.py), keeps m = 2, then gossips with up to
    # n_neighbours = 20 of the kept (train_functions.py train_edu, phase 2).
    selection_candidates: int | None = option(None, at_least(1), note="null: num_neighbours")

    experiment_rules = (LessThan("selection_candidates", "partition.num_clients", why="a client never draws itself"),)

    def validate(self, prefix: str) -> None:
        drawn_key, drawn = (("selection_candidates", self.selection_candidates) if self.selection_candidates is not None
                            else ("num_neighbours", self.num_neighbours))
        require(self.num_kept <= drawn, join_key(prefix, "num_kept"),
                f"must be in 1..{drawn_key} ({drawn}): of the peers drawn, the ones kept; got {self.num_kept}")


class Gossip(TakesTurns, ClusteredStrategy):
    """Personal models exchanged between sampled neighbours through the relay; see the module docstring."""

    name = "gossip"
    Options = GossipOptions
    round_word = "gossip exchanges"
    phase_words = {PRETRAIN_PHASE: "local pretraining"}
    turns_setting = "strategy.round_order: sequential"

    def __init__(self, options: GossipOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        n = setup.num_clients
        self.client_models = {p: self._initial_model(p) for p in range(n)}
        self.models = {}
        self.similarity = np.full((n, n), np.nan)  # s_ij = 1 / loss of j's model on i's training data
        self.met = np.zeros((n, n), dtype=bool)
        self.communication = np.zeros((n, n), dtype=np.int64)  # how often i sampled j
        self.estimate = self.similarity  # the similarities neighbours are drawn by: measured (+ two-hop)
        self.num_true_clusters = len(np.unique(setup.true_clusters))
        self.pretrained = np.full(n, options.pretrain_epochs == 0)  # without pretraining, everyone is ready
        self.exchanges = 0  # exchange rounds so far (the first round that only pretrains is none)
        self.round_phase = self.name

    # ---- who meets whom ---------------------------------------------------------------------------

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        """Log-weights of ``candidates`` as ``pid``'s neighbours: p ∝ exp(score); −inf: never."""
        return np.zeros(len(candidates))

    def neighbour_count(self) -> int:
        """How many neighbours a client draws this round."""
        return self.options.num_neighbours

    def neighbours(self, server_round: int, pid: int) -> list[int]:
        """m online neighbours of ``pid`` sampled without replacement, p ∝ exp(:meth:`neighbour_scores`).

        Only online, pretrained clients are candidates: a client that has not joined or not
        pretrained yet holds an untrained model that would dilute the merge.

        Sequential sampling without replacement is the top m of score + Gumbel noise
        (Plackett-Luce), computed in log space: with a large τ the softmax weights of all but
        the best candidates underflow to 0, yet the m most similar are still drawn in turn.
        """
        candidates = np.array([p for p in self.online if p != pid and self.pretrained[p]], dtype=np.int64)
        scores = self.neighbour_scores(server_round, pid, candidates)
        allowed = np.isfinite(scores)
        count = min(self.neighbour_count(), int(allowed.sum()))
        keys = scores[allowed] + self.rng.gumbel(size=int(allowed.sum()))
        return [int(q) for q in candidates[allowed][np.argsort(-keys)[:count]]]  # continuous keys: no ties

    # ---- the round ---------------------------------------------------------------------------------

    @property
    def pretrain_epochs(self) -> int | None:
        """Epochs of pretraining sent to the clients (None: their own ``client.epochs``)."""
        return self.options.pretrain_epochs

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        unready, exchanging = self.participants(server_round, online)
        return [self.pretrain(p) for p in unready] + [self.exchange(server_round, p) for p in exchanging]

    def begin_round(self, server_round: int) -> None:
        """Before the round's participants are chosen."""

    def participants(self, server_round: int, online: list[int]) -> tuple[list[int], list[int]]:
        """This round's online clients that pretrain, and those that exchange (none in the first round:
        everyone pretrains, nobody exchanges yet); sets the round's phase."""
        self.begin_round(server_round)
        unready = [p for p in online if not self.pretrained[p]]
        if not self.pretrained.any():
            self.round_phase = PRETRAIN_PHASE
            return unready, []
        self.round_phase = self.exchange_phase()
        ready = [p for p in online if self.pretrained[p]]
        return unready, self.sample(ready, self.options.client_fraction)

    # ---- round_order: sequential (the reference code's round) --------------------------------------

    def takes_turns(self) -> bool:
        return self.options.round_order == "sequential"

    def turn_order(self, server_round: int, online: list[int]) -> list[int]:
        """The round's participants in a shuffled order drawn from the run's seed and the round (the
        reference: ``np.random.choice(range(n), n, replace=False)`` every round)."""
        unready, exchanging = self.participants(server_round, online)
        everyone = unready + exchanging
        shuffle = np.random.default_rng([self.setup.seed, server_round, TURN_ORDER_STREAM]).permutation(len(everyone))
        return [everyone[k] for k in shuffle]

    def turn_instruction(self, server_round: int, pid: int) -> Instruction:
        """Made when ``pid``'s turn comes: its neighbours are drawn then, and their models are the
        ones in their mailboxes then, this round's updates included."""
        return self.pretrain(pid) if not self.pretrained[pid] else self.exchange(server_round, pid)

    def pretrain(self, pid: int) -> Instruction:
        """``pid`` trains its own model alone before its first exchange."""
        config = {} if self.pretrain_epochs is None else {protocol.EPOCHS_KEY: int(self.pretrain_epochs)}
        return Instruction(pid, TRAIN, {MODEL: [self.client_models[pid]]}, config)

    def exchange(self, server_round: int, pid: int) -> Instruction:
        """``pid`` gets its own model and its sampled neighbours' (task gossip_train)."""
        chosen = self.neighbours(server_round, pid)
        sizes = self.setup.train_sizes
        config = {protocol.indexed(gossip.SAMPLES_KEY, j): int(sizes[q]) if sizes is not None else 1
                  for j, q in enumerate(chosen)} | self.exchange_config()
        models = [self.client_models[pid]] + [self.client_models[q] for q in chosen]
        return Instruction(pid, GOSSIP_TRAIN, {MODELS: models}, config, peers=tuple(chosen))

    def exchange_config(self) -> dict[str, int]:
        """Extra scalars of this round's gossip_train instructions."""
        return {}

    def exchange_phase(self) -> str:
        """Name of the current exchange round's phase."""
        return self.name

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        """A synchronous round: every reply as if its turn, then the round's end."""
        for reply in replies:
            self.absorb_turn(server_round, reply)
        self.turns_ended(server_round)

    def absorb_turn(self, server_round: int, reply: Reply) -> None:
        i = reply.pid
        self.client_models[i] = reply.model()
        if reply.task is TRAIN:
            self.pretrained[i] = True
            return
        peers = reply.instruction.peers
        losses = [float(reply.metrics[protocol.indexed(protocol.LOSS, j)])  # >= 0 by the task's schema
                  for j in range(len(peers))]
        for k, loss in zip(peers, losses):
            self.similarity[i, k] = 1.0 / max(loss, MIN_LOSS)
            self.met[i, k] = True
            self.communication[i, k] += 1
        self.after_exchange(i, peers, losses)

    def turns_ended(self, server_round: int) -> None:
        """The relay's round-end work: the similarity estimates and the implied clusters."""
        if self.round_phase != PRETRAIN_PHASE:
            self.exchanges += 1
        self.estimate = self.effective_similarity()
        if self.met.any():  # soft clusters made hard for the metrics
            self.assignment[:] = self.implied_clusters()

    def after_exchange(self, pid: int, neighbours: Sequence[int], losses: Sequence[float]) -> None:
        """What the relay learns from one client's exchange beyond s = 1/loss (replies in partition-id
        order; with sequential rounds, in turn order)."""

    def phase(self, server_round: int) -> str:
        return self.round_phase

    def effective_similarity(self) -> np.ndarray:
        """The measured similarities and, where a strategy estimates more, its estimates."""
        return self.similarity

    def implied_clusters(self) -> np.ndarray:
        """Soft clusters made hard for the metrics (``assignment``): :func:`.math.implied_clusters`."""
        return implied_clusters(self.estimate, self.num_true_clusters)

    # ---- records -----------------------------------------------------------------------------------

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return super().round_metrics(server_round) | {"pairs_met": int(self.met.sum()), "exchanges": self.exchanges}

    def summary_entries(self) -> dict[str, Any]:
        """Whom the clients drew (``exchanges_same_true_cluster``; see the module docstring)."""
        return super().summary_entries() | {
            SAME_CLUSTER_DRAWS: same_true_cluster_share(self.communication, self.setup.true_clusters),
        }

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "similarity": self.similarity, "met": self.met, "communication": self.communication,
            "pretrained": self.pretrained, "exchanges": self.exchanges,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.similarity = np.array(state["similarity"], dtype=float)
        self.met = np.array(state["met"], dtype=bool)
        self.communication = np.array(state["communication"], dtype=np.int64)
        self.pretrained = np.array(state["pretrained"], dtype=bool)
        self.exchanges = int(state["exchanges"])
        self.estimate = self.effective_similarity()

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Pretraining is round 1's work: a branch of a checkpoint can no longer change it."""
        return ("pretrain_epochs",)

    def artifacts(self) -> Artifacts:
        """``communication.npy`` / ``communication.png`` (how often i sampled j) and ``similarity.npy``."""
        counts = self.communication / max(int(self.communication.max()), 1)
        return {
            "communication.npy": self.communication,
            "similarity.npy": self.estimate,
            "communication.png": functools.partial(
                plot_client_matrix, counts, self.setup.true_clusters, self.setup.cluster_names,
                title=f"{self.name}: how often client i (row) sampled j", colour_label="share of the most frequent pair",
            ),
        }

    # ---- internals ---------------------------------------------------------------------------------

    def _initial_model(self, pid: int) -> NDArrays:
        """Client 0 and, with ``same_init``, every client start from the run's initial model."""
        if self.options.same_init or pid == 0:
            return self.initial_model()
        if self.setup.init_weights is None:
            raise ValueError(f"{self.name} needs StrategySetup.init_weights for different initialisations")
        return self.setup.init_weights(int(np.random.SeedSequence([self.setup.seed, pid, 7]).generate_state(1)[0]))


@register
class RandomGossip(Gossip):
    """Neighbours sampled uniformly (the paper's random baseline)."""

    name = "random_gossip"


@register
class OracleGossip(Gossip):
    """Neighbours sampled uniformly from the client's true cluster only."""

    name = "oracle_gossip"

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        true = self.setup.true_clusters
        return np.where(true[candidates] == true[pid], 0.0, -np.inf)


@register
class DAC(Gossip):
    """Neighbours sampled by softmax(τ · s_i) of the relay's similarities (with two-hop estimates)."""

    name = "dac"
    Options = DACOptions

    def __init__(self, options: DACCommonOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        # two_hop_estimate reference: one table per client of measured and estimated similarities, kept across rounds
        self.reference_table = self.similarity.copy()
        self.round_tau = self.tau(0)

    def tau(self, server_round: int) -> float:
        """τ of the draws of the round in progress (``exchanges`` is its 0-based exchange index
        until its replies are in)."""
        return self.options.tau

    def begin_round(self, server_round: int) -> None:
        self.round_tau = self.tau(server_round)  # recorded with the round (``rounds.jsonl``'s ``tau``)

    @property
    def reference_two_hop(self) -> bool:
        return self.options.two_hop and self.options.two_hop_estimate == "reference"

    def after_exchange(self, pid: int, neighbours: Sequence[int], losses: Sequence[float]) -> None:
        if self.reference_two_hop:
            self.reference_table[pid, list(neighbours)] = self.similarity[pid, list(neighbours)]
            reference_two_hop_update(self.reference_table, self.met, pid, neighbours)

    def effective_similarity(self) -> np.ndarray:
        if not self.options.two_hop:
            return self.similarity
        if self.reference_two_hop:
            return self.reference_table
        return two_hop_similarities(self.similarity, self.met)

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        """τ · s_i (p = softmax(τ · s_i)); a pair with no estimate scores s = 0 (uniform at the first exchange)."""
        return self.tau(server_round) * np.nan_to_num(self.estimate[pid, candidates], nan=0.0)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return super().round_metrics(server_round) | {"tau": self.round_tau}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"reference_table": self.reference_table}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reference_table = np.array(state["reference_table"], dtype=float)  # before the estimate is rebuilt
        super().load_state_dict(state)


@register
class DACVar(DAC):
    """DAC with τ grown over the exchanges (``tau_schedule``)."""

    name = "dac_var"
    Options = DACVarOptions

    def tau(self, server_round: int) -> float:
        """τ of the draws of the round in progress.

        * ``reference`` (the reference code's DAC_var): a client draws with the softmax weights it
          computed at the end of its previous exchange, so exchange e (0-based) draws with
          τ = :func:`reference_tau` (e − 1); the first exchange draws uniformly, nothing being known yet.
        * ``centred``: :func:`centred_tau` of the server round.
        """
        if self.options.tau_schedule == "centred":
            return centred_tau(server_round, self.options.tau_max, self.setup.rounds)
        return reference_tau(max(self.exchanges - 1, 0), self.options.tau_max)
