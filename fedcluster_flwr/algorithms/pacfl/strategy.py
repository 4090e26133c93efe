"""PACFL: clustered FL by the principal angles between client data subspaces (Vahidian et al.,
"Efficient Distribution Similarity Identification in Clustered Federated Learning via Principal
Angles Between Client Data Subspaces", AAAI 2023).

The algorithm (``pacfl``), on the one-shot code path of :mod:`.oneshot_hfl`:

1. Round 1 (task ``gram_eigen``, the only clustering round): every client sends U_p, the top
   ``num_basis`` (p) left singular vectors of its data matrix D = Φ(X)ᵀ (features × samples). They
   are the top-p eigenvectors of G = (1/n) Φ(X)ᵀΦ(X) = (1/n) D Dᵀ that ``gram_eigen`` returns
   (D = UΣVᵀ gives D Dᵀ = UΣ²Uᵀ: the same vectors in the same order, up to sign, which no subspace
   sees), with no eigenvalues. Φ is the feature map of one-shot HFL (``features``); ``identity`` is
   the standardised pixels of the whole training set.
2. The server's proximity matrix A (N × N, degrees) compares every pair of subspaces
   (``proximity``, see :data:`~fedcluster_flwr.clustering.PROXIMITIES`): ``smallest_angle``
   A(i, j) = θ_1(U_i, U_j) (eq. 2, the default), ``sum_of_angles`` A(i, j) = Σ_k θ_k(U_i, U_j)
   (eq. 3 with true principal angles), or ``elementwise_min_angle``, the reference code's
   min_{a,b} arccos(u_a^(i) · u_b^(j)). Agglomerative clustering of A with ``linkage`` (the
   reference scripts': average), cut at ``threshold`` degrees or into ``num_clusters`` (given neither,
   where the silhouette is largest).
3. Then FedAvg inside each cluster: each round a fraction ``client_fraction`` of all (clustered,
   online) clients is sampled, as the paper's m = max(frac · N, 1), and each trains its cluster's
   model. No GPS step: ``shared_layers`` is empty unless asked (then the GPS of
   :class:`~.oneshot_hfl.HierarchicalFL` averages those layers across the cluster models).

Newcomers (clients absent from the clustering round: failed, or joined later) are placed by their
own subspace, not by a model's loss: the first time one is online afterwards it is asked for its U_p
(``gram_eigen`` again), and joins the cluster at the smallest linkage distance from it (with
``linkage``: the mean proximity to the cluster's members for average, the nearest member for single,
the farthest for complete; see :func:`~fedcluster_flwr.clustering.closest_cluster`); it trains from
the next round. Until then it is evaluated on the lowest-numbered cluster's model.

What the reference code (github.com/MMorafah/PACFL) does differently, not reproduced here: each
client takes p vectors *per class* of its data and stacks them (p × its classes, not orthonormal
across classes); its proximity is ``elementwise_min_angle`` (available); its "unseen clients" are
clustered together with everyone before training rather than placed afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Literal

import numpy as np
from flwr.common import log

from ...clustering import ClusteringRecord, cluster_square, cut_rule

from .math import closest_cluster, proximity_matrix, subspace_proximity

from ..oneshot.math import within_and_across
from ...features import feature_dim
from ...declarations.schema import AtMostOne, above, at_least, option, require
from ..oneshot import tasks as oneshot
from ..oneshot.tasks import EIGENVECTORS, GRAM_EIGEN
from ..base.strategy import UNASSIGNED, Artifacts, Instruction, Reply, StrategySetup
from ..oneshot.strategy import FeatureMapOptions, HFLOptions, HierarchicalFL, feature_config
from ..base.options import SAME_MEANING, CLUSTERS_FIT_CLIENTS, SHARE_OF_CLIENTS
from ...registry import register


@dataclass(frozen=True)
class PACFLOptions(FeatureMapOptions, HFLOptions):
    client_fraction: float = option(0.1, SHARE_OF_CLIENTS, roles=(SAME_MEANING,))  # of all clustered online clients per round (the paper's frac)
    num_basis: int = option(3, at_least(1))  # p, the principal vectors each client sends (the reference scripts' n_basis)
    proximity: Literal["smallest_angle", "sum_of_angles", "elementwise_min_angle"] = "smallest_angle"
    threshold: float | None = option(None, above(0))  # degrees, on the proximity (the reference's cluster_alpha)
    num_clusters: int | None = option(None, at_least(1), roles=(SAME_MEANING,))
    linkage: Literal["single", "complete", "average"] = "average"

    rules = (AtMostOne("num_clusters", "threshold"),)
    experiment_rules = (CLUSTERS_FIT_CLIENTS,)

    def check_experiment(self, config: Any, prefix: str) -> None:
        super().check_experiment(config, prefix)
        require(config.rounds > 1, "rounds", f"pacfl spends round 1 on clustering; give more than 1, got {config.rounds}")
        dim = feature_dim(self.features, config.input_shape, self.feature_dim)
        require(self.num_basis <= dim, f"{prefix}.num_basis", f"cannot exceed the {dim} features of {self.features}")


@register
class PACFL(HierarchicalFL):
    """One round of client subspaces, HAC of their principal angles, then FedAvg per cluster."""

    name = "pacfl"
    Options = PACFLOptions
    training_phase = "fedavg"

    def __init__(self, options: PACFLOptions, setup: StrategySetup) -> None:
        super().__init__(options, setup)
        if setup.input_shape is None:
            raise ValueError("pacfl needs StrategySetup.input_shape")
        self.dim = feature_dim(options.features, setup.input_shape, options.feature_dim)
        self.bases: dict[int, np.ndarray] = {}  # pid -> U_p (d × p), of every clustered or placed client
        self.proximity: np.ndarray | None = None  # A over clustering.pids
        self.clustering: ClusteringRecord | None = None
        self.placements: list[dict[str, Any]] = []  # newcomers placed by their subspace

    def subspace_instruction(self, pid: int) -> Instruction:
        config = feature_config(self.options, self.dim, self.setup.seed, share_eigenvalues=False)
        return Instruction(pid, GRAM_EIGEN, {}, config | {oneshot.NUM_EIGENVECTORS_KEY: self.options.num_basis})

    @staticmethod
    def basis(reply: Reply) -> np.ndarray:
        """U_p of a ``gram_eigen`` reply, as columns (d × p)."""
        return reply.blocks()[EIGENVECTORS][0].astype(np.float64).T

    # ---- the clustering round ------------------------------------------------------------------

    def clustering_phase(self) -> str:
        return GRAM_EIGEN.name

    def clustering_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        return [self.subspace_instruction(p) for p in online]

    def absorb_clustering(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        opts = self.options
        bases = {r.pid: self.basis(r) for r in replies}
        needed = max(2, opts.num_clusters or 2)
        if len(bases) < needed:
            log(WARNING, "pacfl round %s: %d subspaces, %d needed; asking again next round", server_round, len(bases), needed)
            return None
        pids = sorted(bases)
        self.proximity = proximity_matrix([bases[p] for p in pids], opts.proximity)
        hac = cluster_square(self.proximity, opts.linkage, threshold=opts.threshold, num_clusters=opts.num_clusters)
        self.clustering = ClusteringRecord.of(server_round, pids, hac, cut_rule(opts.threshold, opts.num_clusters))
        self.bases = bases
        self.assignment[:] = UNASSIGNED
        self.assignment[pids] = hac.labels
        self.models = {k: self.initial_model() for k in range(hac.num_clusters)}
        self.clustered = True
        within, across = self.proximity_within_across()
        log(INFO, "pacfl round %s: %d clients -> %s; mean %s within true clusters %.2f°, across %.2f°",
            server_round, len(pids), hac.sizes_text(), opts.proximity, within, across)
        return self.artifacts()  # now, not only at the next checkpoint

    # ---- FedAvg per cluster, newcomers placed by their subspace ------------------------------------

    def training_instructions(self, online: list[int]) -> list[Instruction]:
        clustered = [p for p in online if self.assignment[p] != UNASSIGNED]
        newcomers = [p for p in online if self.assignment[p] == UNASSIGNED]
        return (self.train_cluster_models(self.sample(clustered, self.options.client_fraction))
                + [self.subspace_instruction(p) for p in newcomers])

    def absorb(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        if self.round_phase == self.training_phase:
            for reply in replies:
                if reply.task == GRAM_EIGEN:
                    self.place(server_round, reply.pid, self.basis(reply))
        return super().absorb(server_round, replies)

    def place(self, server_round: int, pid: int, basis: np.ndarray) -> int:
        """Put newcomer ``pid`` in the cluster closest to its subspace ``basis`` (module docstring)."""
        members = [p for p in sorted(self.bases) if self.assignment[p] != UNASSIGNED]
        distances = np.array([subspace_proximity(basis, self.bases[p], self.options.proximity) for p in members])
        cluster = closest_cluster(distances, self.assignment[members], self.options.linkage)
        self.bases[pid] = basis
        self.assignment[pid] = cluster
        self.placements.append({"round": server_round, "client": pid, "cluster": cluster})
        log(INFO, "pacfl round %s: newcomer %d placed in cluster %d by its subspace", server_round, pid, cluster)
        return cluster

    # ---- records ---------------------------------------------------------------------------------

    def proximity_within_across(self) -> tuple[float, float]:
        """Mean proximity (degrees) between clients of the same true cluster, and of different ones."""
        if self.proximity is None or self.clustering is None:
            return float("nan"), float("nan")
        return within_and_across(self.proximity, self.setup.true_clusters[list(self.clustering.pids)])

    def summary_entries(self) -> dict[str, Any]:
        within, across = self.proximity_within_across()
        clustering = self.clustering.summary() if self.clustering is not None else {"clustering_round": None}
        return super().summary_entries() | clustering | {
            "proximity_rule": self.options.proximity,
            "proximity_within_true_clusters": within,  # degrees
            "proximity_across_true_clusters": across,
            "proximity_gap": across - within,  # positive: the true clusters are closer inside than across
            "subspace_floats": self.options.num_basis * self.dim,  # per client, up, once
            "newcomer_placements": self.placements,
        }

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {
            "bases": self.bases,
            "proximity": self.proximity,
            "clustering": None if self.clustering is None else self.clustering.state_dict(),
            "placements": self.placements,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.bases = {int(p): np.asarray(basis) for p, basis in state["bases"].items()}
        self.proximity = state["proximity"]
        self.clustering = ClusteringRecord.from_state(state["clustering"])
        self.placements = [dict(placement) for placement in state["placements"]]

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Once clustered, the clusters came from the subspaces and the cut, and newcomers are placed
        by the same proximity and linkage."""
        if not state.get("clustered"):
            return ()
        return ("features", "feature_dim", "pretrained_weights", "num_basis", "proximity", "num_clusters",
                "threshold", "linkage")

    def artifacts(self) -> Artifacts:
        """``proximity.npy`` (A in degrees over ``clustered_clients``), ``proximity.png`` (A in degrees,
        coloured over the range of its values: the largest possible value, 90° per basis vector, is
        far above what clients reach and left the map uniformly dark; clients ordered by true
        cluster, the clusters found beside it) and ``dendrogram.png``."""
        if self.proximity is None or self.clustering is None:
            return {}
        opts = self.options
        title = (f"PACFL proximity ({opts.proximity}, {opts.features}, p={opts.num_basis}); "
                 f"strip: the {self.clustering.num_clusters} clusters found")
        return self.clustered_matrix_artifacts(
            {"proximity.npy": self.proximity}, "proximity.png", self.proximity, title=title,
            colour_label=f"proximity A ({opts.proximity} of principal angles), degrees",
            dendrogram_title=f"PACFL clustering of the proximity, degrees ({opts.linkage} linkage)", colour_range=None)
