"""One-shot data-similarity clustering and hierarchical LPS/GPS training (Ali & Arafa,
"Data Similarity-Based One-Shot Clustering for Multi-Task Hierarchical Federated Learning").

The algorithm (``oneshot_hfl``):

1. Round 1 (task ``gram_eigen``): every client computes G = (1/n) Φ(X)ᵀΦ(X) of its training
   images and returns its top ``num_eigenvectors`` eigenvectors (and, with ``relevance: amiri``
   only, their eigenvalues).
2. Round 2 (task ``relevance``): every client receives all clients' eigenvectors (and
   eigenvalues) and returns its row of relevances r(i, ·) (eqs. 2–4): ``relevance: paper`` (the
   default) compares ‖G_i v_k^(j)‖ with client i's own k-th eigenvalue, as the paper's eq. 3 and
   Algorithm 2 do; ``amiri`` with client j's, as Amiri et al.'s original form (see
   :func:`~fedcluster_flwr.clustering.relevance_row`). The server forms R = (r + rᵀ)/2 (eq. 5) and clusters
   1 − R agglomeratively into ``num_clusters`` T (or cut at ``threshold``) — once, before any
   training.
3. Rounds 3..: one local parameter server (LPS) model per cluster, FedAvg over a fraction
   ``client_fraction`` of its members each round. Every ``lps_rounds`` training rounds the
   global parameter server (GPS) averages the layers named by ``shared_layers`` (parameter
   name prefixes, e.g. ``conv``) across the LPS models, weighted by each cluster's data size,
   and sends them back; the other layers stay per LPS. ``shared_layers: []`` is independent
   clustered FedAvg; every layer shared is one global model.

Baselines on the same code path: ``random_clusters`` (clients put in T clusters at random, the
paper's baseline) and ``oracle_hfl`` (the true tasks); both train from round 1.

A client absent from the one-shot phase (it failed, or joined later) joins the LPS whose
model has its lowest training loss, the first time it is online afterwards.

Communication: ``bytes_up``/``bytes_down`` are client↔LPS traffic (the one-shot rounds'
eigen-summaries and relevance rows included); ``bytes_gps`` counts LPS↔GPS traffic (each LPS
uploads its shared layers and downloads their average).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Literal

import numpy as np
from flwr.common import NDArrays, Scalar, log

from .. import protocol
from ..aggregation import average_layers
from ..clustering import HacResult, cluster_by_relevance, relevance_matrix, within_and_across
from ..features import check_weights_file, feature_dim
from ..models import model_outline, parameter_names, parameters_with_prefixes
from ..protocol import EIGENVALUES, EIGENVECTORS, GRAM_EIGEN, RELEVANCE, RELEVANCE_ROW
from ..results import plot_client_matrix, plot_dendrogram
from ..schema import ExactlyOne, Interval, Is, OnlyWith, RequiredWith, at_least, join_key, option, require
from .core import UNASSIGNED, ClusteredStrategy, Instruction, Reply, StrategySetup
from .options import CLUSTERS_FIT_CLIENTS, SHARE_OF_CLIENTS


EIGEN_PREFIX = "eigen"  # checkpoint names of the one-shot phase in progress: eigen<pid>, row<pid>
ROW_PREFIX = "row"


@dataclass(frozen=True)
class HFLOptions:
    """What every hierarchical variant shares: LPS sampling and the GPS's shared layers."""

    client_fraction: float = option(1.0, SHARE_OF_CLIENTS)  # of each LPS's members, per round
    lps_rounds: int = option(1, at_least(1))  # the GPS averages the shared layers every lps_rounds training rounds
    shared_layers: tuple[str, ...] = ()  # parameter-name prefixes, e.g. [conv]

    def check_experiment(self, config: Any, prefix: str) -> None:
        names = parameter_names(model_outline(config.model.name, config.input_shape, config.num_classes))
        parameters_with_prefixes(names, self.shared_layers, f"{prefix}.shared_layers")


@dataclass(frozen=True)
class RandomClustersOptions(HFLOptions):
    num_clusters: int = option(2, at_least(1))

    experiment_rules = (CLUSTERS_FIT_CLIENTS,)


@dataclass(frozen=True)
class OneShotOptions(HFLOptions):
    features: Literal["identity", "random_projection", "pretrained"] = "identity"
    feature_dim: int | None = option(None, at_least(1))  # random_projection only
    pretrained_weights: str | None = None  # pretrained only: a ResNet-18 state_dict on disk
    num_eigenvectors: int = option(5, at_least(1))
    relevance: Literal["paper", "amiri"] = "paper"  # eq. 3 with the client's own eigenvalue; amiri: with j's
    num_clusters: int | None = option(None, at_least(1))
    threshold: float | None = option(None, Interval(0, 1, closed="neither"))  # on 1 - R
    linkage: Literal["single", "complete", "average"] = "average"

    rules = (
        ExactlyOne("num_clusters", "threshold"),
        OnlyWith("feature_dim", Is("features", "random_projection")),
        RequiredWith("feature_dim", Is("features", "random_projection")),
        OnlyWith("pretrained_weights", Is("features", "pretrained")),
    )
    experiment_rules = (CLUSTERS_FIT_CLIENTS,)

    def validate(self, prefix: str) -> None:
        if self.features == "pretrained":  # the file must exist: nothing is downloaded
            check_weights_file(self.pretrained_weights, join_key(prefix, "pretrained_weights"))

    def check_experiment(self, config: Any, prefix: str) -> None:
        super().check_experiment(config, prefix)
        require(config.rounds > 2, "rounds", f"oneshot_hfl spends rounds 1-2 on clustering; give more than 2, got {config.rounds}")
        dim = feature_dim(self.features, config.input_shape, self.feature_dim)
        require(self.num_eigenvectors <= dim, f"{prefix}.num_eigenvectors",
                f"cannot exceed the {dim} features of {self.features}")


class HierarchicalFL(ClusteredStrategy):
    """LPS models per cluster with FedAvg inside; the GPS averages the shared layers across them."""

    name = "hfl"
    Options = HFLOptions

    def __init__(self, options: HFLOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.shared = self.parameter_indices(options.shared_layers, "strategy.shared_layers")
        self.clustered = False
        self.round_phase = "lps"  # of the round in progress, fixed when its instructions are made
        self.training_rounds = 0
        self.gps_bytes = 0  # this round's LPS<->GPS traffic
        self.gps_total = 0

    # ---- clustering (the subclass) ----------------------------------------------------------------

    def clustering_phase(self) -> str:
        """Name of the next round before the clusters exist."""
        raise NotImplementedError

    def clustering_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        """Instructions of a round before the clusters exist."""
        raise NotImplementedError

    def absorb_clustering(self, server_round: int, replies: list[Reply]) -> None:
        """Take a clustering round's replies; set ``clustered`` once the clusters exist."""
        raise NotImplementedError

    # ---- the round ---------------------------------------------------------------------------------

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        self.gps_bytes = 0
        self.round_phase = "lps" if self.clustered else self.clustering_phase()
        if not self.clustered:
            return self.clustering_instructions(server_round, online)
        newcomers = [p for p in online if self.assignment[p] == UNASSIGNED]
        return self.per_cluster_training(online, self.options.client_fraction) + [
            self.select_cluster(p) for p in newcomers
        ]

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        if self.round_phase != "lps":
            self.absorb_clustering(server_round, replies)
            return
        super().absorb(server_round, replies)
        self.training_rounds += 1

    def after_round(self, server_round: int) -> None:
        if self.round_phase == "lps" and self.shared and self.training_rounds % self.options.lps_rounds == 0:
            self.gps_step()

    def gps_step(self) -> None:
        """The GPS: cluster-size-weighted average of the shared layers across the LPS models."""
        sizes = self.cluster_data_sizes()
        live = {k: m for k, m in self.models.items() if sizes.get(k, 0) > 0}
        self.models.update(average_layers(live, sizes, self.shared))
        shared_bytes = sum(self.models[k][i].nbytes for k in live for i in self.shared)
        self.gps_bytes = 2 * shared_bytes  # up to the GPS and back, per LPS
        self.gps_total += self.gps_bytes

    def cluster_data_sizes(self) -> dict[int, float]:
        """Training samples per cluster (the clients' counts, or members where unknown)."""
        sizes: dict[int, float] = {}
        for pid, cluster in enumerate(self.assignment.tolist()):
            if cluster != UNASSIGNED:
                count = self.setup.train_sizes[pid] if self.setup.train_sizes is not None else 1
                sizes[cluster] = sizes.get(cluster, 0.0) + float(count)
        return sizes

    def phase(self, server_round: int) -> str:
        return self.round_phase

    def evaluation_model(self, pid: int) -> NDArrays:
        """The client's LPS model; a client not placed yet is evaluated on LPS 0's model."""
        cluster = int(self.assignment[pid])
        return self.models[cluster if cluster != UNASSIGNED else min(self.models)]

    def extra_round_metrics(self, server_round: int) -> dict[str, Any]:
        assigned = self.assignment[self.assignment != UNASSIGNED]
        return {
            "bytes_gps": self.gps_bytes,
            "cluster_sizes": np.bincount(assigned).tolist() if len(assigned) else [],
        }

    def extra_summary(self) -> dict[str, Any]:
        return {"bytes_gps": self.gps_total, "model_bytes": sum(a.nbytes for a in self.setup.initial_weights)}

    def extra_state(self) -> dict[str, Any]:
        return {"clustered": self.clustered, "training_rounds": self.training_rounds, "gps_total": self.gps_total}

    def restore_extra(self, models: Mapping[str, NDArrays], state: Mapping[str, Any]) -> None:
        self.clustered = bool(state["clustered"])
        self.round_phase = "lps" if self.clustered else self.round_phase
        self.training_rounds = int(state["training_rounds"])
        self.gps_total = int(state["gps_total"])


class RandomClusters(HierarchicalFL):
    """The paper's baseline: clients put in ``num_clusters`` clusters at random, then HFL."""

    name = "random_clusters"
    Options = RandomClustersOptions

    def __init__(self, options: RandomClustersOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        # Every cluster gets members: client i joins cluster i mod T, over a seeded shuffle.
        self.start_clusters(self.rng.permutation(np.arange(setup.num_clients) % options.num_clusters))
        self.clustered = True


class OracleHFL(HierarchicalFL):
    """HFL with the true tasks as clusters (the yardstick of perfect clustering)."""

    name = "oracle_hfl"
    Options = HFLOptions

    def __init__(self, options: HFLOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.start_clusters(setup.true_clusters)
        self.clustered = True


class OneShotHFL(HierarchicalFL):
    """Clusters from the clients' Gram-matrix eigenvectors in two rounds, then HFL."""

    name = "oneshot_hfl"
    Options = OneShotOptions

    def __init__(self, options: OneShotOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        if setup.input_shape is None:
            raise ValueError("oneshot_hfl needs StrategySetup.input_shape")
        self.dim = feature_dim(options.features, setup.input_shape, options.feature_dim)
        # pid -> [vectors (k, d)], + [values (k,)] with relevance amiri (the paper's users share no eigenvalues)
        self.summaries: dict[int, list[np.ndarray]] = {}
        self.rows: dict[int, np.ndarray] = {}
        self.relevance: np.ndarray | None = None
        self.clustered_pids: list[int] = []
        self.hac: HacResult | None = None
        self.clustering_round: int | None = None
        self.oneshot_bytes = {"up": 0, "down": 0}

    def feature_config(self) -> dict[str, Scalar]:
        opts = self.options
        return {
            protocol.FEATURES_KEY: opts.features,
            protocol.FEATURE_DIM_KEY: self.dim,
            protocol.FEATURE_SEED_KEY: self.setup.seed,
            protocol.PRETRAINED_WEIGHTS_KEY: opts.pretrained_weights or "",
            protocol.SHARE_EIGENVALUES_KEY: opts.relevance == "amiri",
        }

    def clustering_phase(self) -> str:
        return "relevance" if self.summaries else "gram_eigen"

    def clustering_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        config = self.feature_config()
        if not self.summaries:
            config[protocol.NUM_EIGENVECTORS_KEY] = self.options.num_eigenvectors
            return [Instruction(p, GRAM_EIGEN, {}, config) for p in online]
        summaries = [self.summaries[p] for p in sorted(self.summaries)]
        return [Instruction(p, RELEVANCE_ROW, {EIGENVECTORS: summaries}, config) for p in online if p in self.summaries]

    def absorb_clustering(self, server_round: int, replies: list[Reply]) -> None:
        self.oneshot_bytes["up"] += self.log.round.bytes_up
        self.oneshot_bytes["down"] += self.log.round.bytes_down
        needed = max(2, self.options.num_clusters or 2)
        if not self.summaries:
            for reply in replies:
                blocks = reply.blocks()
                self.summaries[reply.pid] = [*blocks[EIGENVECTORS], *blocks[EIGENVALUES]]  # no values unless shared
            if len(self.summaries) < needed:
                log(WARNING, "oneshot_hfl round %s: %d eigen-summaries, %d needed; asking again next round",
                    server_round, len(self.summaries), needed)
                self.summaries = {}
            return
        summarised = sorted(self.summaries)
        self.rows.update({r.pid: r.blocks()[RELEVANCE][0] for r in replies})
        responders = [p for p in summarised if p in self.rows]
        if len(responders) < needed:
            reachable = [p for p in summarised if p in self.online or p in self.rows]
            if len(reachable) < needed:  # the summarised clients alone can never make it: start over
                log(WARNING, "oneshot_hfl round %s: %d relevance rows, %d needed, too few summarised clients "
                    "online; the one-shot phase starts over next round", server_round, len(responders), needed)
                self.summaries, self.rows = {}, {}
            else:
                log(WARNING, "oneshot_hfl round %s: %d relevance rows, %d needed; asking again next round",
                    server_round, len(responders), needed)
            return
        columns = [summarised.index(p) for p in responders]
        self.relevance = relevance_matrix(np.stack([self.rows[p][columns] for p in responders]))
        self._cluster(server_round, responders)

    def _cluster(self, server_round: int, responders: list[int]) -> None:
        opts = self.options
        hac = cluster_by_relevance(self.relevance, opts.linkage, threshold=opts.threshold, num_clusters=opts.num_clusters)
        self.hac, self.clustered_pids, self.clustering_round = hac, responders, server_round
        assignment = np.full(self.setup.num_clients, UNASSIGNED)
        assignment[responders] = hac.labels
        self.assignment[:] = assignment
        self.models = {k: [a.copy() for a in self.setup.initial_weights] for k in range(hac.num_clusters)}
        self.clustered = True
        within, across = self.relevance_within_across()
        log(INFO, "oneshot_hfl round %s: %d clients -> %d clusters of sizes %s; mean R within true tasks %.3f, across %.3f",
            server_round, len(responders), hac.num_clusters, np.bincount(hac.labels).tolist(), within, across)
        self.write_artifacts()

    def relevance_within_across(self) -> tuple[float, float]:
        if self.relevance is None:
            return float("nan"), float("nan")
        return within_and_across(self.relevance, self.setup.true_clusters[self.clustered_pids])

    def extra_summary(self) -> dict[str, Any]:
        within, across = self.relevance_within_across()
        k, d = self.options.num_eigenvectors, self.dim
        return super().extra_summary() | {
            "clustering_round": self.clustering_round,
            "clusters_found": self.hac.num_clusters if self.hac is not None else None,
            "clustered_clients": self.clustered_pids,
            "relevance_within_true_clusters": within,
            "relevance_across_true_clusters": across,
            "oneshot_bytes_up": self.oneshot_bytes["up"],
            "oneshot_bytes_down": self.oneshot_bytes["down"],
            "relevance_rule": self.options.relevance,
            "eigen_summary_floats": k * d + (k if self.options.relevance == "amiri" else 0),  # per client, up; N times that down
        }

    def extra_state(self) -> dict[str, Any]:
        return super().extra_state() | {
            "clustered_pids": self.clustered_pids, "clustering_round": self.clustering_round,
            "oneshot_bytes": self.oneshot_bytes,
            "relevance": None if self.relevance is None else self.relevance.tolist(),
            "linkage": None if self.hac is None else self.hac.linkage.tolist(),
        }

    def extra_models(self) -> dict[str, NDArrays]:
        """The one-shot phase in progress: eigen-summaries and relevance rows received so far."""
        if self.clustered:
            return {}
        return ({f"{EIGEN_PREFIX}{p}": summary for p, summary in self.summaries.items()}
                | {f"{ROW_PREFIX}{p}": [row] for p, row in self.rows.items()})

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Once clustered, the clusters came from the data summaries and the cut."""
        if not state.get("clustered"):
            return ()
        return ("features", "feature_dim", "pretrained_weights", "num_eigenvectors", "relevance", "num_clusters",
                "threshold", "linkage")

    def restore_extra(self, models: Mapping[str, NDArrays], state: Mapping[str, Any]) -> None:
        super().restore_extra(models, state)
        self.clustered_pids = list(state["clustered_pids"])
        self.clustering_round = state["clustering_round"]
        self.oneshot_bytes = dict(state["oneshot_bytes"])
        if state["relevance"] is not None:
            self.relevance = np.asarray(state["relevance"])
        if state["linkage"] is not None:
            self.hac = HacResult(self.assignment[self.clustered_pids].copy(), np.asarray(state["linkage"]), np.zeros(0))
        for name, arrays in models.items():
            if name.startswith(EIGEN_PREFIX) and (pid := name.removeprefix(EIGEN_PREFIX)).isdigit():
                self.summaries[int(pid)] = list(arrays)
            elif name.startswith(ROW_PREFIX) and (pid := name.removeprefix(ROW_PREFIX)).isdigit():
                self.rows[int(pid)] = arrays[0]

    def write_artifacts(self) -> None:
        """``relevance.npy`` (R over ``clustered_clients``), ``similarity.png`` (R, clients ordered by
        true task, with the clusters found beside it) and ``dendrogram.png``."""
        if self.relevance is None:
            return
        run_dir = self.setup.recorder.run_dir
        np.save(run_dir / "relevance.npy", self.relevance)
        true = self.setup.true_clusters[self.clustered_pids]
        found = self.assignment[self.clustered_pids]
        plot_client_matrix(self.relevance, true, self.setup.cluster_names, run_dir / "similarity.png",
                           f"relevance R ({self.options.relevance} rule, {self.options.features}, "
                           f"k={self.options.num_eigenvectors}); strip: the {self.hac.num_clusters if self.hac else 0} clusters found",
                           "R", clients=self.clustered_pids, found=found)
        if self.hac is not None and len(self.hac.linkage):
            labels = [f"{p}:{t}" for p, t in zip(self.clustered_pids, true)]
            plot_dendrogram(self.hac.linkage, labels, self.options.threshold, run_dir / "dendrogram.png",
                            f"one-shot clustering of 1 - R ({self.options.linkage} linkage)")
