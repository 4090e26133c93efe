"""The strategy core: the algorithm's hooks behind Flower's Message-API ``Strategy``.

Every round of every fedcluster strategy goes the same way, on whatever ``Grid`` runs it (Flower's
simulation, a SuperLink's SuperNodes, our in-process and batched engines):

1. :meth:`ClusteredStrategy.fit_instructions` (the algorithm) says which online client gets
   which :class:`~.messages.Instruction`: a task, named blocks of arrays (cluster models, a
   client's own model, update directions, eigenvectors, ...) and extra scalars.
   :class:`~.messages.RoundMessages` makes each into a ``Message`` for the client's node
   (``configure_train``) and checks every reply against its task's schema (``aggregate_train``);
   a failed or refused reply is counted and left out, never averaged in, and never stops the
   run. Replies reach the algorithm in partition-id order, not the order they arrived in, so a
   seed fixes every decision of a run.
2. :meth:`ClusteredStrategy.absorb` (the algorithm; by default FedAvg inside each cluster) takes
   the round's replies.
3. Every online client evaluates *its own* model (:meth:`evaluation_model`) on its own test
   split (``configure_evaluate`` / ``aggregate_evaluate``); the :class:`RoundReport` goes to the
   observer the runner connected (:meth:`connect`), which
   records the round, checkpoints the strategy's :meth:`state_dict` and writes its
   :meth:`artifacts`. A strategy writes no file and keeps no log: state in, decisions out.

:meth:`ClusteredStrategy.start` plays the rounds on a grid, as Flower's ``Strategy.start`` does,
and also plays a round whose clients take turns (:mod:`.turns`): one message at a time.

Models are kept per cluster (``models``, keyed by cluster id) or per client (``client_models``,
keyed by partition id, for personal-model strategies); ``assignment`` maps every client to a
cluster (or ``UNASSIGNED``) for the per-cluster metrics. Which Flower node is which partition
is the job of :class:`~.directory.ClientDirectory`.

A new algorithm is one subclass, decorated with :func:`fedcluster_flwr.registry.register`: set
``name`` and ``Options``, implement :meth:`fit_instructions`, and override what it needs of
:data:`HOOKS` (docs/how-to/add-algorithm.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar, Union

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ... import protocol
from ...protocol import ACCURACY, EVALUATE, MODEL, TEST_LOSS, VAL_LOSS, ModelSpec, content_nbytes
from ...declarations.schema import config_key
from ...types import NDArrays, Scalar
from .directory import ClientDirectory, Federation
from .model_selection import BestValidated
from .messages import Instruction, Reply, RoundMessages, Verdicts, train_losses
from .toolkit import UNASSIGNED, ClusterToolkit
from .round_report import RoundCounters, RoundObserver, RoundReport

__all__ = ["HOOKS", "UNASSIGNED", "Artifacts", "ClusteredStrategy", "Instruction", "Reply", "RoundReport",
           "StrategySetup"]

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
    "evaluation_instruction",  # what a client is asked to evaluate (default: its model, task evaluate)
    "round_metrics",  # the algorithm's entries of a round's row
    "summary_entries",  # the algorithm's entries of summary.json
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


class ClusteredStrategy(ClusterToolkit, Strategy):
    """Per-cluster (or per-client) models and the round protocol; see the module docstring."""

    name: ClassVar[str]
    Options: ClassVar[type]
    round_word: ClassVar[str] = "rounds"  # what one of its rounds is, in plots ("ifca rounds")
    phase_words: ClassVar[Mapping[str, str]] = {}  # its own phases in words, for the plots' legend
    keeps_client_state: ClassVar[bool] = False  # its tasks keep state on the clients' nodes (Task.state)

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
        self.evaluations: Mapping[int, Mapping[str, Scalar]] = {}  # the round's sound evaluation metrics, by client
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

    def evaluation_instruction(self, pid: int) -> Instruction:
        """What client ``pid`` evaluates at the round's end: by default its model
        (:meth:`evaluation_model`), task ``evaluate``; a strategy whose clients evaluate what they keep
        themselves (a personal model) names its own task. The round's results, every metric its task
        replies with, are in :attr:`evaluations` when :meth:`round_metrics` is asked."""
        return Instruction(pid, EVALUATE, {MODEL: [self.evaluation_model(pid)]})

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        """Algorithm-specific entries of the round's row in ``rounds.jsonl``."""
        return {}

    def summary_entries(self) -> dict[str, Any]:
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

    # ---- Flower's Message-API Strategy -----------------------------------------------------------
    # Flower numbers the rounds of each ``start`` from 1; a resumed run's round r is round r + round_offset.

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """This round's instructions (:meth:`fit_instructions`), one message per instructed client's node.
        ``arrays`` and ``config`` are not used: the strategy keeps its models, and each task its scalars."""
        server_round += self.round_offset
        self.counters = RoundCounters(started=time.perf_counter())
        online = self.directory.online_clients(server_round, grid)
        self.messages.train_sizes = self.directory.train_sizes(self.setup.train_sizes)
        instructions = self.fit_instructions(server_round, online)
        messages = self.messages.make(instructions, server_round, self.directory.node)
        self.counters.bytes_down = sum(content_nbytes(message.content) for message in messages)
        self.counters.fit_clients = tuple(sorted(instruction.pid for instruction in instructions))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord]:
        """The round's sound replies (partition-id order) taken by :meth:`absorb`; the round's counts as
        Flower's train metrics. No global ArrayRecord: the strategy keeps its models itself."""
        server_round += self.round_offset
        counters = self.counters
        accepted = self.checked_replies(server_round, replies)
        counters.artifacts = dict(self.absorb(server_round, accepted) or {})
        counters.train_loss = float(np.mean(losses)) if (losses := train_losses(accepted)) else float("nan")
        return None, self.train_metrics(len(accepted))

    def train_metrics(self, accepted: int) -> MetricRecord:
        """What a round's training did, as Flower's train metrics of the round."""
        c = self.counters
        loss = {protocol.TRAIN_LOSS: c.train_loss} if math.isfinite(c.train_loss) else {}
        return MetricRecord({"accepted_updates": accepted, "fit_failures": c.fit_failures, "rejected_updates": c.rejected_updates} | loss)

    def checked_replies(self, server_round: int, replies: Iterable[Message]) -> list[Reply]:
        """The sound replies among ``replies``, in partition-id order; failures and refused ones counted and logged."""
        verdicts: Verdicts = self.messages.judge(replies, self.directory.pid_of)
        counters = self.counters
        counters.bytes_up += verdicts.bytes_up
        counters.fit_failures += len(verdicts.failures)
        counters.rejected_updates += len(verdicts.refused)
        for pid, why in verdicts.failures:
            log(WARNING, "round %s: client %s failed: %s", server_round, pid, why)
        for pid, why in verdicts.refused:
            log(WARNING, "round %s: reply of client %s rejected: %s", server_round, pid, why)
        return verdicts.replies

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """Every online client evaluates its own model (:meth:`evaluation_model`)."""
        server_round += self.round_offset
        online = self.directory.online_clients(server_round, grid)
        messages = self.messages.make_evaluate([self.evaluation_instruction(pid) for pid in online], server_round,
                                               self.directory.node)
        self.counters.bytes_eval = sum(content_nbytes(message.content) for message in messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord:
        """Each client's test accuracy and loss (and validation loss), by partition id, into the round's
        report for the observer; the mean client accuracy as Flower's evaluate metrics of the round."""
        server_round += self.round_offset
        results, problems = self.messages.judge_evaluations(replies, self.directory.pid_of)
        self.evaluations = results
        for pid, problem in problems.items():
            log(WARNING, "round %s: evaluation of client %s ignored: %s", server_round, pid, problem)
        accuracy = {pid: float(m[ACCURACY]) for pid, m in results.items()}
        loss = {pid: float(m[TEST_LOSS]) for pid, m in results.items()}
        val_loss = {pid: float(m[VAL_LOSS]) for pid, m in results.items() if VAL_LOSS in m}
        self.end_round(RoundReport(server_round, self.counters, accuracy, loss, len(problems), val_loss))
        return MetricRecord({"mean_client_accuracy": float(np.mean(list(accuracy.values()))) if accuracy else float("nan"),
                             "num_evaluated": len(accuracy)})

    def summary(self) -> None:
        """Log the strategy's options (Flower's ``Strategy.summary``; ``summary.json`` entries are
        :meth:`summary_entries`)."""
        log(INFO, "\t├──> %s (%s) on %d clients", self.name, type(self).__name__, self.setup.num_clients)
        for option in fields(self.options) if is_dataclass(self.options) else ():  # declared options are dataclasses
            log(INFO, "\t│\t%s: %s", config_key(option), getattr(self.options, option.name))  # the YAML key: lambda, not lambda_

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 3,
        timeout: float | None = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Play ``num_rounds`` rounds on ``grid`` (Flower's ``Strategy.start``, which a ServerApp's
        main calls): per round the training exchange (or the round's turns, one message at a time),
        then every online client's evaluation. ``initial_arrays``, when given, is the model every
        cluster starts from (it must have the experiment's model's shapes); ``timeout`` bounds each
        exchange (None: wait for every reply). The run's state, models and results are the
        strategy's and its observer's; the ``Result`` holds the rounds' aggregated metrics and,
        where the strategy keeps one global model, that model."""
        if train_config or evaluate_config or evaluate_fn is not None:
            raise TypeError(
                f"{self.name}: train_config, evaluate_config and evaluate_fn are not taken: the clients' settings "
                "are the experiment's (client.*), a task's scalars the strategy's options, and every client "
                "evaluates its own model on its own test split")
        if initial_arrays is not None:
            self.use_initial_arrays(initial_arrays)
        log(INFO, "Starting %s strategy:", type(self).__name__)
        self.summary()
        result = Result()
        for current_round in range(1, num_rounds + 1):
            log(INFO, "[ROUND %s/%s]", current_round + self.round_offset, num_rounds + self.round_offset)
            train_metrics, evaluate_metrics = self.play_round(grid, current_round, timeout)
            result.train_metrics_clientapp[current_round + self.round_offset] = train_metrics
            result.evaluate_metrics_clientapp[current_round + self.round_offset] = evaluate_metrics
        if not self.client_models and len(self.models) == 1:
            result.arrays = protocol.array_record(next(iter(self.models.values())), self.model_spec.names)
        return result

    def play_round(self, grid: Grid, server_round: int, timeout: float | None = None) -> tuple[MetricRecord, MetricRecord]:
        """Flower's round ``server_round`` of :meth:`start` on ``grid``: train, then evaluate."""
        messages = self.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid)
        _, train_metrics = self.aggregate_train(server_round, grid.send_and_receive(messages, timeout=timeout))
        return train_metrics, self.evaluate_round(grid, server_round, timeout)

    def evaluate_round(self, grid: Grid, server_round: int, timeout: float | None) -> MetricRecord:
        messages = self.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid)
        return self.aggregate_evaluate(server_round, grid.send_and_receive(messages, timeout=timeout) if messages else [])

    def use_initial_arrays(self, arrays: ArrayRecord) -> None:
        """Start every cluster from ``arrays`` instead of the experiment's initial model (before the first round)."""
        weights = protocol.record_arrays(arrays)
        shapes, expected = [a.shape for a in weights], list(self.model_spec.shapes)
        problem = (f"its shapes {shapes} are not the model's {expected}" if shapes != expected else
                   f"the run resumes after round {self.round_offset}" if self.round_offset else None)
        if problem:
            raise ValueError(f"{self.name}: initial_arrays refused: {problem}")
        self.setup = replace(self.setup, initial_weights=[w.astype(d, copy=False) for w, d in zip(weights, self.dtypes)])
        self.models = {cluster: self.initial_model() for cluster in self.models}

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
