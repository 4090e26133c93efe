"""The wire protocol between the strategies and the ClientApp, declared once for both sides, over
Flower's records.

Each round a strategy sends every chosen client an *instruction*: a Flower ``Message`` whose type
names the task (``train`` and ``evaluate`` for the two tasks every algorithm uses, ``train.<task>``
or ``query.<task>`` for a family's own), whose content holds named blocks of arrays as
``ArrayRecord``s and the task's scalars in the ``ConfigRecord`` ``config`` (with ``server-round``).
A block of one item travels as one ``ArrayRecord`` named after the block, a block of several items
as one ``ArrayRecord`` per item, ``<block>.<k>``; a model's arrays are named by the model's
``state_dict`` keys, other arrays by their index. The reply carries one ``ArrayRecord`` per block
its task declares, named after it, and the ``MetricRecord`` ``metrics`` with ``num-examples`` and
the task's metrics. The one model of ``train`` and ``evaluate`` is the record ``arrays``, the
weighting key is ``num-examples`` and the round is ``server-round``, as in Flower's own strategies,
so Flower's stock ``FedAvg`` can drive those two tasks of our ClientApp.

Every reply is checked against its task's schema (which records, of which shapes given the
instruction; which metrics, with which checks; every metric a finite number unless the task says
it may not be) before any of its arrays touches a model.

The three tasks every run uses:

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``train``          ``arrays`` (the model), ``epochs``   ``arrays`` (the model, trained)     ``train_loss``
                   (optional), ``objective``
                   (optional) and its scalars
``evaluate``       ``arrays`` (the model)               –                                   ``accuracy`` in [0, 1],
                                                                                             ``test_loss`` (+ ``val_loss``)
``identify``       –                                    –                                   ``partition_id``,
(query)                                                                                      ``num_partitions`` (+ a
                                                                                             device's own facts)
=================  ===================================  ==================================  ===========================

Each algorithm family's own tasks are declared, with their keys, reply schema and client
handlers, in its package of :mod:`fedcluster_flwr.algorithms`: ``train_select`` and ``select`` in
:mod:`~fedcluster_flwr.algorithms.base.selection`, ``gram_eigen`` and ``relevance`` in
:mod:`~fedcluster_flwr.algorithms.oneshot.tasks`, ``gossip_train`` in :mod:`~fedcluster_flwr.algorithms.dac.tasks`.

Task names, block names and the config and metric keys appear nowhere else as literals:
the ClientApp registers its handlers under these :class:`Task` objects' message types, the
strategies build :class:`~fedcluster_flwr.algorithms.base.messages.Instruction` objects from them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from .types import NDArrays, Scalar

# ---- keys ---------------------------------------------------------------------------------

# Records of a message's content.
CONFIG = "config"  # an instruction's scalars (Flower's FedAvg: configrecord_key)
METRICS = "metrics"  # a reply's metrics

# Instruction config.
ROUND_KEY = "server-round"  # the round, as Flower's strategies send it (it steers the client's randomness)
EPOCHS_KEY = "epochs"  # train (optional): local epochs instead of the client's own (client.epochs), e.g. pretraining
# train (optional): the local objectives to train on, comma-separated registered names (registry.objective),
# e.g. "proximal"; each objective's own scalars (e.g. "mu") travel beside it
OBJECTIVE_KEY = "objective"

# What a client tells about itself once (task ``identify``), so the server learns who it is.
PARTITION_ID = "partition_id"
NUM_PARTITIONS = "num_partitions"
# ... and, from a device on its own data (data.device): that flag, and the facts it knows.
OWN_DATA = "own_data"  # 1 for a device on its own data folder (data-dir), 0 for a partition of the experiment
TRAIN_EXAMPLES = "train_examples"
TRUE_CLUSTER = "true_cluster"  # -1 where the device does not know it

# Reply metrics.
NUM_EXAMPLES = "num-examples"  # the examples a reply's work used (Flower's FedAvg: weighted_by_key)
TRAIN_LOSS = "train_loss"
ACCURACY = "accuracy"
TEST_LOSS = "test_loss"  # evaluate: mean cross-entropy on the test split
VAL_LOSS = "val_loss"  # evaluate, where the client holds a validation split
# Per item of a block (loss_0, loss_1, ...): per model in train_select/select, per neighbour in
# gossip_train; declared here, not in one family, because two families reply with it.
LOSS = "loss"

# Block names.
MODEL = "arrays"  # one model (sent to train or evaluate, replied trained): Flower's own record name for it
MODELS = "models"  # items: whole models (K cluster models; a client's own and its neighbours')

# Message categories (Flower's message types: "train", "train.<action>", "query.<action>", "evaluate").
TRAIN_KIND, QUERY_KIND, EVALUATE_KIND = "train", "query", "evaluate"
KINDS = (TRAIN_KIND, QUERY_KIND, EVALUATE_KIND)

# Beyond this magnitude a replied value would overflow float32 sums and distances.
MAX_ABS_VALUE = 1e6
BOUND_TOLERANCE = 1e-5  # float32 round-off allowed past a quantity's bounds (e.g. r(i, i) = 1)


def indexed(metric: str, k: int) -> str:
    """Name of the ``k``-th value of a per-item metric: ``indexed(LOSS, 2) == "loss_2"``."""
    return f"{metric}_{k}"


class ProtocolError(ValueError):
    """A message that does not follow the protocol (missing record, block or key)."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- arrays <-> records ----------------------------------------------------------------------

Blocks = Mapping[str, Sequence[NDArrays]]  # block name -> items, each item a list of arrays
RecordCache = dict[int, tuple[NDArrays, ArrayRecord]]  # id(item) -> (the item, its record)

_ITEM_RECORD = re.compile(r"^(?P<block>[A-Za-z_][A-Za-z0-9_]*)(\.(?P<k>\d+))?$")


def array_record(arrays: Sequence[np.ndarray], names: Sequence[str] | None = None) -> ArrayRecord:
    """``arrays`` as one record, under ``names`` (a model's ``state_dict`` keys) or their indices."""
    keys = [str(i) for i in range(len(arrays))] if names is None else list(names)
    if len(keys) != len(arrays):
        raise ProtocolError(f"{len(keys)} names for {len(arrays)} arrays")
    record = ArrayRecord()
    for key, array in zip(keys, arrays):
        record[key] = Array(np.asarray(array))
    return record


def record_arrays(record: ArrayRecord) -> NDArrays:
    """A record's arrays, in their order (deserialized on each call)."""
    return [array.numpy() for array in record.values()]


def item_records(block: str, count: int) -> list[str]:
    """The record names of a block of ``count`` items: the block's name for one, ``<block>.<k>`` otherwise."""
    return [block] if count == 1 else [f"{block}.{k}" for k in range(count)]


def block_records(
    blocks: Blocks, named: Sequence[str], model_names: Sequence[str] | None, cache: RecordCache | None = None
) -> dict[str, ArrayRecord]:
    """The ``ArrayRecord`` of every item of ``blocks``; the items of blocks in ``named`` are models,
    their arrays named by ``model_names``. ``cache`` (keyed by the identity of an item's list, so
    valid while the items live) lets a model that many clients receive this round be serialized once."""
    cache = {} if cache is None else cache
    records = {}
    for block, items in blocks.items():
        for name, item in zip(item_records(block, len(items)), items):
            if id(item) not in cache:
                names = model_names if block in named and model_names is not None and len(model_names) == len(item) else None
                cache[id(item)] = (item, array_record(item, names))  # the item too: its id stays its own
            records[name] = cache[id(item)][1]
    return records


def content_nbytes(content: RecordDict) -> int:
    """The serialized arrays a message carries, in bytes (what travels, records and scalars aside)."""
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())


# ---- what a reply must look like -------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Names, shapes and dtypes of a model's arrays (its ``state_dict`` order)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, names: Sequence[str], arrays: NDArrays) -> ModelSpec:
        if len(names) != len(arrays):
            raise ValueError(f"{len(names)} names for {len(arrays)} arrays")
        return cls(tuple(names), tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))

    def arrays(self) -> list[ArraySpec]:
        return [ArraySpec(shape, dtype.kind) for shape, dtype in zip(self.shapes, self.dtypes)]


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    kind: str = "f"  # numpy dtype kind
    low: float | None = None  # bounds on the values, where the quantity has them
    high: float | None = None


@dataclass(frozen=True)
class Sent:
    """What a reply check may know of the instruction: items per block (blocks with items only) and the config."""

    items: Mapping[str, int]
    config: Mapping[str, Scalar]

    @classmethod
    def of(cls, blocks: Blocks, config: Mapping[str, Scalar]) -> Sent:
        return cls({name: len(items) for name, items in blocks.items() if len(items)}, config)


MetricCheck = Callable[[Mapping[str, Scalar], Sent], "str | None"]
ReplyShapes = Callable[[Sent, ModelSpec], dict[str, list[ArraySpec]]]


def index_into(metric: str, block: str) -> MetricCheck:
    """``metric`` is an integer index into the items of the sent ``block``."""

    def check(metrics: Mapping[str, Scalar], sent: Sent) -> str | None:
        count, value = sent.items.get(block, 0), metrics.get(metric)
        if is_int(value) and 0 <= value < count:
            return None
        return f"metric {metric!r} must be an integer in 0..{count - 1} (an index into the {count} {block}), got {value!r}"

    return check


def one_per_item(metric: str, block: str, skip: int = 0, finite: bool = False, minimum: float | None = None) -> MetricCheck:
    """One number ``metric_k`` per item of the sent ``block`` (after its first ``skip`` items)."""

    def check(metrics: Mapping[str, Scalar], sent: Sent) -> str | None:
        count = max(sent.items.get(block, 0) - skip, 0)
        for k in range(count):
            value = metrics.get(indexed(metric, k))
            valid = is_finite_number(value) if finite else isinstance(value, (int, float)) and not isinstance(value, bool)
            if valid and minimum is not None:
                valid = value >= minimum
            if not valid:
                what = "a finite number" if finite else "a number"
                what += f" >= {minimum:g}" if minimum is not None else ""
                return f"metric {indexed(metric, k)!r} must be {what} (one per {block} item, {count} in all), got {value!r}"
        return None

    return check


def in_unit_interval(metric: str) -> MetricCheck:
    def check(metrics: Mapping[str, Scalar], sent: Sent) -> str | None:
        value = metrics.get(metric)
        if is_finite_number(value) and 0.0 <= value <= 1.0:
            return None
        return f"metric {metric!r} must be a number in [0, 1], got {value!r}"

    return check


def finite(metric: str) -> MetricCheck:
    def check(metrics: Mapping[str, Scalar], sent: Sent) -> str | None:
        value = metrics.get(metric)
        return None if is_finite_number(value) else f"metric {metric!r} must be a finite number, got {value!r}"

    return check


def when_sent(block: str, check: MetricCheck) -> MetricCheck:
    """Apply ``check`` only when the instruction carried ``block``."""
    return lambda metrics, sent: check(metrics, sent) if block in sent.items else None


@dataclass(frozen=True)
class TaskInput:
    """An instruction as the client reads it: the round, the named blocks and the config scalars."""

    server_round: int
    blocks: Mapping[str, list[NDArrays]]
    config: Mapping[str, Scalar]


@dataclass(frozen=True)
class Task:
    """One kind of work a client can be asked for; see the tables of this module and of the family modules.

    ``kind`` is the Flower message category it travels as (``train``: it trains a model; ``query``:
    it only reports; ``evaluate``); a task named after its kind is Flower's default action of that
    kind. ``may_be_nonfinite`` names the reply metrics (or per-item metric prefixes: ``loss`` for
    ``loss_0``, ``loss_1``, ...) that may be NaN or infinite; every other reply metric must be a
    finite number. The items of the blocks in ``model_blocks`` are models: their arrays travel under
    the model's ``state_dict`` keys. ``state`` names what its handler keeps on the client's node
    between messages (:class:`~fedcluster_flwr.client.ClientState`): a handler may read and write
    those entries only."""

    name: str
    sends: tuple[str, ...]  # blocks the instruction must carry
    reply: tuple[str, ...]  # blocks of the reply, in order
    reply_shapes: ReplyShapes
    metric_checks: tuple[MetricCheck, ...] = ()
    config: tuple[str, ...] = ()  # scalars the instruction must carry
    optional: tuple[str, ...] = field(default=())  # blocks the instruction may carry
    kind: str = TRAIN_KIND
    may_be_nonfinite: tuple[str, ...] = ()
    model_blocks: tuple[str, ...] = (MODEL, MODELS)
    state: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.kind not in KINDS:
            raise ValueError(f"task {self.name!r} of kind {self.kind!r}: a task's name must be a Python identifier "
                             f"(it is a Flower action) and its kind one of {', '.join(KINDS)}")

    @property
    def action(self) -> str:
        """The Flower action the ClientApp registers its handler under (``default``: the kind's own)."""
        return "default" if self.name == self.kind else self.name

    @property
    def message_type(self) -> str:
        """Flower's message type of its instructions: ``train``, ``evaluate``, ``train.<name>``, ``query.<name>``."""
        return self.kind if self.name == self.kind else f"{self.kind}.{self.name}"

    def check_instruction(self, blocks: Blocks, config: Mapping[str, Scalar]) -> None:
        """A strategy's instruction carries the task's blocks and scalars (a programming error if not)."""
        missing = [b for b in self.sends if not blocks.get(b)] + [k for k in self.config if k not in config]
        unknown = [b for b in blocks if b not in self.sends + self.optional]
        if missing or unknown:
            raise ProtocolError(f"task {self.name!r}: missing {missing}, unexpected {unknown}")

    # ---- client side --------------------------------------------------------------------------

    def instruction(
        self, blocks: Blocks, config: Mapping[str, Scalar], server_round: int,
        model_names: Sequence[str] | None = None, cache: RecordCache | None = None,
    ) -> RecordDict:
        """The content of an instruction of this task (server side): its blocks' records and ``config``."""
        self.check_instruction(blocks, config)
        records: dict[str, Any] = block_records(blocks, self.model_blocks, model_names, cache)
        records[CONFIG] = ConfigRecord({**config, ROUND_KEY: server_round})
        return RecordDict(records)

    def read_instruction(self, content: RecordDict) -> TaskInput:
        """An instruction's round, blocks and scalars (client side), checked: a missing or malformed
        record or key is one :class:`ProtocolError` line naming it, before any work (a round number
        steers the client's randomness, so a wrong one is never guessed)."""
        if CONFIG not in content.config_records:
            raise ProtocolError(f"instruction of task {self.name!r} lacks its {CONFIG!r} record "
                                f"(got records {', '.join(sorted(content)) or 'none'})")
        config = dict(content.config_records[CONFIG])
        server_round = config.get(ROUND_KEY)
        if not is_int(server_round) or server_round < 1:
            raise ProtocolError(f"instruction's {ROUND_KEY!r} must be a round number (an integer >= 1), got {server_round!r}")
        found: dict[str, dict[int, ArrayRecord]] = {}
        declared = self.sends + self.optional
        for name, record in content.array_records.items():
            match = _ITEM_RECORD.match(name)
            if match is None or match["block"] not in declared:
                raise ProtocolError(f"task {self.name!r}: unexpected record {name!r} (its blocks: {', '.join(declared) or 'none'})")
            found.setdefault(match["block"], {})[int(match["k"]) if match["k"] is not None else -1] = record
        blocks: dict[str, list[NDArrays]] = {}
        for block, items in found.items():
            expected = item_records(block, len(items))
            if sorted(items) != ([-1] if len(items) == 1 else list(range(len(items)))):
                got = sorted(name for name in content.array_records if name.split(".")[0] == block)
                raise ProtocolError(f"task {self.name!r}: block {block!r} must travel as {expected}, got {got}")
            blocks[block] = [record_arrays(items[k]) for k in sorted(items)]
        self.check_instruction(blocks, config)
        return TaskInput(server_round, blocks, config)

    def reply_content(
        self, blocks: Mapping[str, NDArrays], num_examples: int, metrics: Mapping[str, Scalar],
        model_names: Sequence[str] | None = None,
    ) -> RecordDict:
        """The content of a reply (client side): one record per declared reply block and the metrics."""
        if set(blocks) != set(self.reply):
            raise ProtocolError(f"task {self.name!r} replies with {list(self.reply)}, got {sorted(blocks)}")
        records: dict[str, Any] = {
            name: array_record(blocks[name], model_names if name in self.model_blocks and model_names is not None
                               and len(model_names) == len(blocks[name]) else None)
            for name in self.reply
        }
        records[METRICS] = MetricRecord({**metrics, NUM_EXAMPLES: num_examples})
        return RecordDict(records)

    # ---- server side --------------------------------------------------------------------------

    def problem_with_metrics(self, metrics: Mapping[str, Any], sent: Sent) -> str | None:
        """Why a reply's metrics must be refused, naming the task and the metric; None if they are sound."""
        for key, value in metrics.items():
            if key == NUM_EXAMPLES:
                continue
            allowed = any(key == name or key.startswith(f"{name}_") for name in self.may_be_nonfinite)
            if not (is_finite_number(value) or allowed and isinstance(value, float)):
                return f"task {self.name}: metric {key!r} must be a finite number, got {value!r}"
        for check in self.metric_checks:
            problem = check(metrics, sent)
            if problem is not None:
                return f"task {self.name}: {problem}"
        return None

    def problem_with_arrays(self, content: RecordDict, sent: Sent, model: ModelSpec) -> str | None:
        """Why a reply's arrays must be refused, naming the task and what was expected; None if they are sound."""
        names = sorted(content.array_records)
        if names != sorted(self.reply):
            return f"task {self.name}: expected the records {list(self.reply)}, got {names}"
        arrays = [array for name in self.reply for array in record_arrays(content.array_records[name])]
        shapes = self.reply_shapes(sent, model)
        named = [(name, spec) for name in self.reply for spec in shapes[name]]
        expected = [spec.shape for _, spec in named]
        if [a.shape for a in arrays] != expected:
            return f"task {self.name}: expected arrays of shapes {expected}, got {[a.shape for a in arrays]}"
        if any(a.dtype.kind != spec.kind for a, (_, spec) in zip(arrays, named)):
            return f"task {self.name}: arrays of the wrong kind (e.g. strings or objects)"
        if not all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f"):
            return f"task {self.name}: non-finite values (NaN/inf)"
        if any(a.size and np.abs(a).max() > MAX_ABS_VALUE for a in arrays):
            return f"task {self.name}: values beyond +-{MAX_ABS_VALUE:g}"
        for array, (name, spec) in zip(arrays, named):
            if array.size and spec.low is not None and array.min() < spec.low - BOUND_TOLERANCE:
                return f"task {self.name}: {name} values must be >= {spec.low:g}, got {array.min():g}"
            if array.size and spec.high is not None and array.max() > spec.high + BOUND_TOLERANCE:
                return f"task {self.name}: {name} values must be <= {spec.high:g}, got {array.max():g}"
        return None


def one_model(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    """Reply shapes of a task that returns one model (``arrays``, shaped as the strategy's)."""
    return {MODEL: model.arrays()}


def no_arrays(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    """Reply shapes of a task that returns metrics only."""
    return {}


TRAIN = Task("train", sends=(MODEL,), reply=(MODEL,), reply_shapes=one_model)
EVALUATE = Task(
    "evaluate",
    sends=(MODEL,),
    reply=(),
    reply_shapes=no_arrays,
    metric_checks=(in_unit_interval(ACCURACY), finite(TEST_LOSS)),
    kind=EVALUATE_KIND,
)
IDENTIFY = Task(
    "identify",
    sends=(),
    reply=(),
    reply_shapes=no_arrays,
    kind=QUERY_KIND,
)
