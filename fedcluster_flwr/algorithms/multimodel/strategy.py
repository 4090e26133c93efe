"""Multi-model clustered FL: IFCA (Ghosh et al., 2020) and the joint gradient-and-loss
clustering of Lin et al. (2023, "gradloss").

The algorithm, with K cluster models w_1..w_K (Lin et al., Algorithm 1):

1. (Optional) rounds 1..``warmup_rounds``: FedAvg of one model; then every cluster model
   starts from it plus seeded Gaussian noise of scale ``warmup_noise`` (the K models must
   differ, or every client picks the first). Without a warm-up the K models are initialised
   with K different seeds.
2. Every round (iteration t) a fraction ``client_fraction`` of *all* online clients is sampled
   (Lin et al.: all of them, ``client_fraction: 1``). Each receives all K models (line 3) and,
   for gradloss, each cluster's update of the previous iteration, Δw_k^{t−1} = w_k^t − w_k^{t−1}
   (eq. 2: the mean update of cluster k's devices; 0 for a cluster nobody updated, which
   scores S = 0). On its *training* data — all of it, or a seeded mini-batch Z of
   ``selection_batch`` samples — it computes each model's loss L_k (eq. 1, ``loss_reduction``
   sum or mean) and, for gradloss, S_k = cos(−∇L_k, Δw_k) (eq. 3), and picks its identity
   s = argmax_k λ·S_k − (1−λ)·L_k (eq. 4; IFCA and λ = 0: argmin_k L_k).
3. It updates the chosen model (client task ``train_select``), by ``local_update``:
   ``one_step``: w_s − lr·∇L_s(Z), the gradient already taken (eq. 5, the paper's setting;
   IFCA's "gradient averaging"); ``epochs``: ``client.epochs`` of local SGD on all its data
   (IFCA's "model averaging", the practical setting).
4. The server averages the returned models per identity (sample-weighted FedAvg; with
   ``one_step`` every weight is |Z|); a cluster nobody chose keeps its model.
5. ``cluster_guard`` keeps clusters from emptying: ``one_per_cluster`` (Lin et al., §II-C)
   forces K random sampled devices, one to each cluster, every iteration; ``reseed_empty``
   gives a cluster that no client holds one random sampled client in the next round. A forced
   client receives only its cluster's model, updates it as in 3 and holds that identity for
   the round (``forced_clients`` in ``rounds.jsonl``).
6. Evaluation: every client uses the model of its latest identity. A client that has never
   been sampled is asked once, in the first round after the warm-up, which model fits its
   training data (task ``select``: the same rule, no update), so that it too is evaluated
   on its own cluster's model from the start.

Cost: each sampled client downloads K models (2K for gradloss); ``bytes_down`` counts them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from ...types import NDArrays, Scalar

from ... import protocol
from ...protocol import MODEL, MODELS, TRAIN, Task
from ..base import selection
from ..base.selection import DIRECTIONS, SELECT, TRAIN_SELECT
from ...declarations.options import DeclaredOptions
from ...declarations.schema import Interval, LessThan, above, at_least, option, require
from ..base.strategy import UNASSIGNED, ClusteredStrategy, Instruction, Reply, StrategySetup
from ..base.options import SAME_MEANING, CLUSTERS_FIT_CLIENTS, SHARE_OF_CLIENTS
from ...registry import register


@dataclass(frozen=True)
class IFCAOptions(DeclaredOptions):
    """IFCA's options (the gradloss options add ``lambda``)."""

    num_clusters: int = option(4, at_least(1), roles=(SAME_MEANING,))
    client_fraction: float = option(0.1, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))
    selection_batch: int | None = option(None, at_least(1), note="null: all training samples")  # samples the K losses are taken on
    loss_reduction: Literal["mean", "sum"] = "mean"
    local_update: Literal["epochs", "one_step"] = "epochs"
    cluster_guard: Literal["none", "reseed_empty", "one_per_cluster"] = "none"
    warmup_rounds: int = option(0, at_least(0))
    warmup_noise: float = option(0.01, above(0))

    experiment_rules = (
        CLUSTERS_FIT_CLIENTS,
        LessThan("warmup_rounds", "rounds", why="warm-up must leave rounds for clustering"),
    )

    def check_experiment(self, config: Any, prefix: str) -> None:
        if self.cluster_guard == "one_per_cluster":
            sampled = max(1, math.floor(self.client_fraction * config.partition.num_clients + 1e-9))
            require(sampled >= self.num_clusters, f"{prefix}.cluster_guard",
                    f"one_per_cluster forces one sampled client into each of the {self.num_clusters} clusters, "
                    f"but client_fraction {self.client_fraction} samples only {sampled}")
        if self.local_update == "one_step":
            client = config.client
            require(client.optimizer == "sgd" and client.momentum == 0 and client.weight_decay == 0, f"{prefix}.local_update",
                    "one_step takes one plain gradient step with client.lr: it needs client.optimizer sgd with "
                    f"momentum 0 and weight_decay 0 (got {client.optimizer}, momentum {client.momentum}, "
                    f"weight_decay {client.weight_decay})")

    def selection_config(self) -> dict[str, Scalar]:
        return {
            selection.SELECTION_BATCH_KEY: self.selection_batch or 0,
            selection.LOSS_REDUCTION_KEY: self.loss_reduction,
            selection.LOCAL_UPDATE_KEY: self.local_update,
        }


@dataclass(frozen=True)
class GradLossOptions(IFCAOptions):
    """Lin et al.: the paper's loss is a *sum* over a mini-batch, so the defaults take one."""

    selection_batch: int | None = option(50, at_least(1), note="null: all training samples")
    loss_reduction: Literal["mean", "sum"] = "sum"
    lambda_: float = option(0.2, Interval(0, 1), key="lambda")

    def selection_config(self) -> dict[str, Scalar]:
        return super().selection_config() | {selection.LAMBDA_KEY: self.lambda_}


def score_spreads(replies: list[Reply], num_models: int) -> dict[str, float]:
    """Mean over clients of max_k − min_k of the losses L_k and (gradloss) the similarities S_k
    they reported: how much each term of λ·S − (1−λ)·L can move a client's choice."""
    spreads: dict[str, float] = {}
    for metric, key in ((protocol.LOSS, "mean_loss_spread"), (selection.SIMILARITY, "mean_similarity_spread")):
        values = [[float(r.metrics[protocol.indexed(metric, k)]) for k in range(num_models)]
                  for r in replies if protocol.indexed(metric, 0) in r.metrics]
        finite = [np.ptp(v) for v in values if np.all(np.isfinite(v))]
        if finite:
            spreads[key] = float(np.mean(finite))
    return spreads


@register
class IFCA(ClusteredStrategy):
    """K cluster models; sampled clients pick theirs by training loss, train it, FedAvg per identity."""

    name = "ifca"
    Options = IFCAOptions
    sends_directions = False

    def __init__(self, options: IFCAOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.assignment[:] = UNASSIGNED
        if options.warmup_rounds == 0:
            self.models = {k: self._seeded_model(k) for k in range(options.num_clusters)}
        self.directions: dict[int, NDArrays] = {}
        self.no_direction = [np.zeros_like(a) for a in setup.initial_weights]  # before a cluster's first update
        self.asked: set[int] = set()  # clients that have reported an identity at least once
        self.to_reseed: list[int] = []  # reseed_empty: clusters nobody held after the last round
        self.forced: dict[int, int] = {}  # cluster -> the client the guard gives it, this round
        self.identity_changes = 0
        self.spreads: dict[str, float] = {}  # this round's mean spread of the clients' scores

    # ---- the round -----------------------------------------------------------------------------

    def phase(self, server_round: int) -> str:
        return "warmup" if server_round <= self.options.warmup_rounds else self.name

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        sampled = self.sample(online, self.options.client_fraction)
        if server_round <= self.options.warmup_rounds:
            return [Instruction(p, TRAIN, {MODEL: [self.models[0]]}, clusters=(0,)) for p in sampled]
        if len(self.models) < self.options.num_clusters:  # the first round after the warm-up
            self._spawn_from_warmup()
        guarded = list(range(self.options.num_clusters)) if self.options.cluster_guard == "one_per_cluster" else self.to_reseed
        givers = self.rng.permutation(sampled)[: len(guarded)].tolist()
        self.forced = {cluster: int(pid) for cluster, pid in zip(guarded, givers)}
        forced_to = {pid: cluster for cluster, pid in self.forced.items()}
        instructions = [
            self.identify(p, TRAIN_SELECT, (forced_to[p],)) if p in forced_to else self.identify(p, TRAIN_SELECT)
            for p in sampled
        ]
        never_asked = [p for p in online if p not in self.asked and p not in sampled]
        return instructions + [self.identify(p, SELECT) for p in never_asked]

    def identify(self, pid: int, task: Task, clusters: tuple[int, ...] | None = None) -> Instruction:
        """``pid`` scores the models of ``clusters`` (default: all; ``task`` ``train_select`` also
        updates the best). One cluster is the guard's forcing: the client updates that model."""
        clusters = tuple(sorted(self.models)) if clusters is None else clusters
        blocks: dict[str, list[NDArrays]] = {MODELS: [self.models[k] for k in clusters]}
        if self.sends_directions:
            blocks[DIRECTIONS] = [self.directions.get(k, self.no_direction) for k in clusters]
        return Instruction(pid, task, blocks, self.options.selection_config(), clusters=clusters)

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        opts = self.options
        if server_round <= opts.warmup_rounds:
            if replies:
                self.models[0] = self.average(replies)
            return
        previous = self.assignment.copy()
        self.join_chosen_clusters(replies)
        self.asked.update(r.pid for r in replies)
        forced_pids = set(self.forced.values())
        chose = [r for r in replies if r.pid not in forced_pids]
        self.identity_changes = sum(
            1 for r in chose if previous[r.pid] != UNASSIGNED and previous[r.pid] != self.assignment[r.pid]
        )
        self.spreads = score_spreads(chose, len(self.models))
        before = dict(self.models)
        self.aggregate_clusters([r for r in replies if MODEL in r.task.reply])
        if self.sends_directions:
            # Lin et al., eq. 2: Δw_k^t is the mean update of cluster k's devices in iteration t;
            # a cluster nobody updated has Δw_k = 0 (S_k = 0), not its last, stale direction.
            self.directions = {
                k: [new - old for new, old in zip(model, before[k])]
                for k, model in self.models.items() if model is not before[k]
            }
        held = set(self.assignment[self.assignment != UNASSIGNED].tolist())
        empty = [k for k in sorted(self.models) if k not in held]
        self.to_reseed = empty if opts.cluster_guard == "reseed_empty" and held else []

    # ---- records ---------------------------------------------------------------------------------

    def cluster_sizes(self) -> list[int]:
        """Clients holding each identity (the latest each reported)."""
        assigned = self.assignment[self.assignment != UNASSIGNED]
        return np.bincount(assigned, minlength=len(self.models)).tolist() if len(assigned) else [0] * len(self.models)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return {
            "cluster_sizes": self.cluster_sizes(),
            "identity_changes": self.identity_changes,
            "identified_clients": int((self.assignment != UNASSIGNED).sum()),
            "forced_clients": {str(k): p for k, p in self.forced.items()},
            **self.spreads,
        }

    def summary_entries(self) -> dict[str, Any]:
        return {"cluster_sizes": self.cluster_sizes()}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "directions": self.directions,
            "asked": sorted(self.asked),
            "to_reseed": self.to_reseed,
            "identity_changes": self.identity_changes,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.directions = {int(k): list(d) for k, d in state["directions"].items()}
        self.asked = set(state["asked"])
        self.to_reseed = list(state["to_reseed"])
        self.identity_changes = int(state["identity_changes"])

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """The K cluster models exist from the start (or the warm-up's end)."""
        return ("num_clusters",)

    # ---- internals -------------------------------------------------------------------------------

    def _seeded_model(self, cluster: int) -> NDArrays:
        """Cluster 0 starts from the run's initial model, cluster k from seed (run seed, k)."""
        if cluster == 0:
            return self.initial_model()
        if self.setup.init_weights is None:
            raise ValueError(f"{self.name} needs StrategySetup.init_weights to initialise {self.options.num_clusters} models")
        seed = int(np.random.SeedSequence([self.setup.seed, cluster]).generate_state(1)[0])
        return self.setup.init_weights(seed)

    def _spawn_from_warmup(self) -> None:
        warm = self.models[0]
        noise = np.random.default_rng([self.setup.seed, self.options.warmup_rounds])
        self.models = {
            k: [(a + noise.normal(scale=self.options.warmup_noise, size=a.shape)).astype(a.dtype) for a in warm]
            for k in range(self.options.num_clusters)
        }


@register
class GradLoss(IFCA):
    """Lin et al.: identity by λ·cos(−∇L_k, Δw_k) − (1−λ)·L_k; sends each cluster's last update."""

    name = "gradloss"
    Options = GradLossOptions
    sends_directions = True
