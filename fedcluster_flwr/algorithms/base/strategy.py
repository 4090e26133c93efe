"""The strategy core: the algorithm's hooks behind Flower's legacy Strategy API.

Every round of every fedcluster strategy goes the same way:

1. :meth:`ClusteredStrategy.fit_instructions` (the algorithm) says which online client gets
   which :class:`~.messages.Instruction`: a task, named blocks of arrays (cluster models, a
   client's own model, update directions, eigenvectors, ...) and extra scalars.
   :class:`~.messages.RoundMessages` packs them for Flower and checks every reply against its
   task's schema; a refused reply is counted and left out, never averaged in, and never stops
   the run. Replies reach the algorithm in partition-id order, not the order Flower's thread
   pool finished them, so a seed fixes every decision of a run.
2. :meth:`ClusteredStrategy.absorb` (the algorithm; by default FedAvg inside each cluster) takes
   the round's replies.
3. Every online client evaluates *its own* model (:meth:`evaluation_model`) on its own test
   split; the :class:`RoundReport` goes to the observer the runner connected (:meth:`connect`), which
   records the round, checkpoints the strategy's :meth:`state_dict` and writes its
   :meth:`artifacts`. A strategy writes no file and keeps no log: state in, decisions out.

Models are kept per cluster (``models``, keyed by cluster id) or per client (``client_models``,
keyed by partition id, for personal-model strategies); ``assignment`` maps every client to a
cluster (or ``UNASSIGNED``) for the per-cluster metrics. Which Flower client is which partition
is the job of :class:`~.directory.ClientDirectory`.

A new algorithm is one subclass, decorated with :func:`fedcluster_flwr.registry.register`: set
``name`` and ``Options``, implement :meth:`fit_instructions`, and override what it needs of
:data:`HOOKS` (docs/how-to/add-algorithm.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from pathlib import Path
from typing import Any, ClassVar, Protocol, Union

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    log,
    ndarrays_to_parameters,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from ... import protocol
from ...aggregation import weighted_mean
from ...models import parameters_with_prefixes
from ...protocol import MODEL, MODELS, TRAIN, ModelSpec
from .selection import SELECT, SELECTED, TRAIN_SELECT
from .directory import ClientDirectory, Federation
from .model_selection import BestValidated
from .messages import Instruction, Reply, RoundMessages, describe_failure, parameters_nbytes, train_losses

__all__ = ["HOOKS", "UNASSIGNED", "Artifacts", "ClusteredStrategy", "Instruction", "Reply", "RoundReport",
           "StrategySetup"]

UNASSIGNED = -1  # the cluster of a client that has none (yet)

# A file of the run directory a strategy describes, by file name: an array (``.npy``) or a
# figure, drawn by calling it with the path (``.png``). The results side writes them.
Artifacts = Mapping[str, Union[np.ndarray, Callable[[Path], Any]]]

# What a strategy author may override; only ``fit_instructions`` is required.
HOOKS = (
    "fit_instructions",  # who works this round, on which task (required)
    "absorb",  # take the round's replies (default: FedAvg inside each cluster)
    "phase",  # the name of a round's phase in rounds.jsonl
    "local_objective",  # what the clients' local training minimises (train instructions)
    "unassigned_model",  # what a client without a cluster is evaluated on
    "round_metrics",  # the algorithm's entries of a round's row
    "summary",  # the algorithm's entries of summary.json
    "artifacts",  # files describing the strategy's state (dendrogram, similarity matrix, ...)
    "state_dict",  # everything needed to continue, with load_state_dict (PyTorch's pair)
    "load_state_dict",
    "options_fixed_by",  # options a branch of a checkpoint may no longer change
)


@dataclass(frozen=True)
class StrategySetup:
    """The algorithm's inputs from the experiment (how the run is recorded and how its clients are
    found are the runner's: :meth:`ClusteredStrategy.connect`)."""

    initial_weights: NDArrays
    num_clients: int
    true_clusters: np.ndarray  # per partition: what the oracles use and the plots order by
    rounds: int
    seed: int
    train_sizes: Sequence[int] | None = None  # per partition; a reply claiming more is refused
    parameter_names: Sequence[str] | None = None  # the model's state_dict keys; None: array0, array1, ...
    init_weights: Callable[[int], NDArrays] | None = None  # a freshly initialised model for a seed
    input_shape: tuple[int, ...] | None = None  # of the dataset's images (C, H, W)
    cluster_names: Sequence[str] | None = None  # what each true cluster is, by id ("180°"), for plots

    @property
    def model_spec(self) -> ModelSpec:
        names = self.parameter_names or [f"array{i}" for i in range(len(self.initial_weights))]
        return ModelSpec.of(names, self.initial_weights)


@dataclass
class RoundCounters:
    """What the round in progress has produced so far, as the Flower side of the strategy counts it."""

    started: float = 0.0
    fit_clients: tuple[int, ...] = ()
    fit_failures: int = 0
    rejected_updates: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_eval: int = 0
    train_loss: float = float("nan")
    artifacts: dict[str, Any] = field(default_factory=dict)  # files the algorithm returned this round


@dataclass(frozen=True)
class RoundReport:
    """A finished round, as the strategy hands it to the runner's observer: its counters and every
    evaluated client's results (by partition id, in partition-id order)."""

    server_round: int
    counters: RoundCounters
    accuracy: Mapping[int, float]
    loss: Mapping[int, float]
    eval_failures: int
    val_loss: Mapping[int, float] = field(default_factory=dict)


class RoundObserver(Protocol):
    """Who records a strategy's rounds (the runner's round log)."""

    def round_ended(self, strategy: ClusteredStrategy, report: RoundReport) -> None: ...


class ClusteredStrategy(Strategy):
    """Per-cluster (or per-client) models and the round protocol; see the module docstring."""

    name: ClassVar[str]
    Options: ClassVar[type]
    round_word: ClassVar[str] = "rounds"  # what one of its rounds is, in plots ("ifca rounds")
    phase_words: ClassVar[Mapping[str, str]] = {}  # its own phases in words, for the plots' legend

    def __init__(self, options: Any, setup: StrategySetup) -> None:
        super().__init__()
        self.options = options
        self.setup = setup
        self.model_spec = setup.model_spec
        self.dtypes = list(self.model_spec.dtypes)
        self.models: dict[int, NDArrays] = {0: self.initial_model()}
        self.client_models: dict[int, NDArrays] = {}
        self.assignment = np.zeros(setup.num_clients, dtype=np.int64)
        self.rng = np.random.default_rng(setup.seed)
        self.directory = ClientDirectory(setup.num_clients)
        self.messages = RoundMessages(self.model_spec, setup.train_sizes)
        self.observer: RoundObserver | None = None
        self.model_selection = BestValidated()
        self.counters = RoundCounters()
        self.round_offset = 0  # rounds already done when resuming: Flower's round r is round r + offset

    def connect(self, federation: Federation, observer: RoundObserver | None) -> ClusteredStrategy:
        """The runner's part: how the Flower clients are found, and who records each round."""
        self.directory = ClientDirectory(self.setup.num_clients, federation)
        self.observer = observer
        return self

    # ---- hooks (see HOOKS) ---------------------------------------------------------------------

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        """Who works in this round, on which task, with which blocks (at most one per client)."""
        raise NotImplementedError

    def absorb(self, server_round: int, replies: list[Reply]) -> Artifacts | None:
        """Take this round's validated replies (partition-id order) into the strategy's state.

        Default: FedAvg inside each cluster of the replies that carry a model; a cluster without
        replies keeps its model. May return files this round produced that no state keeps (e.g.
        FL+HC's update matrix), or files it wants written now rather than at the next checkpoint.
        """
        self.aggregate_clusters([r for r in replies if MODEL in r.task.reply])
        return None

    def phase(self, server_round: int) -> str:
        """Name of the algorithm's phase in ``server_round`` (recorded per round)."""
        return self.name

    def local_objective(self) -> Mapping[str, Scalar]:
        """The scalars every ``train`` instruction of :meth:`train_cluster_models` carries to name the
        clients' local objective (``objective`` and its own keys, see
        :func:`fedcluster_flwr.registry.objective`); none by default: cross-entropy alone."""
        return {}

    def unassigned_model(self) -> NDArrays:
        """The model a client without a cluster (``UNASSIGNED``) is evaluated on, counted under
        ``unassigned``: by default the lowest-numbered cluster's."""
        return self.models[min(self.models)]

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        """Algorithm-specific entries of the round's row in ``rounds.jsonl``."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Algorithm-specific entries of ``summary.json``."""
        return {}

    def artifacts(self) -> Artifacts:
        """Files describing the strategy's state (written where the run ends: the last round or --stop-after)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything this strategy needs to continue: models, assignment, RNG and, in subclasses,
        their own state. Values are arrays, lists of arrays, dicts and JSON scalars; dict keys are
        strings or ints. Subclasses extend it: ``return super().state_dict() | {...}``."""
        return {
            "strategy": self.name,
            "models": self.models,
            "client_models": self.client_models,
            "assignment": self.assignment,
            "rng": self.rng.bit_generator.state,
            "best_validated": self.model_selection.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s); subclasses call ``super()`` first."""
        if state["strategy"] != self.name:
            raise ValueError(f"a state of strategy {state['strategy']!r}, not {self.name!r}")
        self.models = {int(k): list(model) for k, model in state["models"].items()}
        self.client_models = {int(p): list(model) for p, model in state["client_models"].items()}
        self.assignment[:] = state["assignment"]
        self.rng.bit_generator.state = state["rng"]
        self.model_selection.load_state_dict(state.get("best_validated", {}))

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Options a branch of a checkpoint whose strategy state is ``state`` may not change,
        because the run has already acted on them (e.g. FL+HC's clustering options once it
        clustered); default none."""
        return ()

    # ---- helpers for subclasses ------------------------------------------------------------------

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
                Instruction(pid, TRAIN, {MODELS: [self.models[cluster]]}, self.local_objective(), clusters=(cluster,))
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

    # ---- Flower Strategy API ---------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.setup.initial_weights)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        server_round += self.round_offset
        counters = self.counters = RoundCounters(started=time.perf_counter())
        online = self.directory.online_clients(server_round, client_manager)
        self.messages.train_sizes = self.directory.train_sizes(self.setup.train_sizes)
        packed = self.messages.pack_fit(self.fit_instructions(server_round, online), server_round)
        counters.bytes_down = sum(parameters_nbytes(ins.parameters) for _, ins in packed)
        counters.fit_clients = tuple(sorted(pid for pid, _ in packed))
        return [(self.directory.proxy(pid), ins) for pid, ins in packed]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        server_round += self.round_offset
        counters = self.counters
        replies = self.checked_replies(server_round, results, failures)
        counters.artifacts = dict(self.absorb(server_round, replies) or {})
        counters.train_loss = float(np.mean(losses)) if (losses := train_losses(replies)) else float("nan")
        return None, {"accepted_updates": len(replies), "fit_failures": counters.fit_failures}

    def checked_replies(self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: list) -> list[Reply]:
        """The sound replies among ``results``, in partition-id order; failures and refused ones counted and logged."""
        counters = self.counters
        counters.fit_failures += len(failures)
        for failure in failures:
            log(WARNING, "round %s: a client failed during fit: %s", server_round, describe_failure(failure))
        replies = []
        for proxy, res in results:
            counters.bytes_up += parameters_nbytes(res.parameters)
            pid = self.directory.pid_of(proxy)
            reply = self.messages.fit_reply(pid, res)
            if isinstance(reply, Reply):
                replies.append(reply)
            else:
                counters.rejected_updates += 1
                log(WARNING, "round %s: reply of client %s rejected: %s", server_round, pid, reply)
        return sorted(replies, key=lambda r: r.pid)  # arrival order is the thread pool's, not the seed's

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        server_round += self.round_offset
        online = self.directory.online_clients(server_round, client_manager)
        if not online:
            self.end_round(RoundReport(server_round, self.counters, {}, {}, eval_failures=0))
            return []
        packed = self.messages.pack_evaluate({pid: self.evaluation_model(pid) for pid in online}, server_round)
        self.counters.bytes_eval = sum(parameters_nbytes(ins.parameters) for _, ins in packed)
        return [(self.directory.proxy(pid), ins) for pid, ins in packed]

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        server_round += self.round_offset
        accuracy: dict[int, float] = {}
        loss: dict[int, float] = {}
        val_loss: dict[int, float] = {}
        for proxy, res in results:
            pid = self.directory.pid_of(proxy)
            problem = self.messages.evaluation_problem(pid, res)
            if problem is None:
                accuracy[pid], loss[pid] = float(res.metrics[protocol.ACCURACY]), float(res.loss)
                if protocol.VAL_LOSS in res.metrics:
                    val_loss[pid] = float(res.metrics[protocol.VAL_LOSS])
            else:
                log(WARNING, "round %s: evaluation of client %s ignored: %s", server_round, pid, problem)
        eval_failures = len(failures) + len(results) - len(accuracy)
        # Partition-id order, not arrival order: means are then bit-identical across reruns.
        accuracy, loss = dict(sorted(accuracy.items())), dict(sorted(loss.items()))
        self.end_round(RoundReport(server_round, self.counters, accuracy, loss, eval_failures, dict(sorted(val_loss.items()))))
        mean_loss = float(np.mean(list(loss.values()))) if loss else None
        mean_accuracy = float(np.mean(list(accuracy.values()))) if accuracy else float("nan")
        return mean_loss, {"mean_client_accuracy": mean_accuracy}

    def end_round(self, report: RoundReport) -> None:
        """The round's evaluation taken into the model selection, then handed to the observer
        (which checkpoints the state it updated)."""
        self.model_selection.update(report.accuracy, report.val_loss)
        if self.observer is None:
            log(WARNING, "round %s of %s is not recorded: the strategy is not connected to a round log",
                report.server_round, self.name)
        else:
            self.observer.round_ended(self, report)

    def model_selection_metrics(self) -> dict[str, Any]:
        """Each client's best-validated accuracy, summarised for the round's row (see
        :mod:`.model_selection`); empty unless clients report a validation loss."""
        return self.model_selection.metrics(self.directory.true_clusters(self.setup.true_clusters))

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No centralized evaluation: every client tests its own model on its own data."""
        return None

