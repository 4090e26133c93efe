"""FL+HC: federated learning with hierarchical clustering of local updates (Briggs et al., 2020).

The algorithm:

1. Rounds 1..n: FedAvg of one joint model, a fraction ``cf`` of clients per round.
2. Round n+1 (the clustering round): *every* client trains the joint model and
   returns its update dw = w_local - w_joint. The server clusters the updates
   with agglomerative (hierarchical) clustering, using distance ``l1``/``l2``/``cosine``
   and ``single``/``complete``/``average``/``ward`` linkage, cut at a distance
   ``threshold`` (or into ``num_clusters``; given neither, where the silhouette is largest:
   the paper tunes the threshold per dataset and gives no rule).
3. Rounds n+2..: independent FedAvg inside each cluster, each cluster sampling ``cf``
   of its own members. Every cluster model starts from the joint model; the
   clustering round's updates are its first FedAvg step (each cluster averages
   the updates of its members).

A client absent from the clustering round (it failed, or joined later) is put in
the cluster whose model gives it the lowest training loss: the next time it is
online it receives every cluster model, picks the best by training loss, trains
that one, and joins its cluster. Until then it is evaluated on the joint model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from typing import Any, Literal

import numpy as np
from flwr.common import log

from ...types import NDArrays
from ...clustering import ClusteringRecord, HacResult, UpdateMatrix, cut_rule, flatten, hierarchical_clustering
from ...protocol import MODEL
from ...declarations.options import DeclaredOptions
from ...declarations.schema import AtMostOne, Is, IsNot, LessThan, OnlyWith, above, at_least, option
from ..base.strategy import UNASSIGNED, Artifacts, ClusteredStrategy, Instruction, Reply, StrategySetup
from ..base.options import SAME_MEANING, CLUSTERS_FIT_CLIENTS, SHARE_OF_CLIENTS
from ...registry import register


@dataclass(frozen=True)
class FLHCOptions(DeclaredOptions):
    """FL+HC hyperparameters; names follow the paper (cf, n, distance, linkage, threshold)."""

    client_fraction: float = option(0.2, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))
    rounds_before_clustering: int = option(10, at_least(0))
    distance: Literal["l1", "l2", "cosine"] = "l1"
    linkage: Literal["single", "complete", "average", "ward"] = "complete"
    threshold: float | None = option(None, above(0))
    num_clusters: int | None = option(None, at_least(1), roles=(SAME_MEANING,))
    projection_dim: int | None = option(None, at_least(2))
    clustering_quorum: float = option(0.5, SHARE_OF_CLIENTS)  # share of online clients whose updates the clustering needs
    save_updates: bool = False  # write the clustering round's update matrix to updates.npy

    rules = (
        AtMostOne("threshold", "num_clusters"),
        OnlyWith(Is("linkage", "ward"), Is("distance", "l2"),
                 message="ward linkage needs distance l2 (it minimises Euclidean variance); got distance {distance}"),
        OnlyWith("projection_dim", IsNot("distance", "l1"),
                 message="random projection preserves l2/cosine distances only; remove it for distance l1"),
    )
    experiment_rules = (
        LessThan("rounds_before_clustering", "rounds", why="the clustering round, one after it, must fall within rounds"),
        CLUSTERS_FIT_CLIENTS,
    )


@register
class FLHC(ClusteredStrategy):
    """FedAvg, one clustering round of all clients' updates, then FedAvg per cluster."""

    name = "flhc"
    Options = FLHCOptions

    def __init__(self, options: FLHCOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.planned_clustering_round = options.rounds_before_clustering + 1  # later if it must wait for a quorum
        self.clustering: ClusteringRecord | None = None  # the clustering that happened
        self.joint_model: NDArrays | None = None  # the FedAvg model the clusters started from

    @property
    def clustered(self) -> bool:
        return self.clustering is not None

    def phase(self, server_round: int) -> str:
        if self.clustering is not None and server_round > self.clustering.round:
            return "clustered"
        return "clustering" if server_round >= self.planned_clustering_round else "fedavg"

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        cf = self.options.client_fraction
        if not self.clustered and server_round < self.planned_clustering_round:
            return self.train_cluster_models(self.sample(online, cf))
        if not self.clustered:
            return self.train_cluster_models(online)  # the clustering round: every client
        return self.per_cluster_training_and_placement(online, cf)

    def absorb(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        artifacts = None
        if self.clustered:
            self.join_chosen_clusters(replies)
        elif server_round >= self.planned_clustering_round:
            artifacts = self._try_clustering(server_round, replies)
        # Every cluster starts from the joint model; in the clustering round each then averages its members' updates.
        self.aggregate_clusters([r for r in replies if MODEL in r.task.reply])
        return artifacts

    def unassigned_model(self) -> NDArrays:
        """A client that missed the clustering is evaluated on the joint model until it chooses a cluster."""
        return self.joint_model if self.joint_model is not None else super().unassigned_model()

    def _try_clustering(self, server_round: int, updates: list[Reply]) -> Artifacts | None:
        quorum = self.options.clustering_quorum * len(self.online)
        if len(updates) < max(quorum, 1):
            log(WARNING, "FL+HC round %s: %d updates, below the clustering quorum of %.0f; clustering next round",
                server_round, len(updates), quorum)
            return None
        try:
            return self._cluster(server_round, updates)
        except (ValueError, FloatingPointError) as err:
            log(ERROR, "FL+HC round %s: clustering failed (%s); retrying next round", server_round, err)
            return None

    def _cluster(self, server_round: int, updates: list[Reply]) -> Artifacts:
        """Hierarchical clustering of the updates dw = w_local - w_joint."""
        opts = self.options
        joint = self.models[0]
        joint_vector = flatten(joint)
        matrix = UpdateMatrix(len(updates), joint_vector.size, opts.projection_dim, self.setup.seed)
        for row, update in enumerate(updates):  # one update deserialized at a time
            matrix.set_row(row, flatten(update.model()) - joint_vector)
        hac = hierarchical_clustering(
            matrix.rows, opts.distance, opts.linkage, threshold=opts.threshold, num_clusters=opts.num_clusters
        )
        cut = cut_rule(opts.threshold, opts.num_clusters)
        self.clustering = ClusteringRecord.of(server_round, [u.pid for u in updates], hac, cut)
        self.joint_model = joint
        self.assignment[:] = UNASSIGNED
        self.assignment[list(self.clustering.pids)] = hac.labels
        self.models = {k: joint for k in range(hac.num_clusters)}
        log(
            INFO,
            "FL+HC round %s: %d clients -> %s (%s distance, %s linkage, cut: %s); %s",
            server_round, len(updates), hac.sizes_text(), opts.distance, opts.linkage, cut, _distance_note(hac),
        )
        updates_file = {"updates.npy": matrix.rows} if opts.save_updates else {}
        return dict(self.artifacts()) | updates_file  # the dendrogram now, not only at the next checkpoint

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"unassigned_clients": sum(1 for p in self.online if self.assignment[p] == UNASSIGNED)}

    def summary_entries(self) -> dict[str, Any]:
        return self.clustering.summary() if self.clustering is not None else {"clustering_round": None}

    def artifacts(self) -> Artifacts:
        """``linkage.npy`` (scipy linkage matrix over ``clustered_clients``) and ``dendrogram.png``."""
        if self.clustering is None or len(self.clustering.linkage) == 0:
            return {}
        title = f"FL+HC round {self.clustering.round}: {self.options.distance} / {self.options.linkage}"
        return {
            "linkage.npy": self.clustering.linkage,
            "dendrogram.png": self.clustering.dendrogram(self.setup.true_clusters, self.options.threshold, title),
        }

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "clustering": None if self.clustering is None else self.clustering.state_dict(),
            "joint_model": self.joint_model,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.clustering = ClusteringRecord.from_state(state["clustering"])
        self.joint_model = None if state["joint_model"] is None else list(state["joint_model"])

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Once the run clustered, its clusters came from these options; before, none is fixed."""
        if state.get("clustering") is None:
            return ()
        return ("rounds_before_clustering", "distance", "linkage", "threshold", "num_clusters", "projection_dim",
                "clustering_quorum")


def _distance_note(hac: HacResult) -> str:
    d = hac.distances
    heights = hac.linkage[-5:, 2] if len(hac.linkage) else []
    return (
        f"pairwise distances min {d.min():.4g} / median {np.median(d):.4g} / max {d.max():.4g}; "
        f"last merge heights {', '.join(f'{h:.4g}' for h in heights)}"
        if len(d) else "fewer than two updates"
    )
