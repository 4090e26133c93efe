"""Helpers the test modules share (no test imports from another test module): run-file checks,
a synthetic model, a grid of synthetic Flower nodes (:class:`SyntheticGrid`, our in-process grid
over a ClientApp that answers as each test says), :func:`synthetic_round`, which plays one round of
a strategy on it (the strategy's own ``play_round``), CIFAR-10 files in the real format, and
:func:`load_benchmark`, a benchmark script imported as a module."""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import yaml
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr import protocol
from fedcluster_flwr.config.load import config_to_dict, load_config
from fedcluster_flwr.protocol import ACCURACY, EVALUATE, IDENTIFY, METRICS, MODEL, MODELS, NUM_EXAMPLES, TEST_LOSS, Task
from fedcluster_flwr.algorithms.base.directory import Federation
from fedcluster_flwr.engines.inprocess import InProcessGrid
from fedcluster_flwr.results.recorder import RunRecorder
from fedcluster_flwr.results.round_log import RoundLog
from fedcluster_flwr.algorithms.base import StrategySetup
from fedcluster_flwr.algorithms.base.strategy import ClusteredStrategy
from fedcluster_flwr.algorithms.base.messages import Instruction
from fedcluster_flwr.algorithms.base.selection import SELECTED, SIMILARITY
from fedcluster_flwr.types import NDArrays, Scalar


def load_benchmark(script: str) -> ModuleType:
    """``benchmarks/<script>`` (a script, not a package module) imported as a module of its own, so a
    test can call its functions; e.g. ``load_benchmark("dac/table.py")``."""
    path = ROOT / "benchmarks" / script
    spec = importlib.util.spec_from_file_location("benchmark_" + script.removesuffix(".py").replace("/", "_"), path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: a dataclass there looks its module up by name
    spec.loader.exec_module(module)
    return module


def rows_without_timing(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rounds.jsonl`` rows without their wall-clock ``seconds``."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def assert_same_state(got: Any, expected: Any, path: str = "state", skip: Sequence[str] = ()) -> None:
    """Two state trees (dicts, lists, arrays, scalars) are equal bit for bit (NaN equals NaN);
    keys named in ``skip`` are not compared."""
    if isinstance(expected, Mapping):
        assert isinstance(got, Mapping), f"{path}: {type(got).__name__}, expected a mapping"
        assert set(got) == set(expected), f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, expected))}"
        for key in expected:
            if key not in skip:
                assert_same_state(got[key], expected[key], f"{path}.{key}", skip)
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got).__name__}, expected an array"
        assert got.dtype == expected.dtype and got.shape == expected.shape, f"{path}: {got.dtype}{got.shape}"
        assert np.array_equal(got, expected, equal_nan=got.dtype.kind == "f"), f"{path}: values differ"
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), f"{path}: {got!r} != {expected!r}"
        for k, (a, b) in enumerate(zip(got, expected)):
            assert_same_state(a, b, f"{path}[{k}]", skip)
    elif isinstance(expected, float) and np.isnan(expected):
        assert isinstance(got, float) and np.isnan(got), f"{path}: {got!r}, expected NaN"
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def finished_looking_run(run_dir: Path, done: int = 3) -> Path:
    """A run directory as `fedcluster run --stop-after 3` leaves it (checkpoint at round ``done``),
    with placeholder files where only their presence matters."""
    config, _ = load_config(DEFAULT_CONFIG, [])
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    (run_dir / "checkpoint" / "state.json").write_text(json.dumps({"format": 2, "round": done, "strategy": {}, "log": {}}))
    np.savez(run_dir / "checkpoint" / "models.npz", round=np.asarray(done))
    (run_dir / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(1, done + 1)))
    (run_dir / "accuracy.png").write_bytes(b"png")
    return run_dir


# ---- synthetic models ----------------------------------------------------------------------------

SHAPES = [(4, 3), (3,)]  # the synthetic model: a 4x3 weight and a bias
DIM = 15  # its number of parameters


def unflatten(vector: np.ndarray) -> NDArrays:
    """A parameter vector of length DIM as the synthetic model's float32 arrays."""
    out, start = [], 0
    for shape in SHAPES:
        size = int(np.prod(shape))
        out.append(vector[start : start + size].reshape(shape).astype(np.float32))
        start += size
    return out


def flat(arrays: NDArrays) -> np.ndarray:
    return np.concatenate([a.ravel() for a in arrays])


def constant_model(value: float, dtype: Any = np.float32) -> NDArrays:
    """The synthetic model with every parameter ``value``."""
    return [np.full(s, value, dtype) for s in SHAPES]


def random_weights(seed: int) -> NDArrays:
    """A freshly initialised synthetic model (a StrategySetup's ``init_weights``)."""
    return unflatten(np.random.default_rng(seed).normal(size=DIM))


def select_metrics(chosen: int, losses: Sequence[float], similarities: Sequence[float] = ()) -> dict[str, Scalar]:
    """What a selection reply reports: the chosen index, every model's loss and, where directions
    were sent, every model's similarity."""
    return ({SELECTED: chosen}
            | {protocol.indexed(protocol.LOSS, k): float(v) for k, v in enumerate(losses)}
            | {protocol.indexed(SIMILARITY, k): float(v) for k, v in enumerate(similarities)})


# ---- replies as a client would send them --------------------------------------------------------


def metrics_record(metrics: Mapping[str, Any]) -> MetricRecord | ConfigRecord:
    """``metrics`` as a reply's ``metrics`` record; values a MetricRecord cannot hold (a string, a
    bool), as a hostile client might try, make it a ConfigRecord, which the server cannot read as metrics."""
    try:
        return MetricRecord(dict(metrics))
    except TypeError:
        return ConfigRecord(dict(metrics))


def reply_content(blocks: Mapping[str, NDArrays], n: int = 10, metrics: Mapping[str, Any] | None = None) -> RecordDict:
    """A reply's content: one record per block, and the metrics with ``num-examples`` ``n``."""
    records: dict[str, Any] = {name: ArrayRecord([np.asarray(a) for a in arrays]) for name, arrays in blocks.items()}
    records[METRICS] = metrics_record({**(metrics or {}), NUM_EXAMPLES: n})
    return RecordDict(records)


def fit_res(weights: NDArrays, n: int = 10, metrics: Mapping[str, Any] | None = None,
            tensors: list[bytes] | None = None) -> RecordDict:
    """A successful train reply's content; ``tensors`` replaces the serialized arrays (to send garbage)."""
    content = reply_content({MODEL: weights}, n, metrics)
    if tensors is not None:
        record = content.array_records[MODEL]
        for key, data in zip(list(record), tensors):
            old = record[key]
            record[key] = Array(dtype=old.dtype, shape=tuple(old.shape), stype=old.stype, data=data)
    return content


def pack_reply(task: Task, blocks: Mapping[str, NDArrays]) -> NDArrays:
    """A synthetic client's reply arrays for ``task``: its blocks' arrays one after another, in the
    task's order (:func:`reply_blocks` cuts them apart again)."""
    return [array for name in task.reply for array in blocks[name]]


def reply_to(message: Message, content: RecordDict) -> Message:
    """The reply a node sends to ``message``."""
    return Message(content, reply_to=message)


def configure(strategy: ClusteredStrategy, rnd: int, grid: Any) -> list[Message]:
    """The strategy's round-``rnd`` training messages on ``grid`` (Flower's ``configure_train``)."""
    return strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)


# ---- a grid of synthetic Flower nodes -----------------------------------------------------------------


@dataclass
class SyntheticNode:
    """A Flower node that tells the partition ``pid`` it claims (well-formed or not) and answers its
    work as the round's :class:`RoundPlan` says (:func:`synthetic_round` sets it); ``name`` is the
    test's word for it. ``identify`` replaces the identity it tells (a device's own facts), or
    raises to fail the query."""

    name: str
    pid: Any
    num_partitions: int
    identify: Callable[[], Mapping[str, Any]] | None = None


class SyntheticGrid(InProcessGrid):
    """Our in-process grid over synthetic nodes: the ClientApp behind it is the test's plan. Nodes
    can join (:meth:`add`) and leave (:meth:`remove`), as SuperNodes do; ``shuffle`` permutes the
    order in which an exchange's replies come back, as arrival order does."""

    def __init__(self, nodes: Sequence[SyntheticNode]) -> None:
        super().__init__(self.answer, [])
        self.nodes: dict[int, SyntheticNode] = {}
        self.plan: RoundPlan | None = None
        self.shuffle: np.random.Generator | None = None
        for node in nodes:
            self.add(node)

    def add(self, node: SyntheticNode) -> int:
        node_id = 1000 + 7 * (len(self.nodes) + len(self.contexts) + 1)
        while node_id in self.nodes:
            node_id += 1
        self.nodes[node_id] = node
        self.contexts[node_id] = Context(1, node_id, {}, RecordDict(), {})
        return node_id

    def remove(self, name: str) -> None:
        node_id = self.node_named(name)
        del self.nodes[node_id], self.contexts[node_id]

    def node_named(self, name: str) -> int:
        return next(node_id for node_id, node in self.nodes.items() if node.name == name)

    def name_of(self, node_id: int) -> str:
        return self.nodes[node_id].name

    def pids(self, messages: Sequence[Message]) -> list[Any]:
        """The partitions the nodes ``messages`` go to claim, in order."""
        return sorted(self.nodes[m.metadata.dst_node_id].pid for m in messages)

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        if self.shuffle is not None:
            self.shuffle.shuffle(replies)
        return replies

    def answer(self, message: Message, context: Context) -> Message:
        """The synthetic ClientApp."""
        node = self.nodes[context.node_id]
        kind = message.metadata.message_type
        if kind == IDENTIFY.message_type:
            identity = node.identify() if node.identify is not None else {
                protocol.PARTITION_ID: node.pid, protocol.NUM_PARTITIONS: node.num_partitions}
            return reply_to(message, RecordDict({METRICS: metrics_record(identity)}))
        plan = self.plan
        if kind == EVALUATE.message_type:
            (model,) = EVALUATE.read_instruction(message.content).blocks[MODEL]
            loss, metrics = plan.evaluate(node.pid, model)
            return reply_to(message, RecordDict({METRICS: metrics_record({**metrics, TEST_LOSS: loss, NUM_EXAMPLES: 5})}))
        instruction = plan.strategy.messages.instructions[node.pid]
        inputs = instruction.task.read_instruction(message.content)
        received = Received(node.pid, instruction.task.name, inputs.blocks, dict(inputs.config), instruction)
        plan.received[node.pid] = received
        if node.pid in plan.fail:
            raise RuntimeError(f"client {node.pid} failed")
        arrays, num_examples, metrics = plan.reply(received)
        if node.pid in plan.corrupt:
            arrays = [np.full_like(a, np.nan) for a in arrays]
        blocks = reply_blocks(instruction, arrays, plan.strategy)
        return reply_to(message, reply_content(blocks, num_examples, metrics))


def reply_blocks(instruction: Instruction, arrays: NDArrays, strategy: ClusteredStrategy) -> dict[str, NDArrays]:
    """A synthetic client's arrays cut into its task's reply blocks, as many to each as the task's
    schema expects (the rest to the last: a wrong number of arrays still reaches the server's check)."""
    task: Task = instruction.task
    if not task.reply:
        return {}
    shapes = task.reply_shapes(protocol.Sent.of(instruction.blocks, instruction.config), strategy.model_spec)
    blocks, start = {}, 0
    for k, name in enumerate(task.reply):
        count = len(shapes[name]) if k < len(task.reply) - 1 else len(arrays) - start
        blocks[name], start = list(arrays[start : start + count]), start + count
    return blocks


def synthetic_grid(num_clients: int, reported: int | None = None) -> SyntheticGrid:
    """``num_clients`` synthetic nodes, partitions 0..num_clients-1, each reporting ``reported``
    partitions in all (default: ``num_clients``)."""
    return SyntheticGrid([SyntheticNode(str(pid), pid, reported or num_clients) for pid in range(num_clients)])


@dataclass(frozen=True)
class SyntheticSetup(StrategySetup):
    """A StrategySetup, and how its test run is recorded and federated (what the runner would say):
    :func:`connect_test_run` connects a strategy built on it."""

    run_dir: Path = Path(".")
    target_accuracy: float = 0.5
    checkpoint_every: int = 0
    stop_round: int | None = None
    join_round: Mapping[int, int] = field(default_factory=dict)


def make_setup(run_dir: Path, num_clients: int, true: Sequence[int] | None = None, rounds: int = 10,
               seed: int = 0, **extra: Any) -> SyntheticSetup:
    """A StrategySetup over the synthetic model, recording into ``run_dir``; ``true``: the true
    clusters (default: one)."""
    initial = constant_model(0.0)
    true = np.zeros(num_clients, np.int64) if true is None else np.asarray(true)
    return SyntheticSetup(initial, num_clients, true, rounds, seed=seed, run_dir=run_dir, **extra)


def connect_test_run(strategy: ClusteredStrategy, run_dir: Path | None = None, resuming: bool = False) -> RoundLog:
    """Connect ``strategy`` to a round log recording into ``run_dir`` (default: its
    :class:`SyntheticSetup`'s), as the runner does; once (later calls return the same log).
    ``resuming``: the run directory is an existing run's, continued (not started afresh)."""
    if strategy.observer is not None:
        return strategy.observer
    setup = strategy.setup
    recorder = RunRecorder(run_dir or setup.run_dir)
    if not resuming:
        recorder.start({})
    log = RoundLog(recorder, setup.true_clusters, getattr(setup, "target_accuracy", 0.5), setup.rounds,
                   getattr(setup, "checkpoint_every", 0), stop_round=getattr(setup, "stop_round", None),
                   title=strategy.name)
    strategy.connect(Federation(join_round=getattr(setup, "join_round", {}), wait_for_clients_s=0.0), log)
    return log


def recorded_rows(strategy: ClusteredStrategy) -> list[dict[str, Any]]:
    """The rows the strategy's round log recorded."""
    return strategy.observer.recorder.rows


# ---- one round, as the strategy plays it on a grid --------------------------------------------


@dataclass(frozen=True)
class Received:
    """What one client received for a round's work: its task, the blocks and scalars off the wire
    (read from its message's records), and the strategy's :class:`Instruction` for it, which also
    says what never travels (whose model each gossip item is, which cluster each model is)."""

    pid: int
    task: str
    blocks: Mapping[str, list[NDArrays]]
    config: Mapping[str, Scalar]
    instruction: Instruction

    @property
    def models(self) -> list[NDArrays]:
        """The models received: the one of ``train``, or the several of the other tasks."""
        return self.blocks[MODEL] if MODEL in self.blocks else self.blocks[MODELS]

    @property
    def peers(self) -> tuple[int, ...]:
        """Gossip: the clients whose models follow the client's own in ``models``."""
        return self.instruction.peers


FitAnswer = tuple[NDArrays, int, Mapping[str, Scalar]]  # arrays, num_examples, metrics
SyntheticClient = Callable[[Received], FitAnswer]
Evaluation = Callable[[int, NDArrays], tuple[float, Mapping[str, Scalar]]]  # (pid, model) -> loss, metrics


def evaluated_at_80_percent(pid: int, model: NDArrays) -> tuple[float, Mapping[str, Scalar]]:
    """What every client reports unless a test says otherwise: test loss 0.5, accuracy 0.8."""
    return 0.5, {ACCURACY: 0.8}


@dataclass
class RoundPlan:
    """How the synthetic clients answer one round (see :func:`synthetic_round`)."""

    strategy: ClusteredStrategy
    reply: SyntheticClient
    fail: Collection[int]
    corrupt: Collection[int]
    evaluate: Evaluation
    received: dict[int, Received] = field(default_factory=dict)


def synthetic_round(
    strategy: ClusteredStrategy,
    grid: SyntheticGrid,
    rnd: int,
    reply: SyntheticClient,
    *,
    fail: Collection[int] = (),
    corrupt: Collection[int] = (),
    evaluate: Evaluation = evaluated_at_80_percent,
    shuffle: np.random.Generator | None = None,
) -> dict[int, Received]:
    """Play Flower round ``rnd`` of the strategy (its own ``play_round``) on ``grid``'s synthetic
    nodes (connecting the strategy to its test run first, once).

    ``reply(received)`` is the synthetic client: the (arrays, num_examples, metrics) it sends back
    for what it received. A client in ``fail`` raises instead (a failure; ``reply`` is not asked);
    one in ``corrupt`` replies with its arrays turned to NaN. ``evaluate(pid, model)`` is the
    (loss, metrics) of client ``pid`` evaluated on the model it was sent. ``shuffle`` permutes the
    order in which the replies reach the strategy, as arrival order does in Flower.

    Returns what each instructed client received, by partition id, failed ones included.
    """
    connect_test_run(strategy)
    grid.plan = RoundPlan(strategy, reply, fail, corrupt, evaluate)
    grid.shuffle = shuffle
    try:
        strategy.play_round(grid, rnd)
    finally:
        grid.shuffle = None
    return grid.plan.received


# ---- dataset files --------------------------------------------------------------------------------

CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def write_cifar(root: Path, per_batch: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Write ``cifar-10-batches-py`` like the official python version; return images and labels.

    Each batch is a pickled dict whose ``data`` is a uint8 array (n, 3072): the 1024 red
    values of the 32x32 image row by row, then the green, then the blue plane.
    """
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    all_images, all_labels = [], []
    for b, name in enumerate(CIFAR_BATCHES):
        images = rng.integers(0, 256, size=(per_batch, 3, 32, 32), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        data = np.empty((per_batch, 3072), dtype=np.uint8)
        for i in range(per_batch):
            for c in range(3):
                data[i, c * 1024 : (c + 1) * 1024] = images[i, c].reshape(-1)  # row-major plane
        entry = {
            "batch_label": f"batch {b + 1} of 6",
            "labels": labels,
            "data": data,
            "filenames": [f"img_{b}_{i}.png" for i in range(per_batch)],
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle, protocol=2)
        all_images.append(images)
        all_labels.extend(labels)
    return np.concatenate(all_images), np.asarray(all_labels, dtype=np.int64)
