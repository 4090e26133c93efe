"""FL+HC: federated learning with hierarchical clustering of local updates (Briggs et al., 2020).

The algorithm:

1. Rounds 1..n: FedAvg of one joint model, a fraction ``cf`` of clients per round.
2. Round n+1 (the clustering round): *every* client trains the joint model and
   returns its update dw = w_local - w_joint. The server clusters the updates
   with agglomerative (hierarchical) clustering, using distance ``l1``/``l2``/``cosine``
   and ``single``/``complete``/``average``/``ward`` linkage, cut at a distance
   ``threshold`` (or into ``num_clusters``).
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
from flwr.common import NDArrays, log

from ..clustering import HacResult, UpdateMatrix, flatten, hierarchical_clustering
from ..results import plot_dendrogram
from ..schema import ExactlyOne, Is, IsNot, LessThan, OnlyWith, above, at_least, option
from .core import UNASSIGNED, ClusteredStrategy, Instruction, Reply, StrategySetup
from .options import CLUSTERS_FIT_CLIENTS, SHARE_OF_CLIENTS


@dataclass(frozen=True)
class FLHCOptions:
    """FL+HC hyperparameters; names follow the paper (cf, n, distance, linkage, threshold)."""

    client_fraction: float = option(0.2, SHARE_OF_CLIENTS)
    rounds_before_clustering: int = option(10, at_least(0))
    distance: Literal["l1", "l2", "cosine"] = "l1"
    linkage: Literal["single", "complete", "average", "ward"] = "complete"
    threshold: float | None = option(None, above(0))
    num_clusters: int | None = option(None, at_least(1))
    projection_dim: int | None = option(None, at_least(2))
    clustering_quorum: float = option(0.5, SHARE_OF_CLIENTS)  # share of online clients whose updates the clustering needs
    save_updates: bool = False  # write the clustering round's update matrix to updates.npy

    rules = (
        ExactlyOne("threshold", "num_clusters"),
        OnlyWith(Is("linkage", "ward"), Is("distance", "l2"),
                 message="ward linkage needs distance l2 (it minimises Euclidean variance); got distance {distance}"),
        OnlyWith("projection_dim", IsNot("distance", "l1"),
                 message="random projection preserves l2/cosine distances only; remove it for distance l1"),
    )
    experiment_rules = (
        LessThan("rounds_before_clustering", "rounds", why="the clustering round, one after it, must fall within rounds"),
        CLUSTERS_FIT_CLIENTS,
    )


class FLHC(ClusteredStrategy):
    """FedAvg, one clustering round of all clients' updates, then FedAvg per cluster."""

    name = "flhc"
    Options = FLHCOptions

    def __init__(self, options: FLHCOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        self.clustering_round = options.rounds_before_clustering + 1
        self.clustered_at: int | None = None  # the round clustering happened (later if it had to wait)
        self.joint_model: NDArrays | None = None
        self.hac: HacResult | None = None
        self.clustered_pids: list[int] = []

    @property
    def clustered(self) -> bool:
        return self.clustered_at is not None

    def phase(self, server_round: int) -> str:
        if self.clustered_at is not None and server_round > self.clustered_at:
            return "clustered"
        return "clustering" if server_round >= self.clustering_round else "fedavg"

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        cf = self.options.client_fraction
        if not self.clustered and server_round < self.clustering_round:
            return self.train_cluster_models(self.sample(online, cf))
        if not self.clustered:
            return self.train_cluster_models(online)  # the clustering round: every client
        newcomers = [p for p in online if self.assignment[p] == UNASSIGNED]
        return self.per_cluster_training(online, cf) + [self.select_cluster(p) for p in newcomers]

    def assign(self, server_round: int, updates: list[Reply]) -> None:
        if self.clustered:
            super().assign(server_round, updates)
            return
        if server_round < self.clustering_round:
            return
        quorum = self.options.clustering_quorum * len(self.online)
        if len(updates) < max(quorum, 1):
            log(WARNING, "FL+HC round %s: %d updates, below the clustering quorum of %.0f; clustering next round",
                server_round, len(updates), quorum)
            return
        try:
            self._cluster(server_round, updates)
        except (ValueError, FloatingPointError) as err:
            log(ERROR, "FL+HC round %s: clustering failed (%s); retrying next round", server_round, err)

    def evaluation_model(self, pid: int) -> NDArrays:
        if self.assignment[pid] == UNASSIGNED and self.joint_model is not None:
            return self.joint_model
        return super().evaluation_model(pid)

    def _cluster(self, server_round: int, updates: list[Reply]) -> None:
        """Hierarchical clustering of the updates dw = w_local - w_joint."""
        opts = self.options
        joint = self.models[0]
        joint_vector = flatten(joint)
        matrix = UpdateMatrix(len(updates), joint_vector.size, opts.projection_dim, self.setup.seed)
        for row, update in enumerate(updates):  # one update deserialized at a time
            matrix.set_row(row, flatten(update.model()) - joint_vector)
        if opts.save_updates:
            np.save(self.setup.recorder.run_dir / "updates.npy", matrix.rows)
        hac = hierarchical_clustering(
            matrix.rows, opts.distance, opts.linkage, threshold=opts.threshold, num_clusters=opts.num_clusters
        )
        self.hac, self.clustered_at, self.joint_model = hac, server_round, joint
        self.clustered_pids = [u.pid for u in updates]
        self.assignment[:] = UNASSIGNED
        self.assignment[self.clustered_pids] = hac.labels
        # Every cluster starts from the joint model; the base then averages its members' updates.
        self.models = {k: joint for k in range(hac.num_clusters)}
        log(
            INFO,
            "FL+HC round %s: %d clients -> %d clusters of sizes %s (%s distance, %s linkage); %s",
            server_round, len(updates), hac.num_clusters, np.bincount(hac.labels).tolist(),
            opts.distance, opts.linkage, self._distance_note(),
        )
        self.write_artifacts()

    def _distance_note(self) -> str:
        assert self.hac is not None
        d = self.hac.distances
        heights = self.hac.linkage[-5:, 2] if len(self.hac.linkage) else []
        return (
            f"pairwise distances min {d.min():.4g} / median {np.median(d):.4g} / max {d.max():.4g}; "
            f"last merge heights {', '.join(f'{h:.4g}' for h in heights)}"
            if len(d) else "fewer than two updates"
        )

    def extra_round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"unassigned_clients": sum(1 for p in self.online if self.assignment[p] == UNASSIGNED)}

    def extra_summary(self) -> dict[str, Any]:
        if self.hac is None:
            return {"clustering_round": None}
        return {
            "clustering_round": self.clustered_at,
            "clusters_found": self.hac.num_clusters,
            "clustered_clients": self.clustered_pids,
            "clustering_labels": self.hac.labels.tolist(),
            "merge_heights": self.hac.linkage[:, 2].tolist(),
        }

    def extra_state(self) -> dict[str, Any]:
        return {"clustered_at": self.clustered_at, "clustered_pids": self.clustered_pids}

    def extra_models(self) -> dict[str, NDArrays]:
        return {} if self.joint_model is None else {"joint": self.joint_model}

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Once the run clustered, its clusters came from these options; before, none is fixed."""
        if state.get("clustered_at") is None:
            return ()
        return ("rounds_before_clustering", "distance", "linkage", "threshold", "num_clusters", "projection_dim",
                "clustering_quorum")

    def restore_extra(self, models: Mapping[str, NDArrays], state: Mapping[str, Any]) -> None:
        self.clustered_at = state["clustered_at"]
        self.clustered_pids = list(state["clustered_pids"])
        self.joint_model = models.get("joint")
        if self.clustered_at is not None:
            linkage_file = self.setup.recorder.run_dir / "linkage.npy"
            linkage = np.load(linkage_file) if linkage_file.is_file() else np.zeros((0, 4))
            labels = self.assignment[self.clustered_pids]  # a copy; clustered clients never change cluster
            self.hac = HacResult(labels, linkage, np.zeros(0))

    def write_artifacts(self) -> None:
        """``linkage.npy`` (scipy linkage matrix over ``clustered_clients``) and ``dendrogram.png``."""
        if self.hac is None or len(self.hac.linkage) == 0:
            return
        run_dir = self.setup.recorder.run_dir
        np.save(run_dir / "linkage.npy", self.hac.linkage)
        plot_dendrogram(
            self.hac.linkage,
            [f"{p}:{self.setup.true_clusters[p]}" for p in self.clustered_pids],
            self.options.threshold,
            run_dir / "dendrogram.png",
            f"FL+HC round {self.clustered_at}: {self.options.distance} / {self.options.linkage}",
        )
