"""Helpers the test modules share (no test imports from another test module): run-file checks,
a synthetic model, fake Flower clients, :func:`synthetic_round`, which plays one round of a strategy
with synthetic clients through the in-process engine's round loop
(:func:`fedcluster_flwr.engines.inprocess.play_round`), and CIFAR-10 files in the real format."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesRes,
    NDArrays,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import protocol
from fedcluster_flwr.config import config_to_dict, load_config
from fedcluster_flwr.protocol import ACCURACY, LAYOUT_KEY, MODELS, TASK_KEY
from fedcluster_flwr.algorithms.base.directory import Federation
from fedcluster_flwr.engines.inprocess import play_round
from fedcluster_flwr.recorder import RunRecorder
from fedcluster_flwr.round_log import RoundLog
from fedcluster_flwr.algorithms.base import StrategySetup
from fedcluster_flwr.algorithms.base.strategy import ClusteredStrategy
from fedcluster_flwr.algorithms.base.messages import Instruction
from fedcluster_flwr.algorithms.base.selection import SELECTED, SIMILARITY


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


def fit_res(weights: NDArrays, n: int = 10, metrics: Mapping[str, Scalar] | None = None,
            tensors: list[bytes] | None = None) -> FitRes:
    """A successful fit reply; ``tensors`` replaces the serialized arrays (to send garbage)."""
    parameters = ndarrays_to_parameters(weights)
    if tensors is not None:
        parameters.tensors = tensors
    return FitRes(Status(Code.OK, ""), parameters, n, dict(metrics or {}))


# ---- a federation of fake Flower clients ----------------------------------------------------------


class FakeProxy(ClientProxy):
    """A registered Flower client that answers get_properties (the strategy's discovery) with the
    partition ``pid`` it claims, well-formed or not, and its fit and evaluate instructions as the
    round's :class:`RoundPlan` says (:func:`synthetic_round` sets it)."""

    def __init__(self, cid: str, pid: Any, num_partitions: int):
        super().__init__(cid)
        self.pid, self.num_partitions = pid, num_partitions
        self.plan: RoundPlan | None = None

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(Status(Code.OK, ""), {"partition_id": self.pid, "num_partitions": self.num_partitions})

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        plan = self.plan
        received = Received(self.pid, ins.config[TASK_KEY], unpacked(ins), dict(ins.config),
                            plan.strategy.messages.instructions[self.pid])
        plan.received[self.pid] = received
        if self.pid in plan.fail:
            raise RuntimeError(f"client {self.pid} failed")
        arrays, num_examples, metrics = plan.reply(received)
        if self.pid in plan.corrupt:
            arrays = [np.full_like(a, np.nan) for a in arrays]
        return fit_res(arrays, num_examples, metrics)

    def evaluate(self, ins, timeout, group_id):
        (model,) = unpacked(ins)[MODELS]
        loss, metrics = self.plan.evaluate(self.pid, model)
        return EvaluateRes(Status(Code.OK, ""), loss, 5, dict(metrics))

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


def client_manager(num_clients: int, reported: int | None = None) -> SimpleClientManager:
    """``num_clients`` fake clients, partitions 0..num_clients-1, each reporting ``reported``
    partitions in all (default: ``num_clients``)."""
    manager = SimpleClientManager()
    for pid in range(num_clients):
        # cids unrelated to partition ids, as Flower's node ids are
        manager.register(FakeProxy(str(1000 + 7 * pid), pid, reported or num_clients))
    return manager


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


# ---- one round, driven as Flower's server loop drives it --------------------------------------------


@dataclass(frozen=True)
class Received:
    """What one client received for a round's fit: its task, the blocks and scalars off the wire
    (unpacked from its FitIns), and the strategy's :class:`Instruction` for it, which also says
    what never travels (whose model each gossip item is, which cluster each model is)."""

    pid: int
    task: str
    blocks: Mapping[str, list[NDArrays]]
    config: Mapping[str, Scalar]
    instruction: Instruction

    @property
    def models(self) -> list[NDArrays]:
        return self.blocks[MODELS]

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


def unpacked(ins: FitIns | EvaluateIns) -> dict[str, list[NDArrays]]:
    """An instruction's blocks, as the client decodes them."""
    return protocol.unpack(parameters_to_ndarrays(ins.parameters), ins.config[LAYOUT_KEY])


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
    manager: SimpleClientManager,
    rnd: int,
    reply: SyntheticClient,
    *,
    fail: Collection[int] = (),
    corrupt: Collection[int] = (),
    evaluate: Evaluation = evaluated_at_80_percent,
    shuffle: np.random.Generator | None = None,
) -> dict[int, Received]:
    """Play Flower round ``rnd`` with the in-process engine's round loop over ``manager``'s
    :class:`FakeProxy` clients (connecting the strategy to its test run first, once).

    ``reply(received)`` is the synthetic client: the (arrays, num_examples, metrics) it sends back
    for what it received. A client in ``fail`` raises instead (a failure; ``reply`` is not asked);
    one in ``corrupt`` replies with its arrays turned to NaN. ``evaluate(pid, model)`` is the
    (loss, metrics) of client ``pid`` evaluated on the model it was sent. ``shuffle`` permutes the
    order in which the fit and the evaluate results reach the strategy, as arrival order does in
    Flower.

    Returns what each instructed client received, by partition id, failed ones included.
    """
    connect_test_run(strategy)
    plan = RoundPlan(strategy, reply, fail, corrupt, evaluate)
    for proxy in manager.all().values():
        proxy.plan = plan
    play_round(strategy, manager, rnd, arrival=None if shuffle is None else shuffle.shuffle)
    return plan.received


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
