"""The wire protocol between the strategies and ClusterClient, declared once for both sides.

Each round a strategy sends every chosen client an *instruction*: a task, named blocks of
arrays and a few scalars. Flower carries one flat list of arrays and one flat config of
scalars per client, so the codec packs the blocks one after another into the list and writes
their layout into the config (``layout``: ``models=3x8,directions=3x8``, i.e. block name,
items, arrays per item); the other side unpacks by that layout. A reply is packed the same
way, in the order its task declares. Every reply is checked against its task's schema
(which blocks, of which shapes given the instruction; which metrics, with which checks)
before any of its arrays touches a model.

The two tasks every algorithm uses:

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``train``          ``models`` (1), ``epochs``           ``model``                           ``train_loss``
                   (optional), ``objective``
                   (optional) and its scalars
``evaluate``       ``models`` (1)                       –                                   ``accuracy`` in [0, 1]
                                                                                             (+ finite ``val_loss``)
=================  ===================================  ==================================  ===========================

Each algorithm family's own tasks are declared, with their keys, reply schema and client
handlers, in its package of :mod:`fedcluster_flwr.algorithms`: ``train_select`` and ``select`` in
:mod:`~fedcluster_flwr.algorithms.base.selection`, ``gram_eigen`` and ``relevance`` in
:mod:`~fedcluster_flwr.algorithms.oneshot.tasks`, ``gossip_train`` in :mod:`~fedcluster_flwr.algorithms.dac.tasks`.

Task names, block names and the config and metric keys appear nowhere else as literals:
the client looks its handlers up by these :class:`Task` objects, the strategies build
:class:`~fedcluster_flwr.algorithms.base.strategy.Instruction` objects from them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.common import NDArrays, Parameters, Scalar, bytes_to_ndarray, ndarray_to_bytes

# ---- keys ---------------------------------------------------------------------------------

# Instruction config.
TASK_KEY = "task"
ROUND_KEY = "round"
LAYOUT_KEY = "layout"
EPOCHS_KEY = "epochs"  # train (optional): local epochs instead of the client's own (client.epochs), e.g. pretraining
# train (optional): the local objectives to train on, comma-separated registered names (registry.objective),
# e.g. "proximal"; each objective's own scalars (e.g. "mu") travel beside it
OBJECTIVE_KEY = "objective"

# Properties a client reports once (``get_properties``), so the server learns who it is.
PARTITION_ID = "partition_id"
NUM_PARTITIONS = "num_partitions"
# ... and, from a device on its own data (data.device): these, and its true cluster where it knows it.
DATA_SOURCE = "data_source"
DATA_SOURCE_FOLDER = "data-dir"
TRAIN_EXAMPLES = "train_examples"
TRUE_CLUSTER = "true_cluster"

# Reply metrics.
TRAIN_LOSS = "train_loss"
ACCURACY = "accuracy"
VAL_LOSS = "val_loss"  # evaluate, where the client holds a validation split
# Per item of a block (loss_0, loss_1, ...): per model in train_select/select, per neighbour in
# gossip_train; declared here, not in one family, because two families reply with it.
LOSS = "loss"

# Block names.
MODELS = "models"  # items: whole models, arrays in state_dict order
MODEL = "model"  # replied: one model

# Beyond this magnitude a replied value would overflow float32 sums and distances.
MAX_ABS_VALUE = 1e6
BOUND_TOLERANCE = 1e-5  # float32 round-off allowed past a quantity's bounds (e.g. r(i, i) = 1)


def indexed(metric: str, k: int) -> str:
    """Name of the ``k``-th value of a per-item metric: ``indexed(LOSS, 2) == "loss_2"``."""
    return f"{metric}_{k}"


class ProtocolError(ValueError):
    """A message that does not follow the protocol (bad layout, missing block or key)."""


def instruction_header(config: Mapping[str, Scalar]) -> tuple[str, int, str]:
    """The task name, round and layout of an instruction's config (client side), checked: a key
    that is missing or of the wrong kind is a one-line :class:`ProtocolError` naming it, before
    any work (a round number steers the client's randomness, so a wrong one is never guessed)."""
    missing = [key for key in (TASK_KEY, ROUND_KEY, LAYOUT_KEY) if key not in config]
    if missing:
        raise ProtocolError(f"instruction lacks {', '.join(map(repr, missing))} (got keys {', '.join(sorted(config))})")
    task, server_round, layout = config[TASK_KEY], config[ROUND_KEY], config[LAYOUT_KEY]
    if not is_int(server_round) or server_round < 1:
        raise ProtocolError(f"instruction's {ROUND_KEY!r} must be a round number (an integer >= 1), got {server_round!r}")
    if not isinstance(task, str) or not isinstance(layout, str):
        key, value = (TASK_KEY, task) if not isinstance(task, str) else (LAYOUT_KEY, layout)
        raise ProtocolError(f"instruction's {key!r} must be a string, got {value!r}")
    return task, server_round, layout


# ---- the codec ------------------------------------------------------------------------------

Blocks = Mapping[str, Sequence[NDArrays]]  # block name -> items, each item a list of arrays

_LAYOUT_ENTRY = re.compile(r"^([a-z_]+)=(\d+)x(\d+)$")


@dataclass(frozen=True)
class BlockLayout:
    name: str
    items: int
    arrays_per_item: int


def layout_of(blocks: Blocks) -> str:
    """The layout string of ``blocks`` (insertion order), e.g. ``models=3x8,directions=3x8``."""
    entries = []
    for name, items in blocks.items():
        per_item = {len(item) for item in items}
        if len(per_item) > 1:
            raise ProtocolError(f"block {name!r}: its items have different numbers of arrays {sorted(per_item)}")
        entries.append(f"{name}={len(items)}x{per_item.pop() if per_item else 0}")
    return ",".join(entries)


def parse_layout(text: Any) -> list[BlockLayout]:
    if not isinstance(text, str):
        raise ProtocolError(f"{LAYOUT_KEY!r} must be a string, got {text!r}")
    layout = []
    for entry in filter(None, text.split(",")):
        match = _LAYOUT_ENTRY.match(entry)
        if match is None:
            raise ProtocolError(f"malformed layout entry {entry!r} (expected NAME=ITEMSxARRAYS)")
        layout.append(BlockLayout(match[1], int(match[2]), int(match[3])))
    return layout


def unpack(arrays: NDArrays, layout: str) -> dict[str, list[NDArrays]]:
    """Split Flower's flat list of arrays into named blocks of items, by ``layout``."""
    blocks: dict[str, list[NDArrays]] = {}
    start = 0
    for block in parse_layout(layout):
        size = block.items * block.arrays_per_item
        if start + size > len(arrays):
            raise ProtocolError(f"layout {layout!r} needs more than the {len(arrays)} arrays received")
        flat = arrays[start : start + size]
        blocks[block.name] = [
            list(flat[i * block.arrays_per_item : (i + 1) * block.arrays_per_item]) for i in range(block.items)
        ]
        start += size
    if start != len(arrays):
        raise ProtocolError(f"layout {layout!r} accounts for {start} of the {len(arrays)} arrays received")
    return blocks


SerializationCache = dict[int, tuple[NDArrays, list[bytes]]]


def pack_parameters(blocks: Blocks, cache: SerializationCache | None = None) -> tuple[Parameters, str]:
    """Flower's parameters for ``blocks`` (their arrays one after another) and their layout;
    :func:`unpack` of :func:`parameters_to_arrays` of them gives the blocks back.

    ``cache`` (keyed by the identity of an item's list, so valid while the items live) lets
    the models that many clients receive in one round be serialized once.
    """
    cache = {} if cache is None else cache
    tensors: list[bytes] = []
    for items in blocks.values():
        for item in items:
            if id(item) not in cache:
                cache[id(item)] = (item, [ndarray_to_bytes(array) for array in item])  # the item too: its id stays its own
            tensors += cache[id(item)][1]
    return Parameters(tensors=tensors, tensor_type="numpy.ndarray"), layout_of(blocks)


def parameters_to_arrays(parameters: Parameters) -> NDArrays:
    return [bytes_to_ndarray(tensor) for tensor in parameters.tensors]


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
    """What a reply check may know of the instruction: items per block and the config."""

    items: Mapping[str, int]
    config: Mapping[str, Scalar]

    @classmethod
    def of(cls, layout: str, config: Mapping[str, Scalar]) -> Sent:
        return cls({block.name: block.items for block in parse_layout(layout)}, config)


MetricCheck = Callable[[Mapping[str, Scalar], Sent], "str | None"]
ReplyShapes = Callable[[Sent, ModelSpec], dict[str, list[ArraySpec]]]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


def finite_if_present(metric: str) -> MetricCheck:
    def check(metrics: Mapping[str, Scalar], sent: Sent) -> str | None:
        value = metrics.get(metric)
        return None if value is None or is_finite_number(value) else f"metric {metric!r} must be a finite number, got {value!r}"

    return check


def when_sent(block: str, check: MetricCheck) -> MetricCheck:
    """Apply ``check`` only when the instruction carried ``block``."""
    return lambda metrics, sent: check(metrics, sent) if block in sent.items else None


@dataclass(frozen=True)
class Task:
    """One kind of work a client can be asked for; see the tables of this module and of the family modules."""

    name: str
    sends: tuple[str, ...]  # blocks the instruction must carry
    reply: tuple[str, ...]  # blocks of the reply, in packing order
    reply_shapes: ReplyShapes
    metric_checks: tuple[MetricCheck, ...] = ()
    config: tuple[str, ...] = ()  # scalars the instruction must carry
    optional: tuple[str, ...] = field(default=())  # blocks the instruction may carry

    def check_instruction(self, blocks: Blocks, config: Mapping[str, Scalar]) -> None:
        """A strategy's instruction carries the task's blocks and scalars (a programming error if not)."""
        missing = [b for b in self.sends if b not in blocks] + [k for k in self.config if k not in config]
        unknown = [b for b in blocks if b not in self.sends + self.optional]
        if missing or unknown:
            raise ProtocolError(f"task {self.name!r}: missing {missing}, unexpected {unknown}")

    def pack_reply(self, blocks: Mapping[str, NDArrays]) -> NDArrays:
        """The reply's flat list of arrays, in the declared order (client side)."""
        if set(blocks) != set(self.reply):
            raise ProtocolError(f"task {self.name!r} replies with {list(self.reply)}, got {sorted(blocks)}")
        return [array for name in self.reply for array in blocks[name]]

    def problem_with_reply(
        self, arrays: NDArrays, metrics: Mapping[str, Scalar], sent: Sent, model: ModelSpec
    ) -> str | None:
        """Why this reply must be refused, naming the task and what was expected; None if it is sound."""
        for check in self.metric_checks:
            problem = check(metrics, sent)
            if problem is not None:
                return f"task {self.name}: {problem}"
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

    def unpack_reply(self, arrays: NDArrays, sent: Sent, model: ModelSpec) -> dict[str, NDArrays]:
        """Named blocks of a reply that passed :meth:`problem_with_reply` (server side)."""
        shapes = self.reply_shapes(sent, model)
        blocks, start = {}, 0
        for name in self.reply:
            blocks[name] = list(arrays[start : start + len(shapes[name])])
            start += len(shapes[name])
        return blocks


def one_model(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    """Reply shapes of a task that returns one model (``model``, shaped as the strategy's)."""
    return {MODEL: model.arrays()}


def no_arrays(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    """Reply shapes of a task that returns metrics only."""
    return {}


TRAIN = Task("train", sends=(MODELS,), reply=(MODEL,), reply_shapes=one_model)
EVALUATE = Task(
    "evaluate",
    sends=(MODELS,),
    reply=(),
    reply_shapes=no_arrays,
    metric_checks=(in_unit_interval(ACCURACY), finite_if_present(VAL_LOSS)),
)


def instruction_config(task: Task, server_round: int, layout: str, extra: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The config of one instruction: task, round, layout and the task's own scalars."""
    return {**extra, TASK_KEY: task.name, ROUND_KEY: server_round, LAYOUT_KEY: layout}
