"""A round's messages: instructions made into Flower ``Message``s, replies checked before they count.

:class:`Instruction` is what a strategy asks of one client; :class:`RoundMessages` makes each into a
``Message`` of its own for the client's node (a model that many clients receive is serialized once,
its record shared, as Flower's own strategies share one), remembers what went to whom, and turns
each reply into a :class:`Reply` only if it is sound: no error, from a node that was sent work, an
example count that is a positive integer no larger than the client's training set, then the task's
reply schema (records, shapes, dtypes, finiteness, metrics), all before any array touches a model.
A failing, malformed or poisoned reply is refused with the reason, never averaged in. A client
answers once per round: a reply from a client that was sent no work, or a second reply from one
(the first to arrive is judged, sound or not), is refused, so a round never holds more replies
than clients it sent work to; a client sent work that did not answer (the round's timeout) counts
as a failure. Evaluation results alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict

from ... import protocol
from ...protocol import MODEL, NUM_EXAMPLES, ModelSpec, Sent, Task
from ...types import NDArrays, Scalar

__all__ = ["Instruction", "Reply", "RoundMessages", "Verdicts"]


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
    """A validated reply. Its arrays stay serialized in its records until asked for: at 1.7 M
    parameters and hundreds of clients, holding every reply deserialized at once would triple
    the clustering round's memory."""

    instruction: Instruction
    num_examples: int
    metrics: Mapping[str, Scalar]
    content: RecordDict
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
        return {name: protocol.record_arrays(self.content.array_records[name]) for name in self.task.reply}

    def model(self) -> NDArrays:
        """The model this reply carries (tasks that reply with one), in the model's own dtypes
        (a float64 reply is stored as float32 like every other model)."""
        return [a.astype(d, copy=False) for a, d in zip(self.blocks()[MODEL], self.model_spec.dtypes)]


@dataclass
class Verdicts:
    """What became of one exchange's messages: the sound replies (partition-id order), and why each
    other one does not count: failures (an error reply, no reply) and refused replies (malformed,
    poisoned, unasked), each as (partition id or None, one line)."""

    replies: list[Reply] = field(default_factory=list)
    failures: list[tuple[int | None, str]] = field(default_factory=list)
    refused: list[tuple[int | None, str]] = field(default_factory=list)
    bytes_up: int = 0


FAILED, REFUSED = "failed", "refused"


class RoundMessages:
    """The instructions of the round in progress, as messages, and the check of their replies."""

    def __init__(self, model_spec: ModelSpec, train_sizes: Sequence[int] | None) -> None:
        self.model_spec = model_spec
        self.train_sizes = train_sizes  # per partition: a reply claiming more examples is refused
        self._sent: dict[int, tuple[Instruction, Sent]] = {}
        self._evaluating: dict[int, tuple[Instruction, Sent]] = {}

    @property
    def instructions(self) -> dict[int, Instruction]:
        """This round's instruction to each client, by partition id."""
        return {pid: instruction for pid, (instruction, _) in sorted(self._sent.items())}

    def make(self, instructions: Sequence[Instruction], server_round: int, node_of: Callable[[int], int]) -> list[Message]:
        """One ``Message`` per instruction (at most one per client) to the client's node, remembered for the replies."""
        self._sent = {}
        cache: protocol.RecordCache = {}
        messages = []
        for instruction in instructions:
            if instruction.pid in self._sent:
                raise ValueError(f"two instructions for client {instruction.pid} in round {server_round}")
            self._sent[instruction.pid] = (instruction, Sent.of(instruction.blocks, instruction.config))
            messages.append(self._message(instruction, server_round, node_of, cache))
        return messages

    def make_evaluate(self, instructions: Sequence[Instruction], server_round: int, node_of: Callable[[int], int]) -> list[Message]:
        """One evaluation ``Message`` per client (of an evaluate-kind task: ``evaluate``, carrying the
        model it is evaluated with, or a strategy's own), remembered for the results."""
        cache: protocol.RecordCache = {}
        self._evaluating = {}
        messages = []
        for instruction in instructions:
            self._evaluating[instruction.pid] = (instruction, Sent.of(instruction.blocks, instruction.config))
            messages.append(self._message(instruction, server_round, node_of, cache))
        return messages

    def _message(self, instruction: Instruction, server_round: int, node_of: Callable[[int], int],
                 cache: protocol.RecordCache) -> Message:
        task = instruction.task
        content = task.instruction(instruction.blocks, instruction.config, server_round, self.model_spec.names, cache)
        return Message(content, node_of(instruction.pid), task.message_type, group_id=str(server_round))

    def judge(self, replies: Iterable[Message], pid_of: Callable[[int], int | None]) -> Verdicts:
        """The sound replies among ``replies`` to this round's instructions, in partition-id order
        (arrival order is the transport's, not the seed's); every other one said why, and every
        client sent work that did not answer counted as a failure."""
        verdicts = Verdicts()
        answered: set[int] = set()
        for message in replies:
            pid = pid_of(message.metadata.src_node_id)
            if message.has_content():
                verdicts.bytes_up += protocol.content_nbytes(message.content)
            outcome = self._judge_one(pid, message, answered)
            if isinstance(outcome, Reply):
                verdicts.replies.append(outcome)
            else:
                kind, why = outcome
                (verdicts.failures if kind == FAILED else verdicts.refused).append((pid, why))
        for pid in sorted(set(self._sent) - answered):
            verdicts.failures.append((pid, "no reply within the round timeout (simulation.round_timeout_s)"))
        verdicts.replies.sort(key=lambda r: r.pid)
        return verdicts

    def _judge_one(self, pid: int | None, message: Message, answered: set[int]) -> Reply | tuple[str, str]:
        instruction, sent = self._sent.get(pid, (None, None)) if pid is not None else (None, None)
        if instruction is None or sent is None:
            return REFUSED, "not asked to work this round"
        if pid in answered:
            return REFUSED, "a second reply in this round (a client answers once; its first reply was judged)"
        answered.add(pid)
        if message.has_error():
            return FAILED, describe_error(message)
        try:
            content = message.content
            metrics = _metrics(content)
            problem = self._problem_with_count(pid, metrics.get(NUM_EXAMPLES)) or \
                instruction.task.problem_with_metrics(metrics, sent) or \
                instruction.task.problem_with_arrays(content, sent, self.model_spec)
        except Exception as err:  # noqa: BLE001 - any unreadable reply is a refused reply
            problem = f"unreadable reply ({type(err).__name__}: {err})"
        if problem is not None:
            return REFUSED, problem
        count = int(metrics.pop(NUM_EXAMPLES))
        return Reply(instruction, count, metrics, content, sent, self.model_spec)

    def _problem_with_count(self, pid: int, count: object) -> str | None:
        limit = self.train_sizes[pid] if self.train_sizes is not None else None
        if protocol.is_int(count) and count >= 1 and (not limit or count <= limit):
            return None
        return f"{NUM_EXAMPLES}={count!r}, expected an integer in 1..{limit or 'n'}"

    def judge_evaluations(self, replies: Iterable[Message], pid_of: Callable[[int], int | None]) -> tuple[
            dict[int, Mapping[str, Scalar]], dict[int, str]]:
        """Each client's sound evaluation metrics, by partition id (in order), and why the others
        (errors, malformed results, clients that did not answer) are left out."""
        results: dict[int, Mapping[str, Scalar]] = {}
        problems: dict[int, str] = {}
        seen: set[int] = set()
        for message in replies:
            pid = pid_of(message.metadata.src_node_id)
            if pid is None or pid not in self._evaluating:
                problems[-1 if pid is None else pid] = "not asked to evaluate this round"
                continue
            if pid in seen:
                problems[pid] = "a second evaluation result in this round (a client answers once; its first was judged)"
                continue
            seen.add(pid)
            if message.has_error():
                problems[pid] = describe_error(message)
                continue
            instruction, sent = self._evaluating[pid]
            try:
                metrics = _metrics(message.content)
                problem = instruction.task.problem_with_metrics(metrics, sent) or \
                    instruction.task.problem_with_arrays(message.content, sent, self.model_spec)
            except Exception as err:  # noqa: BLE001 - an unreadable result is ignored
                problem = f"unreadable result ({type(err).__name__}: {err})"
            if problem is None:
                metrics.pop(NUM_EXAMPLES, None)
                results[pid] = metrics
            else:
                problems[pid] = problem
        for pid in sorted(set(self._evaluating) - seen):
            problems[pid] = "no evaluation result within the round timeout (simulation.round_timeout_s)"
        return dict(sorted(results.items())), problems


def _metrics(content: RecordDict) -> dict[str, Scalar]:
    """The ``metrics`` record of a reply (a reply without one is malformed)."""
    if protocol.METRICS not in content.metric_records:
        raise protocol.ProtocolError(f"no {protocol.METRICS!r} record (got {', '.join(sorted(content)) or 'none'})")
    return dict(content.metric_records[protocol.METRICS])


def train_losses(replies: Sequence[Reply]) -> list[float]:  # the finite ones the replies report
    return [float(v) for r in replies if protocol.is_finite_number(v := r.metrics.get(protocol.TRAIN_LOSS))]


def describe_error(message: Message) -> str:
    """One line saying why a client's work failed, however the transport carried it."""
    reason = message.error.reason or f"error code {message.error.code}"
    # Flower's simulation wraps a ClientApp's exception in Ray's whole traceback; the client's own
    # message follows the last "Message: ". One line per failure, however it travelled.
    if "Message: " in reason:
        reason = reason.rsplit("Message: ", 1)[1].split("'>", 1)[0]
    lines = reason.strip().splitlines()
    return lines[0] if lines else reason
