"""The wire protocol between the strategies and ClusterClient, declared once for both sides.

Each round a strategy sends every chosen client an *instruction*: a task, named blocks of
arrays and a few scalars. Flower carries one flat list of arrays and one flat config of
scalars per client, so the codec packs the blocks one after another into the list and writes
their layout into the config (``layout``: ``models=3x8,directions=3x8``, i.e. block name,
items, arrays per item); the other side unpacks by that layout. A reply is packed the same
way, in the order its task declares. Every reply is checked against its task's schema
(which blocks, of which shapes given the instruction; which metrics, with which checks)
before any of its arrays touches a model.

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``train``          ``models`` (1), ``epochs``           ``model``                           ``train_loss``
                   (optional)
``train_select``   ``models`` (K), ``directions``       ``model`` (the chosen one,          ``selected`` < K, ``loss_k``
                   (K, optional)                        trained or one step)                (+ ``similarity_k``)
``select``         ``models`` (K), ``directions``       –                                   as ``train_select``
                   (K, optional)
``gram_eigen``     – (Φ, k and ``share_eigenvalues``    ``eigenvectors`` (k × d),            –
                   in the config)                       ``eigenvalues`` (k; none unless
                                                        ``share_eigenvalues``)
``relevance``      ``eigenvectors`` (N items of         ``relevance`` (N)                   –
                   k × d vectors, + k values each
                   with ``share_eigenvalues``)
``gossip_train``   ``models`` (own + m neighbours),     ``model`` (own, trained)            ``loss_j``, j < m, finite
                   ``samples_j`` in the config
                   (+ ``merge_lowest``, optional)
``evaluate``       ``models`` (1)                       –                                   ``accuracy`` in [0, 1]
                                                                                             (+ finite ``val_loss``)
=================  ===================================  ==================================  ===========================

Task names, block names and the config and metric keys appear nowhere else as literals:
the client looks its handlers up by these :class:`Task` objects, the strategies build
:class:`~fedcluster_flwr.strategies.core.Instruction` objects from them.
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
NUM_EIGENVECTORS_KEY = "num_eigenvectors"
FEATURES_KEY = "features"  # gram_eigen/relevance: the feature map Φ (see features.py)
FEATURE_DIM_KEY = "feature_dim"  # d, the number of features of Φ
FEATURE_SEED_KEY = "feature_seed"  # random_projection: the seed every client draws the projection from
PRETRAINED_WEIGHTS_KEY = "pretrained_weights"  # pretrained: the backbone's weights file on the client
# gram_eigen/relevance: whether clients share their eigenvalues along with their eigenvectors (Amiri et
# al.'s relevance compares j's eigenvalues; Ali & Arafa's eq. 3 the client's own, so none are sent)
SHARE_EIGENVALUES_KEY = "share_eigenvalues"
SELECTION_BATCH_KEY = "selection_batch"  # train_select/select: samples the losses are taken on (0: all)
LOSS_REDUCTION_KEY = "loss_reduction"  # train_select/select: "mean" (default) or "sum" over those samples
LAMBDA_KEY = "lambda"  # train_select/select with directions: weight of the gradient similarity
LOCAL_UPDATE_KEY = "local_update"  # train_select: EPOCHS (train the chosen model) or ONE_STEP (w_s - lr grad L_s(Z))
EPOCHS = "epochs"
ONE_STEP = "one_step"
SAMPLES_KEY = "samples"  # gossip_train: samples_j, the training samples behind neighbour j's model
MERGE_LOWEST_KEY = "merge_lowest"  # gossip_train (optional): merge only this many neighbours, those of lowest loss (PENS)
EPOCHS_KEY = "epochs"  # train (optional): local epochs instead of the client's own (client.epochs), e.g. pretraining

# Properties a client reports once (``get_properties``), so the server learns who it is.
PARTITION_ID = "partition_id"
NUM_PARTITIONS = "num_partitions"
NUM_TRAIN = "num_train"
NUM_TEST = "num_test"

# Reply metrics.
TRAIN_LOSS = "train_loss"
SELECTED = "selected"
ACCURACY = "accuracy"
VAL_LOSS = "val_loss"  # evaluate, where the client holds a validation split
LOSS = "loss"  # per item of a block: loss_0, loss_1, ...
SIMILARITY = "similarity"  # per item: similarity_0, ...

# Block names.
MODELS = "models"  # items: whole models, arrays in state_dict order
DIRECTIONS = "directions"  # items: one update direction per model (gradloss)
EIGENVECTORS = "eigenvectors"  # sent: items [vectors (k, d)] (+ values (k,) when shared); replied: vectors (k, d)
EIGENVALUES = "eigenvalues"  # replied: values (k,) when shared, else no array
MODEL = "model"  # replied: one model
RELEVANCE = "relevance"  # replied: one row r(i, .) of the relevance matrix

# Beyond this magnitude a replied value would overflow float32 sums and distances.
MAX_ABS_VALUE = 1e6
BOUND_TOLERANCE = 1e-5  # float32 round-off allowed past a quantity's bounds (e.g. r(i, i) = 1)


def indexed(metric: str, k: int) -> str:
    """Name of the ``k``-th value of a per-item metric: ``indexed(LOSS, 2) == "loss_2"``."""
    return f"{metric}_{k}"


class ProtocolError(ValueError):
    """A message that does not follow the protocol (bad layout, missing block or key)."""


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


def pack(blocks: Blocks) -> tuple[NDArrays, str]:
    """Flat list of arrays and its layout; :func:`unpack` inverts it."""
    return [array for items in blocks.values() for item in items for array in item], layout_of(blocks)


SerializationCache = dict[int, tuple[NDArrays, list[bytes]]]


def pack_parameters(blocks: Blocks, cache: SerializationCache | None = None) -> tuple[Parameters, str]:
    """Like :func:`pack`, serialized for Flower.

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
    """One kind of work a client can be asked for; see the table in the module docstring."""

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


def _one_model(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    return {MODEL: model.arrays()}


def _eigen_shapes(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    k, d = int(sent.config[NUM_EIGENVECTORS_KEY]), int(sent.config[FEATURE_DIM_KEY])
    values = [ArraySpec((k,), low=0.0)] if sent.config[SHARE_EIGENVALUES_KEY] else []
    return {EIGENVECTORS: [ArraySpec((k, d))], EIGENVALUES: values}


def _relevance_shape(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    return {RELEVANCE: [ArraySpec((sent.items[EIGENVECTORS],), low=0.0, high=1.0)]}


TRAIN = Task("train", sends=(MODELS,), reply=(MODEL,), reply_shapes=_one_model)
_SELECTION_CHECKS = (
    index_into(SELECTED, MODELS),
    one_per_item(LOSS, MODELS),  # NaN allowed: a diverged model is reported, never chosen
    when_sent(DIRECTIONS, one_per_item(SIMILARITY, MODELS)),
)
TRAIN_SELECT = Task(
    "train_select",
    sends=(MODELS,),
    optional=(DIRECTIONS,),
    reply=(MODEL,),
    reply_shapes=_one_model,
    metric_checks=_SELECTION_CHECKS,
)
SELECT = Task(  # train_select without the training: "which of these models is mine?"
    "select",
    sends=(MODELS,),
    optional=(DIRECTIONS,),
    reply=(),
    reply_shapes=lambda sent, model: {},
    metric_checks=_SELECTION_CHECKS,
)
_ONESHOT_CONFIG = (FEATURES_KEY, FEATURE_DIM_KEY, FEATURE_SEED_KEY, PRETRAINED_WEIGHTS_KEY, SHARE_EIGENVALUES_KEY)
GRAM_EIGEN = Task(
    "gram_eigen",
    sends=(),
    reply=(EIGENVECTORS, EIGENVALUES),
    reply_shapes=_eigen_shapes,
    config=(NUM_EIGENVECTORS_KEY, *_ONESHOT_CONFIG),
)
RELEVANCE_ROW = Task(
    "relevance", sends=(EIGENVECTORS,), reply=(RELEVANCE,), reply_shapes=_relevance_shape, config=_ONESHOT_CONFIG
)
GOSSIP_TRAIN = Task(
    "gossip_train",
    sends=(MODELS,),
    reply=(MODEL,),
    reply_shapes=_one_model,
    metric_checks=(one_per_item(LOSS, MODELS, skip=1, finite=True, minimum=0.0),),
)
EVALUATE = Task(
    "evaluate",
    sends=(MODELS,),
    reply=(),
    reply_shapes=lambda sent, model: {},
    metric_checks=(in_unit_interval(ACCURACY), finite_if_present(VAL_LOSS)),
)

TASKS: dict[str, Task] = {
    task.name: task for task in (TRAIN, TRAIN_SELECT, SELECT, GRAM_EIGEN, RELEVANCE_ROW, GOSSIP_TRAIN, EVALUATE)
}


def instruction_config(task: Task, server_round: int, layout: str, extra: Mapping[str, Scalar]) -> dict[str, Scalar]:
    """The config of one instruction: task, round, layout and the task's own scalars."""
    return {**extra, TASK_KEY: task.name, ROUND_KEY: server_round, LAYOUT_KEY: layout}
