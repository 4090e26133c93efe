"""What a family's strategy builds its rounds from: sampling, clusters and their members, the
instructions every clustered method sends (train your cluster's model, choose among the cluster
models), FedAvg inside each cluster, the model a client is evaluated with.

:class:`ClusterToolkit` is mixed into :class:`~.strategy.ClusteredStrategy`, which sets the state
these helpers read and write (``models``, ``client_models``, ``assignment``, ``rng``, ``setup``,
``directory``, ``dtypes``); none of them touches Flower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...aggregation import weighted_mean
from ...models import parameters_with_prefixes
from ...protocol import MODEL, MODELS, TRAIN
from ...types import NDArrays
from .messages import Instruction, Reply
from .selection import SELECT, SELECTED, TRAIN_SELECT

UNASSIGNED = -1  # the cluster of a client that has none (yet)


class ClusterToolkit:
    """The helpers a family's hooks use (see the module docstring)."""

    models: dict[int, NDArrays]
    client_models: dict[int, NDArrays]
    assignment: np.ndarray
    rng: np.random.Generator
    setup: Any
    directory: Any
    dtypes: list

    local_objective: Any  # hooks of the strategy (strategy.HOOKS) the helpers call
    unassigned_model: Any

    @property
    def online(self) -> list[int]:
        """Partition ids online in the current round."""
        return self.directory.online

    def initial_model(self) -> NDArrays:
        """A fresh copy of the run's initial model."""
        return [a.copy() for a in self.setup.initial_weights]

    def sample(self, pids: Sequence[int], fraction: float) -> list[int]:
        """Seeded sample of ``max(1, floor(fraction * len(pids)))`` clients (Flower's FedAvg
        rule, without its ``min_fit_clients`` floor)."""
        if not pids:
            return []
        count = min(len(pids), max(1, math.floor(fraction * len(pids) + 1e-9)))
        return sorted(int(p) for p in self.rng.choice(np.asarray(pids), size=count, replace=False))

    def start_clusters(self, assignment: Sequence[int]) -> None:
        """Assign clients to clusters, every cluster starting from the initial model."""
        self.assignment[:] = assignment
        self.models = {int(c): self.initial_model() for c in set(self.assignment.tolist())}

    def members(self, cluster: int, pids: Sequence[int]) -> list[int]:
        return [p for p in pids if self.assignment[p] == cluster]

    def train_cluster_models(self, pids: Sequence[int]) -> list[Instruction]:
        """Each client trains the model of its own cluster."""
        instructions = []
        for pid in pids:
            cluster = int(self.assignment[pid])
            instructions.append(
                Instruction(pid, TRAIN, {MODEL: [self.models[cluster]]}, self.local_objective(), clusters=(cluster,))
            )
        return instructions

    def per_cluster_training(self, online: Sequence[int], fraction: float) -> list[Instruction]:
        """Every cluster samples ``fraction`` of its online members (independent FedAvg)."""
        instructions = []
        for cluster in sorted(self.models):
            instructions += self.train_cluster_models(self.sample(self.members(cluster, online), fraction))
        return instructions

    def select_cluster(self, pid: int, clusters: Sequence[int] | None = None) -> Instruction:
        """``pid`` picks the cluster model (of ``clusters``, default all) with its lowest training
        loss and trains it (task ``train_select``); :meth:`join_chosen_clusters` then moves it."""
        chosen = tuple(sorted(self.models) if clusters is None else clusters)
        return Instruction(pid, TRAIN_SELECT, {MODELS: [self.models[c] for c in chosen]}, clusters=chosen)

    def per_cluster_training_and_placement(self, online: Sequence[int], fraction: float) -> list[Instruction]:
        """:meth:`per_cluster_training`, and every online client without a cluster (it missed the
        clustering, or joined later) choosing one (:meth:`select_cluster`)."""
        newcomers = [p for p in online if self.assignment[p] == UNASSIGNED]
        return self.per_cluster_training(online, fraction) + [self.select_cluster(p) for p in newcomers]

    def join_chosen_clusters(self, replies: Sequence[Reply]) -> None:
        """Each client that chose among cluster models (task ``train_select`` or ``select``: a
        ``selected`` index into the instruction's ``clusters``) joins the cluster it chose."""
        for reply in replies:
            if reply.task in (TRAIN_SELECT, SELECT):
                self.assignment[reply.pid] = reply.instruction.clusters[int(reply.metrics[SELECTED])]

    def parameter_indices(self, prefixes: Sequence[str], key: str) -> list[int]:
        """Indices of the model's arrays named by ``prefixes`` (e.g. ``conv``); an unknown
        prefix is a config error on ``key`` that lists the model's parameter names."""
        return parameters_with_prefixes(self.model_spec.names, prefixes, key)

    def aggregation_weights(self, replies: Sequence[Reply]) -> Sequence[float]:
        """Each reply's weight in :meth:`average`: its number of examples (FedAvg's |D_i|)."""
        return [r.num_examples for r in replies]

    def average(self, replies: Sequence[Reply]) -> NDArrays:
        """FedAvg of the models of ``replies``, weighted by :meth:`aggregation_weights`."""
        return weighted_mean((r.model() for r in replies), self.aggregation_weights(replies), self.dtypes)

    def aggregate_clusters(self, replies: Sequence[Reply]) -> None:
        """FedAvg inside each cluster (by the current assignment); clusters without replies keep their model."""
        by_cluster: dict[int, list[Reply]] = {}
        for reply in replies:
            by_cluster.setdefault(int(self.assignment[reply.pid]), []).append(reply)
        for cluster, members in by_cluster.items():
            self.models[cluster] = self.average(members)

    def evaluation_model(self, pid: int) -> NDArrays:
        """The model client ``pid`` is evaluated with: its own if it has one, else its cluster's,
        else :meth:`unassigned_model`."""
        if pid in self.client_models:
            return self.client_models[pid]
        cluster = int(self.assignment[pid])
        return self.unassigned_model() if cluster == UNASSIGNED else self.models[cluster]
