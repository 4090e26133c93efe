"""ClusterClient: one client's data, model factory and local compute, and the handlers of the two
tasks every algorithm uses.

The ClientApp (:mod:`fedcluster_flwr.apps.client_app`) reads an instruction off its message with
the task's codec (:mod:`fedcluster_flwr.protocol`), hands it to the client's :meth:`ClusterClient.run`,
which runs the handler registered for the task, and writes the handler's reply back as records.
Handlers here:

* ``train``: load the one model received, train it locally (``client.epochs``, or the
  instruction's ``epochs``, e.g. a gossip client's pretraining) on the instruction's local
  ``objective`` (cross-entropy alone when it names none; see :func:`local_objective`), return it.
* ``evaluate``: test the received model on the client's own test split (and its validation
  split, where it holds one).

The handlers of each algorithm family's own tasks are in that family's package
(:mod:`fedcluster_flwr.algorithms`). A new task's handler is a function
``(client, TaskInput) -> TaskOutput`` registered with ``@handles(SOME_TASK)``
(:func:`fedcluster_flwr.registry.handles`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from . import protocol, registry
from .protocol import ACCURACY, EPOCHS_KEY, EVALUATE, MODEL, OBJECTIVE_KEY, TEST_LOSS, TRAIN, TRAIN_LOSS, VAL_LOSS, Task, TaskInput
from .training import PLAIN, LocalCompute, Objective, TrainSettings, get_weights, set_weights
from .types import NDArrays, Scalar


class SimulatedClientFailure(RuntimeError):
    """Raised on purpose (``simulation.fail_fit``, ``faults.drop_rate``) to exercise failure handling."""


FAULT_STREAM = 7  # keeps the fault draw apart from the round's training randomness (round_seed)


@dataclass(frozen=True)
class Faults:
    """``faults.*``: in each round, does this client drop out of its fit or send a NaN model?"""

    drop_rate: float = 0.0
    nan_rate: float = 0.0
    seed: int = 0

    def draw(self, server_round: int, pid: int) -> str | None:
        """``"drop"``, ``"nan"`` or None; one uniform draw from (seed, round, partition id), so that
        every process (a Ray worker, the in-process driver) decides alike."""
        if not (self.drop_rate or self.nan_rate):
            return None
        uniform = round_seed(self.seed, server_round, pid, FAULT_STREAM) / 2**32
        if uniform < self.drop_rate:
            return "drop"
        return "nan" if uniform < self.drop_rate + self.nan_rate else None


@dataclass(frozen=True, eq=False)
class ClientData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None  # held out of training for model selection (partition.val_fraction)
    y_val: torch.Tensor | None = None


@dataclass(frozen=True)
class TaskOutput:
    """A handler's reply: named arrays (one entry per block its task replies with), the examples it
    used, and metrics."""

    blocks: Mapping[str, NDArrays]
    num_examples: int
    metrics: Mapping[str, Scalar] = field(default_factory=dict)


STATE_PREFIX = "fedcluster."  # our entries of a node's Context.state (Flower's mods may keep their own there)


class ClientState:
    """What one client keeps on its node between messages (a personal model, a counter): named lists
    of arrays and named scalars in Flower's ``Context.state`` of the node. On a device it never
    leaves the device; in simulation every engine keeps it per client and a run's checkpoint holds
    it (:func:`kept_state`), so a resumed run continues it. A handler reads and writes only the
    entries its task declares (``Task.state``): anything else is a programming error, named."""

    def __init__(self, records: RecordDict | None = None, declared: Sequence[str] = (), task: str = "") -> None:
        self.records = RecordDict() if records is None else records
        self.declared, self.task = tuple(declared), task

    def _key(self, name: str) -> str:
        if name not in self.declared:
            raise protocol.ProtocolError(f"task {self.task!r} keeps no client state {name!r} (it declares "
                                         f"{', '.join(map(repr, self.declared)) or 'none'}: Task(state=...))")
        return STATE_PREFIX + name

    def arrays(self, name: str) -> NDArrays | None:
        """The arrays kept as ``name`` (None before the first time they are kept)."""
        record = self.records.array_records.get(self._key(name))
        return None if record is None else protocol.record_arrays(record)

    def set_arrays(self, name: str, arrays: NDArrays) -> None:
        self.records[self._key(name)] = protocol.array_record(arrays)

    def scalars(self, name: str) -> dict[str, Scalar] | None:
        """The scalars kept as ``name`` (None before the first time)."""
        record = self.records.config_records.get(self._key(name))
        return None if record is None else dict(record)

    def set_scalars(self, name: str, values: Mapping[str, Scalar]) -> None:
        self.records[self._key(name)] = ConfigRecord(dict(values))


def kept_state(records: RecordDict) -> dict[str, Any]:
    """Every entry our handlers keep in a node's state, by name: arrays as lists, scalars as dicts
    (what a checkpoint holds of a client)."""
    kept: dict[str, Any] = {}
    for key, record in records.items():
        if key.startswith(STATE_PREFIX):
            name = key[len(STATE_PREFIX):]
            kept[name] = protocol.record_arrays(record) if isinstance(record, ArrayRecord) else dict(record)
    return kept


def restore_kept_state(records: RecordDict, kept: Mapping[str, Any]) -> None:
    """Put a checkpoint's entries (:func:`kept_state`'s) back into a node's state."""
    for name, value in kept.items():
        records[STATE_PREFIX + name] = ConfigRecord(dict(value)) if isinstance(value, Mapping) \
            else protocol.array_record([np.asarray(a) for a in value])


def round_seed(seed: int, server_round: int, pid: int, *stream: int) -> int:
    """Independent, reproducible seed for one client's training in one round; a ``stream`` number
    keeps another use of randomness in that round (e.g. a selection mini-batch) apart from it."""
    return int(np.random.SeedSequence([seed, server_round, pid, *stream]).generate_state(1)[0])


class ClusterClient:
    """Local training and evaluation on one partition; the work itself is in the task handlers."""

    def __init__(
        self,
        pid: int,
        num_partitions: int,
        data: ClientData,
        model_factory: Callable[[], nn.Module],
        settings: TrainSettings,
        seed: int,
        device: torch.device,
        fail_rounds: tuple[int, ...] = (),
        faults: Faults = Faults(),
        compute: LocalCompute = LocalCompute(),
    ) -> None:
        self.pid = pid
        self.num_partitions = num_partitions
        self.data = data
        self.model_factory = model_factory
        self.settings = settings
        self.seed = seed
        self.device = device
        self.fail_rounds = fail_rounds
        self.faults = faults
        self.compute = compute  # how its torch work runs: alone, or with the round's others (batched engine)
        self.state = ClientState()  # what it keeps on its node: the ClientApp gives it the node's, per message
        self._parameter_names: list[str] | None = None

    def identity(self) -> dict[str, int]:
        """What the client tells the server about itself (task ``identify``)."""
        return {protocol.PARTITION_ID: self.pid, protocol.NUM_PARTITIONS: self.num_partitions, protocol.OWN_DATA: 0}

    @property
    def parameter_names(self) -> list[str]:
        """The model's ``state_dict`` keys: the names a model's arrays travel under."""
        if self._parameter_names is None:
            with torch.device("meta"):
                self._parameter_names = list(self.model_factory().state_dict())
        return self._parameter_names

    def run(self, task: Task, inputs: TaskInput) -> TaskOutput:
        """Run ``task``'s registered handler on ``inputs``. Every task but ``evaluate`` may fail on purpose
        (``simulation.fail_fit``, ``faults.drop_rate``) or reply a diverged model (``faults.nan_rate``)."""
        found = registry.handler(task.name)
        if found is None:
            raise protocol.ProtocolError(f"task {task.name!r} is unknown; this client handles {', '.join(registry.HANDLERS)}")
        _, handler = found
        if task is EVALUATE:
            return handler(self, inputs)
        server_round = inputs.server_round
        if server_round in self.fail_rounds:
            raise SimulatedClientFailure(f"client {self.pid} fails in round {server_round} (simulation.fail_fit)")
        fault = self.faults.draw(server_round, self.pid)
        if fault == "drop":
            raise SimulatedClientFailure(f"client {self.pid} drops out of round {server_round} (faults.drop_rate)")
        output = handler(self, inputs)
        if fault == "nan":  # a diverged client: the server's reply checks must refuse it
            poisoned = {name: [np.full_like(a, np.nan) if a.dtype.kind == "f" else a for a in arrays]
                        for name, arrays in output.blocks.items()}
            output = replace(output, blocks=poisoned)
        return output

    # ---- what handlers share ----------------------------------------------------------------

    def load_model(self, arrays: NDArrays) -> nn.Module:
        """The model with ``arrays`` as its state. Built on the meta device: a random initialisation
        that the arrays overwrite anyway would cost more than the work on small models."""
        with torch.device("meta"):
            model = self.model_factory()
        set_weights(model, arrays, assign=True)
        return model

    def train_model(
        self,
        model: nn.Module,
        server_round: int,
        epochs: int | None = None,
        objective: Objective = PLAIN,
        *,
        anchors: Mapping[str, NDArrays] | None = None,
        lr: float | None = None,
        stream: int = 0,
    ) -> float:
        """Local training of ``model`` on ``objective``; returns the mean batch loss.

        ``epochs`` and ``lr`` replace the client's own (``client.epochs``, ``client.lr``) for this
        training; ``anchors`` are the named models the objective's terms pull towards besides the
        training's start (e.g. ``{"global": the model the server sent}``). The batch order comes from
        the round's seed stream ``stream`` (0, the round's own: what every single training uses; a
        handler that trains twice gives each training that should see its own order its own number)."""
        generator = torch.Generator().manual_seed(round_seed(self.seed, server_round, self.pid, *((stream,) if stream else ())))
        changes = {key: value for key, value in (("epochs", epochs), ("lr", lr)) if value is not None}
        settings = replace(self.settings, **changes) if changes else self.settings
        return self.compute.train(model, self.data.x_train, self.data.y_train, settings, generator, self.device,
                                  objective, anchors)

    def evaluate_model(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``."""
        return self.compute.evaluate(model, x, y, self.device)

    def training_loss(self, model: nn.Module) -> float:
        return self.evaluate_model(model, self.data.x_train, self.data.y_train)[0]

    @property
    def num_train(self) -> int:
        return len(self.data.y_train)


def local_objective(config: Mapping[str, Scalar]) -> Objective:
    """The objective an instruction names (``objective``: registered names, comma-separated, each
    built from its own scalars in ``config``; several combine: their terms add up, their frozen
    layers join); cross-entropy alone when it names none."""
    names = [n.strip() for n in str(config.get(OBJECTIVE_KEY, "")).split(",") if n.strip()]
    terms: list = []
    frozen: list[str] = []
    for name in names:
        found = registry.objective_builder(name)
        if found is None:
            raise protocol.ProtocolError(f"objective {name!r} is unknown; this client knows {', '.join(registry.OBJECTIVES) or 'none'}")
        keys, build = found
        missing = [key for key in keys if key not in config]
        if missing:
            raise protocol.ProtocolError(f"objective {name!r} needs the instruction scalars {missing}")
        built = build(config)
        terms += built.terms
        frozen += [prefix for prefix in built.frozen if prefix not in frozen]
    return Objective(tuple(terms), tuple(frozen)) if names else PLAIN


@registry.handles(TRAIN)
def train_received_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    (arrays,) = inputs.blocks[MODEL]
    model = client.load_model(arrays)
    epochs = inputs.config.get(EPOCHS_KEY)
    objective = local_objective(inputs.config)
    loss = client.train_model(model, inputs.server_round, None if epochs is None else int(epochs), objective)
    return TaskOutput({MODEL: get_weights(model)}, client.num_train, {TRAIN_LOSS: loss})


@registry.handles(EVALUATE)
def evaluate_received_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    """Test loss and accuracy; with a validation split, also the validation loss."""
    (arrays,) = inputs.blocks[MODEL]
    model = client.load_model(arrays)
    data = client.data
    loss, accuracy = client.evaluate_model(model, data.x_test, data.y_test)
    metrics: dict[str, Scalar] = {ACCURACY: accuracy, TEST_LOSS: loss}
    if data.x_val is not None and data.y_val is not None and len(data.y_val):
        metrics[VAL_LOSS] = client.evaluate_model(model, data.x_val, data.y_val)[0]
    return TaskOutput({}, len(data.y_test), metrics)

