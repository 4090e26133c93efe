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
   :func:`~fedcluster_flwr.clustering.relevance_row`; each ratio of eq. 3 is guarded by
   ``eigen_floor`` × the largest eigenvalue compared). The server forms R = (r + rᵀ)/2 (eq. 5) and clusters
   1 − R agglomeratively into ``num_clusters`` T (or cut at ``threshold``; given neither, where the
   silhouette is largest) — once, before any training.
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
eigen-summaries and relevance rows included; ``bytes_by_phase`` in ``summary.json`` splits them by
phase, ``gram_eigen`` and ``relevance`` being the one-shot clustering's cost); ``bytes_gps``
counts LPS↔GPS traffic (each LPS uploads its shared layers and downloads their average).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Literal

import numpy as np
from flwr.common import log

from ...types import Scalar
from ...aggregation import average_layers
from ...clustering import ClusteringRecord, cut_rule
from .math import RELEVANCE_FLOOR, cluster_by_relevance, relevance_matrix, within_and_across
from ...features import check_weights_file, feature_dim
from ...models import model_outline, parameter_names, parameters_with_prefixes
from ...protocol import MODEL
from . import tasks as oneshot
from .tasks import EIGENVALUES, EIGENVECTORS, GRAM_EIGEN, RELEVANCE, RELEVANCE_ROW
from ...plots import plot_client_matrix
from ...declarations.options import DeclaredOptions
from ...declarations.schema import AtMostOne, Interval, Is, NoMoreThan, OnlyWith, RequiredWith, at_least, join_key, option, require
from ..base.strategy import UNASSIGNED, Artifacts, ClusteredStrategy, Instruction, Reply, StrategySetup
from ..base.options import SAME_MEANING, CLUSTERS_FIT_CLIENTS, SHARE_OF_CLIENTS
from ...registry import register


@dataclass(frozen=True)
class HFLOptions(DeclaredOptions):
    """What every hierarchical variant shares: LPS sampling and the GPS's shared layers."""

    client_fraction: float = option(1.0, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))  # of each LPS's members, per round
    lps_rounds: int = option(1, at_least(1))  # the GPS averages the shared layers every lps_rounds training rounds
    shared_layers: tuple[str, ...] = ()  # parameter-name prefixes, e.g. [conv]

    def check_experiment(self, config: Any, prefix: str) -> None:
        names = parameter_names(model_outline(config.model.name, config.input_shape, config.num_classes))
        parameters_with_prefixes(names, self.shared_layers, f"{prefix}.shared_layers")


@dataclass(frozen=True)
class RandomClustersOptions(HFLOptions):
    num_clusters: int = option(2, at_least(1), roles=(SAME_MEANING,))

    experiment_rules = (CLUSTERS_FIT_CLIENTS,)


@dataclass(frozen=True)
class FeatureMapOptions(DeclaredOptions):
    """The feature map Φ the clients summarise their data with (see :mod:`fedcluster_flwr.features`);
    shared by every one-shot data-similarity strategy (oneshot_hfl, pacfl)."""

    features: Literal["identity", "random_projection", "pretrained"] = "identity"
    feature_dim: int | None = option(None, at_least(1))  # random_projection only
    pretrained_weights: str | None = None  # pretrained only: a ResNet-18 state_dict on disk

    rules = (
        OnlyWith("feature_dim", Is("features", "random_projection")),
        RequiredWith("feature_dim", Is("features", "random_projection")),
        OnlyWith("pretrained_weights", Is("features", "pretrained")),
    )
    experiment_rules = (NoMoreThan("feature_dim", "input_size", message="cannot exceed the model input's size C·H·W "
                                   "({bound}): a random projection reduces the inputs' dimension; got {feature_dim}"),)

    def validate(self, prefix: str) -> None:
        if self.features == "pretrained":  # the file must exist: nothing is downloaded
            check_weights_file(self.pretrained_weights, join_key(prefix, "pretrained_weights"))


def feature_config(options: FeatureMapOptions, dim: int, seed: int, share_eigenvalues: bool) -> dict[str, Scalar]:
    """The ``gram_eigen`` / ``relevance`` instruction's description of Φ (every client draws the same
    random projection from ``seed``) and whether the eigenvalues travel with the eigenvectors."""
    return {
        oneshot.FEATURES_KEY: options.features,
        oneshot.FEATURE_DIM_KEY: dim,
        oneshot.FEATURE_SEED_KEY: seed,
        oneshot.PRETRAINED_WEIGHTS_KEY: options.pretrained_weights or "",
        oneshot.SHARE_EIGENVALUES_KEY: share_eigenvalues,
    }


@dataclass(frozen=True)
class OneShotOptions(FeatureMapOptions, HFLOptions):
    num_eigenvectors: int = option(5, at_least(1))
    relevance: Literal["paper", "amiri"] = "paper"  # eq. 3 with the client's own eigenvalue; amiri: with j's
    # ε of eq. 3's ratio (min + ε) / (max + ε), relative to the largest eigenvalue compared
    # (clustering.relevance_row). Ours, not the paper's: the paper only warns that tiny eigenvalues
    # make the ratio unstable; 0 is eq. 3 unguarded. benchmarks/oneshot/README.md measures its effect.
    eigen_floor: float = option(RELEVANCE_FLOOR, Interval(0, 1, closed="left"),
                                note="a share of the largest eigenvalue compared; 0: eq. 3 unguarded")
    num_clusters: int | None = option(None, at_least(1), roles=(SAME_MEANING,))
    threshold: float | None = option(None, Interval(0, 1, closed="neither"))  # on 1 - R
    linkage: Literal["single", "complete", "average"] = "average"

    rules = (AtMostOne("num_clusters", "threshold"),)
    experiment_rules = (CLUSTERS_FIT_CLIENTS,)

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
    training_phase = "lps"  # the name of the rounds after the clustering
    phase_words = {"gram_eigen": "clients send data summaries", "relevance": "clients send relevance rows",
                   "lps": "training per cluster"}

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

    def absorb_clustering(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        """Take a clustering round's replies; set ``clustered`` once the clusters exist."""
        raise NotImplementedError

    # ---- the round ---------------------------------------------------------------------------------

    def training_instructions(self, online: list[int]) -> list[Instruction]:
        """Instructions of a round after the clustering: each LPS samples ``client_fraction`` of its
        online members; a client without a cluster picks the LPS model with its lowest training loss."""
        return self.per_cluster_training_and_placement(online, self.options.client_fraction)

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        self.gps_bytes = 0
        self.round_phase = self.training_phase if self.clustered else self.clustering_phase()
        if not self.clustered:
            return self.clustering_instructions(server_round, online)
        return self.training_instructions(online)

    def absorb(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        if self.round_phase != self.training_phase:
            return self.absorb_clustering(server_round, replies)
        self.join_chosen_clusters(replies)
        self.aggregate_clusters([r for r in replies if MODEL in r.task.reply])
        self.training_rounds += 1
        if self.shared and self.training_rounds % self.options.lps_rounds == 0:
            self.gps_step()
        return None

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

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        assigned = self.assignment[self.assignment != UNASSIGNED]
        return {
            "bytes_gps": self.gps_bytes,
            "cluster_sizes": np.bincount(assigned).tolist() if len(assigned) else [],
        }

    def summary_entries(self) -> dict[str, Any]:
        return {"bytes_gps": self.gps_total, "model_bytes": sum(a.nbytes for a in self.setup.initial_weights)}

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "clustered": self.clustered, "training_rounds": self.training_rounds, "gps_total": self.gps_total,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.clustered = bool(state["clustered"])
        self.round_phase = self.training_phase if self.clustered else self.round_phase
        self.training_rounds = int(state["training_rounds"])
        self.gps_total = int(state["gps_total"])


    def clustered_matrix_artifacts(
        self, arrays: dict[str, Any], figure: str, matrix: np.ndarray, *, title: str, colour_label: str,
        dendrogram_title: str, **plot_options: Any,
    ) -> Artifacts:
        """The files of a one-time clustering of a client matrix: ``arrays``, the matrix as a heat
        map (clients ordered by true cluster, the clusters found beside it) and, where the clustering
        has a linkage, its dendrogram cut as it was."""
        clustering = self.clustering
        pids = list(clustering.pids)
        files: dict[str, Any] = dict(arrays)
        files[figure] = functools.partial(
            plot_client_matrix, matrix, self.setup.true_clusters[pids], self.setup.cluster_names,
            title=title, colour_label=colour_label, clients=pids, found=clustering.labels, **plot_options,
        )
        if len(clustering.linkage):
            files["dendrogram.png"] = clustering.dendrogram(self.setup.true_clusters, self.options.threshold,
                                                            dendrogram_title)
        return files


@register
class RandomClusters(HierarchicalFL):
    """The paper's baseline: clients put in ``num_clusters`` clusters at random, then HFL."""

    name = "random_clusters"
    Options = RandomClustersOptions

    def __init__(self, options: RandomClustersOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        # Every cluster gets members: client i joins cluster i mod T, over a seeded shuffle.
        self.start_clusters(self.rng.permutation(np.arange(setup.num_clients) % options.num_clusters))
        self.clustered = True


@register
class OracleHFL(HierarchicalFL):
    """HFL with the true tasks as clusters (the yardstick of perfect clustering)."""

    name = "oracle_hfl"
    Options = HFLOptions

    def __init__(self, options: HFLOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.start_clusters(setup.true_clusters)
        self.clustered = True


@register
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
        self.relevance: np.ndarray | None = None  # R over clustering.pids
        self.clustering: ClusteringRecord | None = None

    def feature_config(self) -> dict[str, Scalar]:
        return feature_config(self.options, self.dim, self.setup.seed, share_eigenvalues=self.options.relevance == "amiri")

    def clustering_phase(self) -> str:
        return "relevance" if self.summaries else "gram_eigen"

    def clustering_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        config = self.feature_config()
        if not self.summaries:
            config[oneshot.NUM_EIGENVECTORS_KEY] = self.options.num_eigenvectors
            return [Instruction(p, GRAM_EIGEN, {}, config) for p in online]
        summaries = [self.summaries[p] for p in sorted(self.summaries)]
        config[oneshot.EIGEN_FLOOR_KEY] = self.options.eigen_floor
        return [Instruction(p, RELEVANCE_ROW, {EIGENVECTORS: summaries}, config) for p in online if p in self.summaries]

    def absorb_clustering(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        needed = max(2, self.options.num_clusters or 2)
        if not self.summaries:
            for reply in replies:
                blocks = reply.blocks()
                self.summaries[reply.pid] = [*blocks[EIGENVECTORS], *blocks[EIGENVALUES]]  # no values unless shared
            if len(self.summaries) < needed:
                log(WARNING, "oneshot_hfl round %s: %d eigen-summaries, %d needed; asking again next round",
                    server_round, len(self.summaries), needed)
                self.summaries = {}
            return None
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
            return None
        columns = [summarised.index(p) for p in responders]
        self.relevance = relevance_matrix(np.stack([self.rows[p][columns] for p in responders]))
        return self._cluster(server_round, responders)

    def _cluster(self, server_round: int, responders: list[int]) -> Artifacts:
        opts = self.options
        hac = cluster_by_relevance(self.relevance, opts.linkage, threshold=opts.threshold, num_clusters=opts.num_clusters)
        self.clustering = ClusteringRecord.of(server_round, responders, hac, cut_rule(opts.threshold, opts.num_clusters))
        assignment = np.full(self.setup.num_clients, UNASSIGNED)
        assignment[responders] = hac.labels
        self.assignment[:] = assignment
        self.models = {k: self.initial_model() for k in range(hac.num_clusters)}
        self.clustered = True
        self.summaries, self.rows = {}, {}  # the one-shot phase is over; R keeps what they gave
        within, across = self.relevance_within_across()
        log(INFO, "oneshot_hfl round %s: %d clients -> %s; mean R within true tasks %.3f, across %.3f",
            server_round, len(responders), hac.sizes_text(), within, across)
        return self.artifacts()  # now, not only at the next checkpoint

    def relevance_within_across(self) -> tuple[float, float]:
        if self.relevance is None or self.clustering is None:
            return float("nan"), float("nan")
        return within_and_across(self.relevance, self.setup.true_clusters[list(self.clustering.pids)])

    def summary_entries(self) -> dict[str, Any]:
        within, across = self.relevance_within_across()
        k, d = self.options.num_eigenvectors, self.dim
        clustering = self.clustering.summary() if self.clustering is not None else {"clustering_round": None}
        return super().summary_entries() | clustering | {
            "relevance_within_true_clusters": within,
            "relevance_across_true_clusters": across,
            "relevance_rule": self.options.relevance,
            "eigen_summary_floats": k * d + (k if self.options.relevance == "amiri" else 0),  # per client, up; N times that down
        }

    def state_dict(self) -> dict[str, Any]:
        """Besides the clustering: the one-shot phase in progress (eigen-summaries and relevance
        rows received so far)."""
        return super().state_dict() | {
            "summaries": self.summaries,
            "rows": self.rows,
            "relevance": self.relevance,
            "clustering": None if self.clustering is None else self.clustering.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.summaries = {int(p): list(summary) for p, summary in state["summaries"].items()}
        self.rows = {int(p): row for p, row in state["rows"].items()}
        self.relevance = state["relevance"]
        self.clustering = ClusteringRecord.from_state(state["clustering"])

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Once clustered, the clusters came from the data summaries and the cut."""
        if not state.get("clustered"):
            return ()
        return ("features", "feature_dim", "pretrained_weights", "num_eigenvectors", "relevance", "num_clusters",
                "threshold", "linkage")

    def artifacts(self) -> Artifacts:
        """``relevance.npy`` (R over ``clustered_clients``), ``similarity.png`` (R, clients ordered by
        true task, with the clusters found beside it) and ``dendrogram.png``."""
        if self.relevance is None or self.clustering is None:
            return {}
        opts = self.options
        title = (f"relevance R ({opts.relevance} rule, {opts.features}, k={opts.num_eigenvectors}); "
                 f"strip: the {self.clustering.num_clusters} clusters found")
        return self.clustered_matrix_artifacts(
            {"relevance.npy": self.relevance}, "similarity.png", self.relevance, title=title, colour_label="R",
            dendrogram_title=f"one-shot clustering of 1 - R ({opts.linkage} linkage)")
