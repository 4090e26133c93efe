"""The ``inprocess`` and ``batched`` engines: Flower ``Grid`` s whose nodes live in this process.

:class:`InProcessGrid` hands each message to the ClientApp as Flower's runtime does on a node:
``client_app(message, context)``, with the node's ``Context`` (its node config, ``partition-id`` and
``num-partitions``, and its ``state``, kept across rounds); a ClientApp that raises is an error reply
(Flower's ``CLIENT_APP_RAISED_EXCEPTION``), what the strategy counts as that client's failure. The
records travel as they are, already serialized by the sender, exactly as through Flower's grids;
only the transport, Ray's actors and the polling are missing. A round's messages run one after
another in node order, which is partition-id order (node ids are unrelated to partition ids, as
Flower's are, but increase with them). Fast and deterministic: the behaviour-preservation test,
seed sweeps and quick studies use it; a slow test shows it gives the Ray engine's rounds bit for bit.

An exception that is not an ``Exception`` (Ctrl-C, ``SystemExit``) is never a client's failure: it
stops the run, as does one the grid names its own (:meth:`InProcessGrid.engine_fault`, the batched
engine's errors).

:class:`BatchedGrid` is the same grid with an exchange's ClientApp calls run through the batched
engine's rendezvous (:mod:`.batched`): each call in a thread of its own, the clients' torch work
executed together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from ..config.sections import ExperimentConfig
from ..numerics import client_device
from ..protocol import IDENTIFY
from .batched import CPU_UNSTACKED_MODELS, BatchPolicy, EngineError, Rendezvous, cpu_threads, default_memory_bytes, execute

ClientAppCall = Callable[[Message, Context], Message]  # a ClientApp, or anything called like one

PARTITION_ID, NUM_PARTITIONS = "partition-id", "num-partitions"  # the node config Flower's simulation gives


def node_id_of(pid: int) -> int:
    """The node id of partition ``pid``'s node: unrelated to the partition id, as Flower's are."""
    return 1000 + 7 * pid


def partition_node_configs(num_clients: int) -> list[dict[str, int]]:
    """The node configs of a simulation of ``num_clients`` partitions, as Flower's simulation gives them."""
    return [{PARTITION_ID: pid, NUM_PARTITIONS: num_clients} for pid in range(num_clients)]


class InProcessGrid(Grid):
    """A Grid over nodes in this process; see the module docstring."""

    def __init__(
        self,
        client_app: ClientAppCall,
        node_configs: Sequence[Mapping[str, Any]],
        run_id: int = 1,
        run_config: Mapping[str, Any] | None = None,
        node_ids: Sequence[int] | None = None,
    ) -> None:
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        ids = [node_id_of(i) for i in range(len(node_configs))] if node_ids is None else list(node_ids)
        self.contexts = {
            node_id: Context(run_id, node_id, dict(config), RecordDict(), dict(run_config or {}))
            for node_id, config in zip(ids, node_configs)
        }
        self._waiting: dict[str, Message] = {}  # message id -> instruction not yet run
        self._replies: dict[str, Message] = {}  # instruction's message id -> its reply
        self._sent = 0
        # A ServerApp's messages name their run and sender (flwr.app.Message reads TaskIdentity), which
        # Flower's runtime sets for the ServerApp's process; this process is that runtime here.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 1

    # ---- Flower's Grid ---------------------------------------------------------------------------

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Queue each message for its node; a message to a node this grid lacks is dropped (no reply
        comes), as a SuperLink drops one to a node it does not know."""
        ids = []
        for message in messages:
            self._sent += 1
            message_id = f"{self._sent}"
            message.metadata.__dict__["_message_id"] = message_id  # as Flower's InMemoryGrid sets it
            if message.metadata.dst_node_id in self.contexts:
                self._waiting[message_id] = message
                ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies to ``message_ids``, running the ones still waiting first (in node order)."""
        wanted = [i for i in message_ids if i in self._waiting or i in self._replies]
        waiting = sorted((i for i in wanted if i in self._waiting), key=lambda i: self._waiting[i].metadata.dst_node_id)
        for message_id, reply in zip(waiting, self.deliver([self._waiting.pop(i) for i in waiting])):
            self._replies[message_id] = reply
        return [self._replies.pop(i) for i in wanted if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    # ---- running the ClientApp -----------------------------------------------------------------

    def deliver(self, messages: Sequence[Message]) -> list[Message]:
        """Each message's reply from the ClientApp on its node, one after another."""
        return [self.reply(message, self.outcome(lambda m=message: self.client_app(m, self.contexts[m.metadata.dst_node_id])))
                for message in messages]

    @staticmethod
    def outcome(call: Callable[[], Message]) -> tuple[bool, Any]:
        try:
            return True, call()
        except Exception as err:  # noqa: BLE001 - sorted by reply(): a client's failure or the engine's
            return False, err

    def reply(self, message: Message, outcome: tuple[bool, Any]) -> Message:
        """The reply to ``message`` from its ClientApp call's outcome: the reply it returned, or an
        error reply; an engine fault or a stop is raised instead."""
        ok, value = outcome
        if ok:
            return value
        if not isinstance(value, Exception) or self.engine_fault(value):
            raise value
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(value).__name__}: {value}"), reply_to=message)

    def engine_fault(self, err: Exception) -> bool:
        """Whether ``err`` is this engine's own fault rather than the client's (default: never)."""
        return False


class BatchedGrid(InProcessGrid):
    """The in-process grid whose exchanges run through a :class:`Rendezvous`: each message's ClientApp
    call in a thread of its own, the clients' torch work executed together (the ClientApp's clients
    compute with :class:`BatchedCompute` on the same rendezvous). Replies in node order; the
    engine's own errors (:class:`EngineError`) stop the run."""

    def __init__(self, *args: Any, rendezvous: Rendezvous, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rendezvous = rendezvous

    def deliver(self, messages: Sequence[Message]) -> list[Message]:
        if all(m.metadata.message_type == IDENTIFY.message_type for m in messages):
            return super().deliver(messages)  # who is who: no torch work to meet for
        calls = [lambda m=message: self.client_app(m, self.contexts[m.metadata.dst_node_id]) for message in messages]
        outcomes = self.rendezvous.run_all(calls, task=",".join(sorted({m.metadata.message_type for m in messages})))
        return [self.reply(message, outcome) for message, outcome in zip(messages, outcomes)]

    def engine_fault(self, err: Exception) -> bool:
        return isinstance(err, EngineError)


def batched_rendezvous(config: ExperimentConfig, cores: int | None = None) -> Rendezvous:
    """The meeting point of a batched run's clients, with its stacking policy and memory budget;
    ``cores``: the CPU cores its workers may take (default: the ones this process may use)."""
    device = client_device(config)
    memory = config.simulation.batched_memory_gb
    policy = BatchPolicy(
        stack_on_cpu=config.model.name not in CPU_UNSTACKED_MODELS,
        memory_bytes=default_memory_bytes(device) if memory is None else int(memory * 1024**3),
        workers=(config.simulation.batched_workers or cores or cpu_threads()) if device.type == "cpu" else 1,
    )
    return Rendezvous(lambda batch: execute(batch, policy), close=policy.close)
