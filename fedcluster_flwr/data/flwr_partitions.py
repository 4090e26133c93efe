"""``partition.name: flwr_datasets``: a partitioner of Flower Datasets (``flwr_datasets.partitioner``),
by class name, on the pool's labels; then this project's own train/test split per client.

Needs the optional extra ``fedcluster-flwr[hf]`` (``flwr-datasets``), imported only when a config
names this partitioner. For ``partition: {name: flwr_datasets, partitioner: P, args: {...}}``:

1. ``P(**args)``, with ``num_partitions`` = ``partition.num_clients`` and ``partition_by`` = the
   column ``label`` wherever P takes them (``args.partition_by: writer`` for FEMNIST's writers),
   and ``seed`` = the run's ``seed`` wherever P takes one that ``args`` does not give.
2. A partitioner without a seed (``IidPartitioner``, ``SizePartitioner``, ``LinearPartitioner``, ...)
   cuts the dataset in its order, contiguous slices: the pool is shuffled with the run's seed first.
   A seeded one sees the pool in its own order, so it gives exactly the partitions it gives on the
   same labels with the same seed outside this project.
3. P runs on an in-memory ``datasets.Dataset`` of the labels and each sample's pool index; partition
   k holds client k's samples (``partition.samples_per_client`` caps them, drawn at random).
4. :func:`~.partitions.make_partition` then splits each client's samples into train and test.

True clusters: none, so every client is in group 0 (as ``iid`` and ``dirichlet``), and the summary
says that purity and ARI do not apply. What the library refuses (too few samples, a bad argument)
is one :class:`ConfigError` line naming the option its message names; a class it left out of every
partition (``PathologicalPartitioner``'s random class assignment can) is one too, since it would
leave the model a class no client ever sees.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..declarations.options import DeclaredOptions
from ..declarations.schema import REQUIRED, ConfigError, describe, did_you_mean, join_key, option
from .hf import import_optional
from .partitions import PARTITIONERS, ClientTransform, Partitioner, PartitionRequest, PartitionResult

NAME = "flwr_datasets"
INDEX_COLUMN = "fedcluster_pool_index"
COLUMNS = ("label", "writer")  # what partition_by may name: the pool's labels, and FEMNIST's writer ids
FILLED = ("num_partitions", "partition_by")  # set from the config, not from args
# Classes of flwr_datasets.partitioner that cannot run here, and why
UNSUPPORTED = {
    "Partitioner": "is the library's abstract base class",
    "IdToSizeFncPartitioner": "takes a Python function; use LinearPartitioner, SquarePartitioner or ExponentialPartitioner",
    "VerticalEvenPartitioner": "splits columns (features), not samples",
    "VerticalSizePartitioner": "splits columns (features), not samples",
}
# The argument that brings back a class a partitioner left out, and how
DROPPED_CLASS_FIX = {
    "PathologicalPartitioner": ("class_assignment_mode", "set it to first-deterministic (every class then goes to "
                                                         "a client while num_clients >= the class count) or deterministic"),
}

ArgValue = bool | int | float | str | tuple[int, ...] | tuple[float, ...] | tuple[tuple[float, ...], ...] | None


class PartitionerArgs(Mapping[str, Any]):
    """``args``, frozen and hashable (a partition is cached by its config)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __repr__(self) -> str:
        return f"PartitionerArgs({self._items!r})"


@dataclass(frozen=True)
class FlwrDatasetsOptions(DeclaredOptions):
    """A Flower Datasets partitioner (`partitioner`, a class name of `flwr_datasets.partitioner`) with
    its arguments `args`; `num_partitions`, `partition_by` and `seed` come from the config (extra
    fedcluster-flwr[hf]; docs/tutorial/own-dataset.md)."""

    partitioner: str = option(REQUIRED)  # a class name of flwr_datasets.partitioner, e.g. DirichletPartitioner
    # the class's keyword arguments, e.g. {alpha: 0.5} (num_partitions: partition.num_clients;
    # partition_by: label; seed: the run's seed, unless given here)
    args: dict[str, ArgValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", PartitionerArgs(self.args))
        super().__post_init__()  # the declarations, on the arguments as the partitioner takes them

    def validate(self, prefix: str) -> None:
        cls = partitioner_class(self.partitioner, join_key(prefix, "partitioner"))
        parameters = inspect.signature(cls).parameters
        for name, value in self.args.items():
            key = join_key(prefix, f"args.{name}")
            if name == "num_partitions":
                raise ConfigError(key, "is partition.num_clients: set that instead")
            if name == "partition_by" and value not in COLUMNS:
                raise ConfigError(key, f"the pool's columns are {' and '.join(COLUMNS)} (writer: femnist only), got {describe(value)}")
            if name not in parameters:
                raise ConfigError(key, f"not an argument of {self.partitioner}{did_you_mean(name, parameters)}; its "
                                       f"arguments: {', '.join(p for p in parameters if p not in FILLED) or 'none'}")
            if name == "seed" and not isinstance(value, int):
                # every process (each Ray worker, each SuperNode) computes the partition itself
                raise ConfigError(key, f"must be an integer, got {describe(value)}: an unseeded partition differs "
                                       f"between the processes that compute it; leave it out to use the run's seed")
        for name, parameter in parameters.items():
            if parameter.default is inspect.Parameter.empty and name not in FILLED and name not in self.args:
                raise ConfigError(join_key(prefix, f"args.{name}"), f"{self.partitioner} needs it")


def partitioner_class(name: str, key: str) -> type:
    """The class ``name`` of ``flwr_datasets.partitioner``, or a ConfigError on ``key`` saying why not."""
    module = import_optional("flwr_datasets.partitioner", "partition.name", f"'{NAME}'")
    if name in UNSUPPORTED:
        raise ConfigError(key, f"{name} {UNSUPPORTED[name]}")
    available = [n for n in module.__all__ if n not in UNSUPPORTED]
    if name not in available:
        raise ConfigError(key, f"unknown Flower Datasets partitioner {describe(name)}{did_you_mean(name, available)}; "
                               f"available: {', '.join(available)}")
    return getattr(module, name)


def _plain(value: Any) -> Any:
    """A config value as the library expects it: lists, not tuples (DirichletPartitioner refuses a tuple alpha)."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _key_named_in(message: str, given: Mapping[str, Any]) -> str:
    """The option a library message is about: an argument of ``given`` (the config's args) that it
    names, else partition.num_clients where it speaks of partitions, else partition.args."""
    for name in sorted(given, key=len, reverse=True):
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message, re.IGNORECASE):
            return f"partition.args.{name}"
    return "partition.num_clients" if "partitions" in message else "partition.args"


def partition_flwr_datasets(req: PartitionRequest, opts: FlwrDatasetsOptions) -> PartitionResult:
    cls = partitioner_class(opts.partitioner, "partition.partitioner")
    datasets = import_optional("datasets", "partition.name", f"'{NAME}'")
    parameters = inspect.signature(cls).parameters
    arguments = {name: _plain(value) for name, value in opts.args.items()}
    column = arguments.pop("partition_by", "label")
    if column == "writer" and req.writers is None:
        raise ConfigError("partition.args.partition_by", "'writer' needs a dataset with writer ids (femnist)")
    if "partition_by" in parameters:
        arguments["partition_by"] = column
    if "num_partitions" in parameters:
        arguments["num_partitions"] = req.num_clients
    seeded = "seed" in parameters
    if seeded:
        arguments.setdefault("seed", req.seed)
    order = np.arange(len(req.labels)) if seeded else req.rng.permutation(len(req.labels))
    columns = {"label": req.labels[order], INDEX_COLUMN: order}
    if req.writers is not None:
        columns["writer"] = req.writers[order]
    table = datasets.Dataset.from_dict(columns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its warnings name what went wrong loosely; what it placed is checked below
        try:
            partitioner = cls(**arguments)
            partitioner.dataset = table
            count = partitioner.num_partitions
            parts = [np.asarray(partitioner.load_partition(k).with_format("numpy")[INDEX_COLUMN][:], dtype=np.int64)
                     for k in range(count)]
        except (ValueError, TypeError, KeyError, IndexError, AssertionError, ZeroDivisionError) as err:
            message = _one_line(err)
            raise ConfigError(_key_named_in(message, opts.args), f"{opts.partitioner}: {message}") from None
    if count != req.num_clients:
        raise ConfigError("partition.num_clients", f"{opts.partitioner} made {count} partitions from its arguments, "
                                                   f"for {req.num_clients} clients: set partition.num_clients to {count}")
    _check_placed(opts.partitioner, req.labels, parts)
    if req.samples_per_client is not None:
        parts = [req.rng.permutation(part)[:req.samples_per_client] for part in parts]
    return parts, np.zeros(req.num_clients, dtype=np.int64), [ClientTransform()] * req.num_clients


def _check_placed(name: str, labels: np.ndarray, parts: list[np.ndarray]) -> None:
    """Every class of the pool is in some partition, and every client has samples to split."""
    placed = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    dropped = np.setdiff1d(np.unique(labels), labels[placed])
    if len(dropped):
        argument, fix = DROPPED_CLASS_FIX.get(name, ("", "change its arguments"))
        raise ConfigError(
            join_key("partition.args", argument),
            f"{name} placed no sample of class{'es' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} "
            f"({len(placed)} of {len(labels)} samples placed): {fix}",
        )
    for client, part in enumerate(parts):
        if len(part) < 2:
            raise ConfigError("partition.num_clients", f"{name} gave client {client} {len(part)} sample(s), too few "
                                                       f"for a train and a test split: fewer clients or other args")


PARTITIONERS[NAME] = Partitioner(FlwrDatasetsOptions, partition_flwr_datasets)
