"""DAC: decentralized adaptive clustering by similarity-weighted gossip (Zec et al., "Decentralized
adaptive clustering of deep nets is beneficial for client collaboration"), and its baselines.

Peer-to-peer learning, simulated through Flower: Flower has no peer-to-peer transport, so the
server is only a *relay*. It keeps every client's personal model as that client's mailbox, plus
the relay's state (similarities, who met whom); it never averages anything itself. Traffic is
counted as if peers sent models to each other: each participating client downloads its m
neighbours' models (and its own, from its mailbox) and uploads its new model.

Each round, for each participating client i (``client_fraction`` of the online clients):

1. the relay samples m = ``num_neighbours`` other clients *without replacement*, with
   p_i = softmax(τ · s_i) over the others (never i itself; uniform while i knows nobody);
2. client i receives its own model and the m neighbour models, computes each neighbour model's
   loss on its *training* data, merges own + neighbours by FedAvg (weighted by sample counts),
   trains ``client.epochs`` local epochs and returns its model and the m losses (task
   ``gossip_train``);
3. the relay records s_ij = 1 / loss_ij for the sampled pairs. For pairs i, k never sampled it
   uses the two-hop approximation: among the clients j that i has met and that have met k, the
   one most similar to i lends its similarity, s_ik = s_jk (``two_hop: false`` switches it off,
   the paper's "DAC −" ablation).

``dac_var`` grows τ each round by a sigmoid schedule from about 0 to ``tau_max`` (the paper's
DAC-var); ``random_gossip`` samples neighbours uniformly; ``oracle_gossip`` only from the
client's true cluster. ``local`` (no communication) is the existing strategy.

Personal models start from different initialisations (the paper's setting) or, with
``same_init: true``, from one. Soft clusters are made comparable with the other strategies'
by agglomerative clustering of the similarity matrix into the true number of clusters
(``assignment``, hence purity/ARI in ``rounds.jsonl``); ``communication.png`` shows how often
i sampled j, clients ordered by true cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common import NDArrays

from .. import protocol
from ..clustering import cluster_square
from ..protocol import GOSSIP_TRAIN, MODELS
from ..results import plot_similarity
from ..schema import require
from .core import ClusteredStrategy, Instruction, Reply, StrategySetup
from .options import require_fraction


MIN_LOSS = 1e-6  # a neighbour model with (numerically) zero loss scores s = 1e6, not infinity


@dataclass(frozen=True)
class GossipOptions:
    num_neighbours: int = 5
    client_fraction: float = 1.0
    same_init: bool = False

    def validate(self, prefix: str) -> None:
        require(self.num_neighbours >= 1, f"{prefix}.num_neighbours", f"must be >= 1, got {self.num_neighbours}")
        require_fraction(self.client_fraction, f"{prefix}.client_fraction")

    def check_experiment(self, config: Any) -> None:
        require(self.num_neighbours < config.partition.num_clients, "strategy.num_neighbours",
                f"must be below partition.num_clients ({config.partition.num_clients}): a client never samples itself")


@dataclass(frozen=True)
class DACOptions(GossipOptions):
    tau: float = 30.0
    two_hop: bool = True

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        require(self.tau >= 0, f"{prefix}.tau", f"must be >= 0, got {self.tau}")


@dataclass(frozen=True)
class DACVarOptions(GossipOptions):
    tau_max: float = 30.0
    two_hop: bool = True

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        require(self.tau_max >= 0, f"{prefix}.tau_max", f"must be >= 0, got {self.tau_max}")


def two_hop_similarities(similarity: np.ndarray, met: np.ndarray) -> np.ndarray:
    """``similarity`` with each unknown entry (i, k) filled from i's most similar met neighbour j
    that has met k: s_ik = s_jk. Measured entries are kept; entries with no such j stay NaN."""
    filled = similarity.copy()
    for i in range(len(similarity)):
        known = np.flatnonzero(met[i])
        if not len(known):
            continue
        by_similarity = known[np.argsort(-similarity[i, known], kind="stable")]
        for k in np.flatnonzero(~met[i]):
            if k == i:
                continue
            lender = next((j for j in by_similarity if met[j, k] and j != k), None)
            if lender is not None:
                filled[i, k] = similarity[lender, k]
    return filled


class Gossip(ClusteredStrategy):
    """Personal models exchanged between sampled neighbours through the relay; see the module docstring."""

    name = "gossip"
    Options = GossipOptions

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

    # ---- who meets whom ---------------------------------------------------------------------------

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        """Log-weights of ``candidates`` as ``pid``'s neighbours: p ∝ exp(score); −inf: never."""
        return np.zeros(len(candidates))

    def neighbours(self, server_round: int, pid: int) -> list[int]:
        """m online neighbours of ``pid`` sampled without replacement, p ∝ exp(:meth:`neighbour_scores`).

        Only online clients are candidates: a client that has not joined yet holds an untrained
        model that would dilute the merge.

        Sequential sampling without replacement is the top m of score + Gumbel noise
        (Plackett-Luce), computed in log space: with a large τ the softmax weights of all but
        the best candidates underflow to 0, yet the m most similar are still drawn in turn.
        """
        candidates = np.array([p for p in self.online if p != pid], dtype=np.int64)
        scores = self.neighbour_scores(server_round, pid, candidates)
        allowed = np.isfinite(scores)
        count = min(self.options.num_neighbours, int(allowed.sum()))
        keys = scores[allowed] + self.rng.gumbel(size=int(allowed.sum()))
        return [int(q) for q in candidates[allowed][np.argsort(-keys, kind="stable")[:count]]]

    # ---- the round ---------------------------------------------------------------------------------

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        instructions = []
        sizes = self.setup.train_sizes
        for pid in self.sample(online, self.options.client_fraction):
            chosen = self.neighbours(server_round, pid)
            config = {protocol.indexed(protocol.SAMPLES_KEY, j): int(sizes[q]) if sizes is not None else 1
                      for j, q in enumerate(chosen)}
            models = [self.client_models[pid]] + [self.client_models[q] for q in chosen]
            instructions.append(Instruction(pid, GOSSIP_TRAIN, {MODELS: models}, config, clusters=tuple(chosen)))
        return instructions

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        for reply in replies:
            i = reply.pid
            self.client_models[i] = reply.model()
            for j, k in enumerate(reply.instruction.clusters):
                loss = float(reply.metrics[protocol.indexed(protocol.LOSS, j)])  # >= 0 by the task's schema
                self.similarity[i, k] = 1.0 / max(loss, MIN_LOSS)
                self.met[i, k] = True
                self.communication[i, k] += 1
        self.estimate = self.effective_similarity()

    def after_round(self, server_round: int) -> None:
        """Soft clusters made hard for the metrics: HAC of the similarity into the true number of clusters."""
        if self.met.any():
            self.assignment[:] = self.implied_clusters()

    def effective_similarity(self) -> np.ndarray:
        """The measured similarities and, where a strategy estimates more, its estimates."""
        return self.similarity

    def implied_clusters(self) -> np.ndarray:
        """Average-linkage clustering of the symmetrised similarity (as a distance: 1 / s, a loss),
        unknown pairs at the largest known distance."""
        loss = 1.0 / self.estimate  # NaN where unknown
        distance = np.where(np.isnan(loss), loss.T, np.where(np.isnan(loss.T), loss, (loss + loss.T) / 2))
        largest = float(np.nanmax(distance)) if np.isfinite(distance).any() else 1.0
        distance = np.nan_to_num(distance, nan=largest, posinf=largest)
        return cluster_square(distance, "average", num_clusters=self.num_true_clusters).labels

    # ---- records -----------------------------------------------------------------------------------

    def extra_round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"pairs_met": int(self.met.sum())}

    def extra_state(self) -> dict[str, Any]:
        return {"similarity": np.where(np.isnan(self.similarity), -1.0, self.similarity).tolist(),
                "met": self.met.tolist(), "communication": self.communication.tolist()}

    def restore_extra(self, models: Mapping[str, NDArrays], state: Mapping[str, Any]) -> None:
        similarity = np.asarray(state["similarity"], dtype=float)
        self.similarity = np.where(similarity < 0, np.nan, similarity)
        self.met = np.asarray(state["met"], dtype=bool)
        self.communication = np.asarray(state["communication"], dtype=np.int64)
        self.estimate = self.effective_similarity()

    def write_artifacts(self) -> None:
        """``communication.npy`` / ``communication.png`` (how often i sampled j) and ``similarity.npy``."""
        run_dir = self.setup.recorder.run_dir
        np.save(run_dir / "communication.npy", self.communication)
        np.save(run_dir / "similarity.npy", self.estimate)
        true = self.setup.true_clusters
        order = np.lexsort((np.arange(len(true)), true))
        counts = self.communication / max(int(self.communication.max()), 1)
        plot_similarity(counts, [f"{p}:{t}" for p, t in enumerate(true)], order, run_dir / "communication.png",
                        f"{self.name}: how often i (row) sampled j, scaled to the most frequent pair")

    # ---- internals ---------------------------------------------------------------------------------

    def _initial_model(self, pid: int) -> NDArrays:
        """Client 0 and, with ``same_init``, every client start from the run's initial model."""
        if self.options.same_init or pid == 0:
            return [a.copy() for a in self.setup.initial_weights]
        if self.setup.init_weights is None:
            raise ValueError(f"{self.name} needs StrategySetup.init_weights for different initialisations")
        return self.setup.init_weights(int(np.random.SeedSequence([self.setup.seed, pid, 7]).generate_state(1)[0]))


class RandomGossip(Gossip):
    """Neighbours sampled uniformly (the paper's random baseline)."""

    name = "random_gossip"


class OracleGossip(Gossip):
    """Neighbours sampled uniformly from the client's true cluster only."""

    name = "oracle_gossip"

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        true = self.setup.true_clusters
        return np.where(true[candidates] == true[pid], 0.0, -np.inf)


class DAC(Gossip):
    """Neighbours sampled by softmax(τ · s_i) of the relay's similarities (with two-hop estimates)."""

    name = "dac"
    Options = DACOptions

    def tau(self, server_round: int) -> float:
        return self.options.tau

    def effective_similarity(self) -> np.ndarray:
        if not self.options.two_hop:
            return self.similarity
        return two_hop_similarities(self.similarity, self.met)

    def neighbour_scores(self, server_round: int, pid: int, candidates: np.ndarray) -> np.ndarray:
        """τ · s_i (p = softmax(τ · s_i)); a pair with no estimate scores s = 0 (uniform at round 1)."""
        return self.tau(server_round) * np.nan_to_num(self.estimate[pid, candidates], nan=0.0)

    def extra_round_metrics(self, server_round: int) -> dict[str, Any]:
        return super().extra_round_metrics(server_round) | {"tau": self.tau(server_round)}


class DACVar(DAC):
    """DAC with τ grown by a sigmoid from about 0 (round 1) to ``tau_max`` (the last round)."""

    name = "dac_var"
    Options = DACVarOptions

    def tau(self, server_round: int) -> float:
        """τ_t = tau_max · σ((t − T/2) / (T/10)): ≈ 0.7 % of tau_max at t = 0, its half at T/2."""
        rounds = self.setup.rounds
        return self.options.tau_max / (1.0 + math.exp(-(server_round - rounds / 2) / max(rounds / 10, 1e-9)))
