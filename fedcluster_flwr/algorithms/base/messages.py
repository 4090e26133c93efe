"""A round's messages: instructions packed for Flower, replies checked before they count.

:class:`Instruction` is what a strategy asks of one client; :class:`RoundMessages` packs each
into its own ``FitIns`` (never one shared, mutable instruction; a model that many clients
receive is serialized once), remembers what went to whom, and turns each ``FitRes`` into a
:class:`Reply` only if it is sound: status, example count, then the task's reply schema (blocks,
shapes, dtypes, finiteness, metrics), all before any array touches a model. A failing,
malformed or poisoned reply is refused with the reason, never averaged in. A client answers once
per round: a reply from a client that was sent no work, or a second reply from one (the first to
arrive is judged, sound or not), is refused, so a round never holds more replies than clients it
sent work to; evaluation results alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flwr.common import Code, EvaluateIns, EvaluateRes, FitIns, FitRes, NDArrays, Parameters, Scalar
from flwr.server.client_proxy import ClientProxy

from ... import protocol
from ...protocol import EVALUATE, MODEL, MODELS, ModelSpec, Sent, Task

__all__ = ["Instruction", "Reply", "RoundMessages", "parameters_nbytes"]


@dataclass(frozen=True)
class Instruction:
    """What one client is asked to do in a round.

    ``blocks`` maps block names of ``task`` to items (each a list of arrays); ``config`` holds
    the task's extra scalars. Where the items of the ``models`` block are cluster models,
    ``clusters`` names the cluster of each (a selection reply's index points into it); where
    they are other clients' personal models (gossip), ``peers`` names whose each is, after the
    client's own.
    """

    pid: int
    task: Task
    blocks: Mapping[str, Sequence[NDArrays]] = field(default_factory=dict)
    config: Mapping[str, Scalar] = field(default_factory=dict)
    clusters: tuple[int, ...] = ()
    peers: tuple[int, ...] = ()

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


class RoundMessages:
    """The instructions of the round in progress, packed, and the check of their replies."""

    def __init__(self, model_spec: ModelSpec, train_sizes: Sequence[int] | None) -> None:
        self.model_spec = model_spec
        self.train_sizes = train_sizes  # per partition: a reply claiming more examples is refused
        self._sent: dict[int, tuple[Instruction, Sent]] = {}
        self._answered: set[int] = set()  # clients whose fit reply of this round arrived
        self._evaluating: set[int] = set()  # clients sent an evaluation this round
        self._evaluated: set[int] = set()  # ... whose result arrived

    @property
    def instructions(self) -> dict[int, Instruction]:
        """This round's instruction to each client, by partition id."""
        return {pid: instruction for pid, (instruction, _) in sorted(self._sent.items())}

    def pack_fit(self, instructions: Sequence[Instruction], server_round: int) -> list[tuple[int, FitIns]]:
        """One ``FitIns`` per instruction (at most one per client), remembered for the replies."""
        self._sent, self._answered = {}, set()
        cache: protocol.SerializationCache = {}
        packed = []
        for instruction in instructions:
            if instruction.pid in self._sent:
                raise ValueError(f"two instructions for client {instruction.pid} in round {server_round}")
            params, config = _encode(instruction, server_round, cache)
            self._sent[instruction.pid] = (instruction, Sent.of(config[protocol.LAYOUT_KEY], config))
            packed.append((instruction.pid, FitIns(params, config)))
        return packed

    def pack_evaluate(self, models: Mapping[int, NDArrays], server_round: int) -> list[tuple[int, EvaluateIns]]:
        """One ``EvaluateIns`` per client, carrying the model it is evaluated with."""
        cache: protocol.SerializationCache = {}
        packed = []
        self._evaluating, self._evaluated = set(models), set()
        for pid, model in models.items():
            params, config = _encode(Instruction(pid, EVALUATE, {MODELS: [model]}), server_round, cache)
            packed.append((pid, EvaluateIns(params, config)))
        return packed

    def fit_reply(self, pid: int | None, res: FitRes) -> Reply | str:
        """The reply of client ``pid``, or why it must be refused."""
        instruction, sent = self._sent.get(pid, (None, None)) if pid is not None else (None, None)
        if instruction is None or sent is None:
            return "not asked to work this round"
        if pid in self._answered:
            return "a second reply in this round (a client answers once; its first reply was judged)"
        self._answered.add(pid)
        try:
            problem = self._problem_with(res, pid, instruction, sent)
        except Exception as err:  # noqa: BLE001 - any unreadable reply is a refused reply
            problem = f"unreadable reply ({type(err).__name__}: {err})"
        if problem is not None:
            return problem
        return Reply(instruction, res.num_examples, dict(res.metrics), res.parameters, sent, self.model_spec)

    def evaluation_problem(self, pid: int | None, res: EvaluateRes) -> str | None:
        """Why client ``pid``'s evaluation result must be ignored; None if it is sound (each client
        sent an evaluation counts once: a second result, or one nobody asked for, is ignored)."""
        if pid is None:
            return "unknown client"
        if pid not in self._evaluating:
            return "not asked to evaluate this round"
        if pid in self._evaluated:
            return "a second evaluation result in this round (a client answers once; its first was judged)"
        self._evaluated.add(pid)
        if res.status.code != Code.OK:
            return f"status {res.status.code.name}"
        if not protocol.is_finite_number(res.loss):
            return f"loss {res.loss!r} is not a finite number"
        return EVALUATE.problem_with_reply([], res.metrics, Sent({MODELS: 1}, {}), self.model_spec)

    def _problem_with(self, res: FitRes, pid: int, instruction: Instruction, sent: Sent) -> str | None:
        if res.status.code != Code.OK:
            return f"status {res.status.code.name}: {res.status.message}"
        limit = self.train_sizes[pid] if self.train_sizes is not None else None
        if not protocol.is_finite_number(res.num_examples) or res.num_examples <= 0 or (limit and res.num_examples > limit):
            return f"num_examples={res.num_examples!r}, expected 1..{limit or 'n'}"
        arrays = protocol.parameters_to_arrays(res.parameters)
        return instruction.task.problem_with_reply(arrays, res.metrics, sent, self.model_spec)


def _encode(
    instruction: Instruction, server_round: int, cache: protocol.SerializationCache
) -> tuple[Parameters, dict[str, Scalar]]:
    params, layout = protocol.pack_parameters(instruction.blocks, cache)
    return params, protocol.instruction_config(instruction.task, server_round, layout, instruction.config)


def train_losses(replies: Sequence[Reply]) -> list[float]:  # the finite ones the replies report
    return [float(v) for r in replies if protocol.is_finite_number(v := r.metrics.get(protocol.TRAIN_LOSS))]


def describe_failure(failure: tuple[ClientProxy, FitRes] | BaseException) -> str:
    """One line saying why a fit failed, however Flower carried it."""
    if isinstance(failure, BaseException):
        text = f"{type(failure).__name__}: {failure}"
    else:
        proxy, res = failure
        text = f"client {proxy.cid}: {res.status.message}"
    # Flower's simulation wraps a ClientApp's exception in Ray's whole traceback; the client's own
    # message follows the last "Message: ". One line per failure, however it travelled.
    if "Message: " in text:
        text = text.rsplit("Message: ", 1)[1].split("'>", 1)[0]
    return text.strip().splitlines()[0] if text.strip() else text
