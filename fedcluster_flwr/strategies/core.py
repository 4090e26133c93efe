"""The strategy core: instructions out, validated replies in, on Flower's legacy Strategy API.

Every round of every fedcluster strategy goes the same way:

1. :meth:`ClusteredStrategy.fit_instructions` (the algorithm) says which online client gets
   which :class:`Instruction`: a task of :mod:`fedcluster_flwr.protocol`, named blocks of
   arrays (cluster models, a client's own model, update directions, eigenvectors, ...) and
   extra scalars. The core packs each into its own ``FitIns`` (never one shared, mutable
   instruction), serializing a model that many clients receive only once.
2. Each reply is checked (status, example count, then the task's reply schema); a failing,
   malformed or poisoned reply is counted and left out, never averaged in, and never stops
   the run. Replies are put in partition-id order, not the order Flower's thread pool
   finished them, so a seed fixes every decision of a run.
3. :meth:`ClusteredStrategy.absorb` (the algorithm; by default :meth:`assign` then FedAvg per
   cluster) takes the round's replies, then :meth:`ClusteredStrategy.after_round` runs
   (e.g. an average of shared layers across cluster models).
4. Every online client evaluates *its own* model (:meth:`evaluation_model`) on its own test
   split; the :class:`~.round_log.RoundLog` records the round.

Models are kept per cluster (``models``, keyed by cluster id) or per client
(``client_models``, keyed by partition id, for personal-model strategies); ``assignment``
maps every client to a cluster (or ``UNASSIGNED``) for the per-cluster metrics. A
checkpoint keeps both kinds of model, the models of :meth:`extra_models` and the state of
:meth:`extra_state`. Which Flower client is which partition is the job of
:class:`~.directory.ClientDirectory`.

A new algorithm is one subclass: set ``name`` and ``Options``, implement
:meth:`fit_instructions`, and override the documented hooks it needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.common import (
    Code,
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

from .. import protocol
from ..models import parameters_with_prefixes
from ..protocol import EVALUATE, MODEL, MODELS, TRAIN, TRAIN_SELECT, ModelSpec, Sent, Task
from ..results import RunRecorder
from ..aggregation import weighted_mean
from .directory import ClientDirectory
from .round_log import UNASSIGNED, RoundLog

__all__ = ["UNASSIGNED", "ClusteredStrategy", "Instruction", "Reply", "StrategySetup"]

CLIENT_MODEL_PREFIX = "client"  # checkpoint name of client p's personal model: client<p>


@dataclass(frozen=True)
class StrategySetup:
    """Everything a strategy needs from the experiment, built by the server app."""

    initial_weights: NDArrays
    num_clients: int
    true_clusters: np.ndarray
    rounds: int
    seed: int
    target_accuracy: float
    recorder: RunRecorder
    train_sizes: Sequence[int] | None = None  # per partition; a reply claiming more is refused
    title: str = ""
    join_round: Mapping[int, int] = field(default_factory=dict)
    checkpoint_every: int = 0
    wait_for_clients_s: float = 60.0
    timeout_s: float | None = None
    parameter_names: Sequence[str] | None = None  # the model's state_dict keys; None: array0, array1, ...
    init_weights: Callable[[int], NDArrays] | None = None  # a freshly initialised model for a seed
    input_shape: tuple[int, ...] | None = None  # of the dataset's images (C, H, W)
    stop_round: int | None = None  # stop (and checkpoint) after this round, before ``rounds``: a shared prefix
    numeric_platform: Mapping[str, str] | None = None  # the server process's (numerics.numeric_platform)
    cluster_names: Sequence[str] | None = None  # what each true cluster is, by id ("180°"), for plots

    @property
    def model_spec(self) -> ModelSpec:
        names = self.parameter_names or [f"array{i}" for i in range(len(self.initial_weights))]
        return ModelSpec.of(names, self.initial_weights)


@dataclass(frozen=True)
class Instruction:
    """What one client is asked to do in a round.

    ``blocks`` maps block names of ``task`` to items (each a list of arrays); ``config``
    holds the task's extra scalars; ``clusters`` names the cluster whose model each item of
    the ``models`` block is, where they are cluster models (``train_select`` replies choose
    among them).
    """

    pid: int
    task: Task
    blocks: Mapping[str, Sequence[NDArrays]] = field(default_factory=dict)
    config: Mapping[str, Scalar] = field(default_factory=dict)
    clusters: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.task.check_instruction(self.blocks, self.config)


@dataclass(frozen=True)
class Reply:
    """A validated reply. Its arrays stay serialized until asked for: at 1.7 M parameters
    and hundreds of clients, holding every reply deserialized at once would triple the
    clustering round's memory."""

    instruction: Instruction
    num_examples: int
    metrics: Mapping[str, Scalar]
    parameters: Parameters
    sent: Sent
    model_spec: ModelSpec

    @property
    def pid(self) -> int:
        return self.instruction.pid

    @property
    def task(self) -> Task:
        return self.instruction.task

    def blocks(self) -> dict[str, NDArrays]:
        """The reply's named arrays (deserialized on each call)."""
        return self.task.unpack_reply(protocol.parameters_to_arrays(self.parameters), self.sent, self.model_spec)

    def model(self) -> NDArrays:
        """The model this reply carries (tasks that reply with one), in the model's own dtypes
        (a float64 reply is stored as float32 like every other model)."""
        return [a.astype(d, copy=False) for a, d in zip(self.blocks()[MODEL], self.model_spec.dtypes)]


def parameters_nbytes(parameters: Parameters) -> int:
    return sum(len(t) for t in parameters.tensors)


class ClusteredStrategy(Strategy):
    """Per-cluster (or per-client) models and the round protocol; see the module docstring."""

    name: ClassVar[str]
    Options: ClassVar[type]

    def __init__(self, options: Any, setup: StrategySetup) -> None:
        super().__init__()
        self.options = options
        self.setup = setup
        self.model_spec = setup.model_spec
        self.dtypes = list(self.model_spec.dtypes)
        self.models: dict[int, NDArrays] = {0: [a.copy() for a in setup.initial_weights]}
        self.client_models: dict[int, NDArrays] = {}
        self.assignment = np.zeros(setup.num_clients, dtype=np.int64)
        self.rng = np.random.default_rng(setup.seed)
        self.directory = ClientDirectory(setup.num_clients, setup.join_round, setup.wait_for_clients_s, setup.timeout_s)
        self.log = RoundLog(
            setup.recorder, setup.true_clusters, setup.target_accuracy, setup.rounds, setup.checkpoint_every,
            setup.stop_round, setup.numeric_platform,
        )
        self.round_offset = 0  # rounds already done when resuming: Flower's round r is round r + offset
        self._sent: dict[int, tuple[Instruction, Sent]] = {}

    # ---- what a subclass provides (public hooks) ----------------------------------------------

    def fit_instructions(self, server_round: int, online: list[int]) -> list[Instruction]:
        """Who works in this round, on which task, with which blocks (at most one per client)."""
        raise NotImplementedError

    def absorb(self, server_round: int, replies: list[Reply]) -> None:
        """Take this round's validated replies (partition-id order) into the strategy's state.

        Default: :meth:`assign`, then FedAvg inside each cluster of the replies that carry
        a model; a cluster without replies keeps its model.
        """
        self.assign(server_round, replies)
        self.aggregate_clusters([r for r in replies if MODEL in r.task.reply])

    def after_round(self, server_round: int) -> None:
        """Runs after :meth:`absorb`, before evaluation (e.g. averaging shared layers)."""

    def assign(self, server_round: int, replies: list[Reply]) -> None:
        """Move clients between clusters given this round's replies (used by the default absorb).

        A ``train_select`` client joins the cluster whose model it chose (the model with its
        lowest training loss); other clients stay put.
        """
        for reply in replies:
            if reply.task is TRAIN_SELECT:
                self.assignment[reply.pid] = reply.instruction.clusters[int(reply.metrics[protocol.SELECTED])]

    def phase(self, server_round: int) -> str:
        """Name of the algorithm's phase in ``server_round`` (recorded per round)."""
        return self.name

    def evaluation_model(self, pid: int) -> NDArrays:
        """The model client ``pid`` is evaluated with: its own if it has one, else its cluster's."""
        if pid in self.client_models:
            return self.client_models[pid]
        return self.models[int(self.assignment[pid])]

    def extra_round_metrics(self, server_round: int) -> dict[str, Any]:
        """Algorithm-specific entries of the round's row in ``rounds.jsonl``."""
        return {}

    def extra_summary(self) -> dict[str, Any]:
        """Algorithm-specific entries of ``summary.json``."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """JSON-ready state a checkpoint must keep to resume (restored by :meth:`restore_extra`)."""
        return {}

    def extra_models(self) -> dict[str, NDArrays]:
        """Models besides cluster and client models that a checkpoint must keep (e.g. FL+HC's joint model)."""
        return {}

    def restore_extra(self, models: Mapping[str, NDArrays], state: Mapping[str, Any]) -> None:
        """Restore what :meth:`extra_state` and :meth:`extra_models` saved."""

    def write_artifacts(self) -> None:
        """Algorithm-specific files in the run directory (e.g. a dendrogram)."""

    @classmethod
    def options_fixed_by(cls, state: Mapping[str, Any]) -> tuple[str, ...]:
        """Options a branch of a checkpoint with ``state`` may not change, because the run has
        already acted on them (e.g. FL+HC's clustering options once it clustered); default none."""
        return ()

    # ---- helpers for subclasses ------------------------------------------------------------------

    @property
    def online(self) -> list[int]:
        """Partition ids online in the current round."""
        return self.directory.online

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
        self.models = {int(c): [a.copy() for a in self.setup.initial_weights] for c in set(self.assignment.tolist())}

    def members(self, cluster: int, pids: Sequence[int]) -> list[int]:
        return [p for p in pids if self.assignment[p] == cluster]

    def train_cluster_models(self, pids: Sequence[int]) -> list[Instruction]:
        """Each client trains the model of its own cluster."""
        instructions = []
        for pid in pids:
            cluster = int(self.assignment[pid])
            instructions.append(Instruction(pid, TRAIN, {MODELS: [self.models[cluster]]}, clusters=(cluster,)))
        return instructions

    def per_cluster_training(self, online: Sequence[int], fraction: float) -> list[Instruction]:
        """Every cluster samples ``fraction`` of its online members (independent FedAvg)."""
        instructions = []
        for cluster in sorted(self.models):
            instructions += self.train_cluster_models(self.sample(self.members(cluster, online), fraction))
        return instructions

    def select_cluster(self, pid: int, clusters: Sequence[int] | None = None) -> Instruction:
        """``pid`` picks the cluster model (of ``clusters``, default all) with its lowest training
        loss, trains it and joins that cluster (by the default :meth:`assign`)."""
        chosen = tuple(sorted(self.models) if clusters is None else clusters)
        return Instruction(pid, TRAIN_SELECT, {MODELS: [self.models[c] for c in chosen]}, clusters=chosen)

    def parameter_indices(self, prefixes: Sequence[str], key: str) -> list[int]:
        """Indices of the model's arrays named by ``prefixes`` (e.g. ``conv``); an unknown
        prefix is a config error on ``key`` that lists the model's parameter names."""
        return parameters_with_prefixes(self.model_spec.names, prefixes, key)

    def average(self, replies: Sequence[Reply]) -> NDArrays:
        """FedAvg of the models of ``replies``, weighted by their number of examples."""
        return weighted_mean((r.model() for r in replies), [r.num_examples for r in replies], self.dtypes)

    def aggregate_clusters(self, replies: Sequence[Reply]) -> None:
        """FedAvg inside each cluster (by the current assignment); clusters without replies keep their model."""
        by_cluster: dict[int, list[Reply]] = {}
        for reply in replies:
            by_cluster.setdefault(int(self.assignment[reply.pid]), []).append(reply)
        for cluster, members in by_cluster.items():
            self.models[cluster] = self.average(members)

    # ---- Flower Strategy API ---------------------------------------------------------------------

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(self.setup.initial_weights)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        server_round += self.round_offset
        self.log.start_round()
        online = self.directory.online_clients(server_round, client_manager)
        self._sent = {}
        cache: protocol.SerializationCache = {}
        messages = []
        for instruction in self.fit_instructions(server_round, online):
            if instruction.pid in self._sent:
                raise ValueError(f"{self.name}: two instructions for client {instruction.pid} in round {server_round}")
            params, config = self._encode(instruction, server_round, cache)
            self._sent[instruction.pid] = (instruction, Sent.of(config[protocol.LAYOUT_KEY], config))
            messages.append((self.directory.proxy(instruction.pid), FitIns(params, config)))
            self.log.round.bytes_down += parameters_nbytes(params)
        self.log.round.num_fit_clients = len(messages)
        self.log.round.fit_clients = tuple(sorted(self._sent))
        return messages

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        server_round += self.round_offset
        counters = self.log.round
        counters.fit_failures += len(failures)
        for failure in failures:
            log(WARNING, "round %s: a client failed during fit: %s", server_round, _describe_failure(failure))
        replies = []
        for proxy, res in results:
            counters.bytes_up += parameters_nbytes(res.parameters)
            reply = self._validated_reply(server_round, proxy, res)
            if reply is not None:
                replies.append(reply)
        replies.sort(key=lambda r: r.pid)  # arrival order is the thread pool's, not the seed's
        self.absorb(server_round, replies)
        self.after_round(server_round)
        losses = [float(v) for r in replies if protocol.is_finite_number(v := r.metrics.get(protocol.TRAIN_LOSS))]
        counters.train_loss = float(np.mean(losses)) if losses else float("nan")
        return None, {"accepted_updates": len(replies), "fit_failures": counters.fit_failures}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        server_round += self.round_offset
        online = self.directory.online_clients(server_round, client_manager)
        if not online:
            self._record_round(server_round, {}, {}, eval_failures=0)
            return []
        cache: protocol.SerializationCache = {}
        messages = []
        for pid in online:
            params, config = self._encode(Instruction(pid, EVALUATE, {MODELS: [self.evaluation_model(pid)]}),
                                          server_round, cache)
            messages.append((self.directory.proxy(pid), EvaluateIns(params, config)))
            self.log.round.bytes_eval += parameters_nbytes(params)
        return messages

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
        evaluated = Sent({MODELS: 1}, {})
        for proxy, res in results:
            pid = self.directory.pid_of(proxy)
            problem = (
                "unknown client" if pid is None
                else f"status {res.status.code.name}" if res.status.code != Code.OK
                else f"loss {res.loss!r} is not a finite number" if not protocol.is_finite_number(res.loss)
                else EVALUATE.problem_with_reply([], res.metrics, evaluated, self.model_spec)
            )
            if problem is None:
                accuracy[pid], loss[pid] = float(res.metrics[protocol.ACCURACY]), float(res.loss)
                if protocol.VAL_LOSS in res.metrics:
                    val_loss[pid] = float(res.metrics[protocol.VAL_LOSS])
            else:
                log(WARNING, "round %s: evaluation of client %s ignored: %s", server_round, pid, problem)
        eval_failures = len(failures) + len(results) - len(accuracy)
        # Partition-id order, not arrival order: means are then bit-identical across reruns.
        accuracy, loss = dict(sorted(accuracy.items())), dict(sorted(loss.items()))
        row = self._record_round(server_round, accuracy, loss, eval_failures, dict(sorted(val_loss.items())))
        mean_loss = float(np.mean(list(loss.values()))) if loss else None
        return mean_loss, {"mean_client_accuracy": row["mean_client_accuracy"]}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """No centralized evaluation: every client tests its own model on its own data."""
        return None

    # ---- internals -------------------------------------------------------------------------------

    def _encode(
        self, instruction: Instruction, server_round: int, cache: protocol.SerializationCache
    ) -> tuple[Parameters, dict[str, Scalar]]:
        params, layout = protocol.pack_parameters(instruction.blocks, cache)
        return params, protocol.instruction_config(instruction.task, server_round, layout, instruction.config)

    def _validated_reply(self, server_round: int, proxy: ClientProxy, res: FitRes) -> Reply | None:
        """The reply, or None (counted as rejected) if it could poison the strategy's state."""
        pid = self.directory.pid_of(proxy)
        instruction, sent = self._sent.get(pid, (None, None)) if pid is not None else (None, None)
        try:
            problem = self._problem_with(res, pid, instruction, sent)
        except Exception as err:  # noqa: BLE001 - any unreadable reply is a rejected reply
            problem = f"unreadable reply ({type(err).__name__}: {err})"
        if problem is not None:
            self.log.round.rejected_updates += 1
            log(WARNING, "round %s: reply of client %s rejected: %s", server_round, pid, problem)
            return None
        assert instruction is not None and sent is not None
        return Reply(instruction, res.num_examples, dict(res.metrics), res.parameters, sent, self.model_spec)

    def _problem_with(
        self, res: FitRes, pid: int | None, instruction: Instruction | None, sent: Sent | None
    ) -> str | None:
        if pid is None or instruction is None or sent is None:
            return "not asked to work this round"
        if res.status.code != Code.OK:
            return f"status {res.status.code.name}: {res.status.message}"
        limit = self.setup.train_sizes[pid] if self.setup.train_sizes is not None else None
        if not protocol.is_finite_number(res.num_examples) or res.num_examples <= 0 or (limit and res.num_examples > limit):
            return f"num_examples={res.num_examples!r}, expected 1..{limit or 'n'}"
        arrays = protocol.parameters_to_arrays(res.parameters)
        return instruction.task.problem_with_reply(arrays, res.metrics, sent, self.model_spec)

    def _record_round(
        self,
        server_round: int,
        accuracy: dict[int, float],
        loss: dict[int, float],
        eval_failures: int,
        val_loss: dict[int, float] | None = None,
    ) -> dict[str, Any]:
        row = self.log.metrics_row(
            server_round, self.phase(server_round), accuracy, loss, eval_failures,
            self.assignment, self.directory.connected, val_loss,
        )
        row.update(self.extra_round_metrics(server_round))
        recorder = self.setup.recorder
        recorder.log_round(row)
        if self.log.checkpoint_due(server_round):
            recorder.save_checkpoint(self._checkpoint_models(), self._state(server_round))
        if self.log.finished(server_round):
            recorder.plot(self.setup.target_accuracy, self.setup.title or self.name)
            self.write_artifacts()
            self.log.announce_results()
        summary = self.log.summary(server_round, self.name, self.assignment) | self.extra_summary()
        recorder.write_summary(summary)  # last: "finished" means all is written
        return row

    def _checkpoint_models(self) -> dict[str, NDArrays]:
        return (
            {str(c): m for c, m in self.models.items()}
            | {f"{CLIENT_MODEL_PREFIX}{p}": m for p, m in self.client_models.items()}
            | self.extra_models()
        )

    def _state(self, server_round: int) -> dict[str, Any]:
        return {
            "round": server_round,
            "strategy": self.name,
            "assignment": self.assignment.tolist(),
            "clusters": sorted(self.models),
            "rng": self.rng.bit_generator.state,
            **self.log.state(),
            **self.extra_state(),
        }

    def restore(self, models: Mapping[str, NDArrays], state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint: models, assignment, RNG, totals, strategy state.

        Flower numbers the remaining rounds from 1 again; ``round_offset`` maps them back.
        """
        if state["strategy"] != self.name:
            raise ValueError(f"checkpoint of strategy {state['strategy']!r}, not {self.name!r}")
        self.models = {int(name): model for name, model in models.items() if name.isdigit()}
        self.client_models = {
            int(pid): model
            for name, model in models.items()
            if name.startswith(CLIENT_MODEL_PREFIX) and (pid := name.removeprefix(CLIENT_MODEL_PREFIX)).isdigit()
        }
        self.assignment[:] = state["assignment"]
        self.rng.bit_generator.state = state["rng"]
        self.round_offset = int(state["round"])
        self.log.restore(state, self.round_offset)
        self.restore_extra(models, state)


def _describe_failure(failure: tuple[ClientProxy, FitRes] | BaseException) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    proxy, res = failure
    return f"client {proxy.cid}: {res.status.message}"
