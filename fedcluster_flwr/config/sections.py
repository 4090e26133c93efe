"""The experiment config's sections, declared: each YAML key as a dataclass field with its type,
default and constraints (:mod:`fedcluster_flwr.declarations.schema`), and the whole config
(:class:`ExperimentConfig`).

``partition`` and ``strategy`` hold, besides their own keys, the options dataclass of the
partitioner / strategy they name; :mod:`fedcluster_flwr.config.load` reads the YAML and overrides
into these.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Literal

from ..data.sources import DATASET_SOURCES, HF, dataset_shape
from ..models import MODELS, RENAMED as RENAMED_MODELS
from ..declarations.roles import EXECUTION, FIXED_ON_BRANCH, RUN_CONFIG, no_effect_under_flwr_run
from ..declarations.options import DeclaredOptions, derived
from ..training import TrainSettings
from ..declarations.schema import (
    REQUIRED,
    HostPort,
    SEED_RANGE,
    InRegistry,
    Interval,
    Is,
    OnlyWith,
    RequiredWith,
    above,
    at_least,
    config_keys,
    join_key,
    option,
    require,
)


@dataclass(frozen=True)
class DatasetConfig(DeclaredOptions):
    name: str = option("digits", InRegistry(DATASET_SOURCES, "dataset"), roles=(RUN_CONFIG,))
    # the data folder; null: $FEDCLUSTER_DATA_DIR, else ~/.cache/fedcluster/data
    data_dir: str | None = option(None, roles=(RUN_CONFIG,))
    download: bool = False  # let torchvision fetch MNIST/Fashion-MNIST/CIFAR-10 when online
    # hf (docs/tutorial/own-dataset.md): a folder of parquet/arrow files, a save_to_disk folder, or a Hub
    # dataset name (online); a relative path is looked for in the working directory, then the data folder
    path: str | None = None
    split: str | None = None  # hf: the split to use, or several joined with + (train+test); null: train
    image_key: str | None = None  # hf: the column of images; null: image
    label_key: str | None = None  # hf: the column of integer class labels; null: label
    cache_dir: str | None = None  # hf: the datasets library's cache; relative: under the data folder; null: $HF_DATASETS_CACHE, else $HF_HOME/datasets
    # the model's inputs: "standardized" (x/255 - mean) / std per channel, with the dataset's mean and
    # std; "unit": x/255 in [0, 1] (e.g. Lin et al.'s MNIST inputs)
    scaling: Literal["standardized", "unit"] = "standardized"

    rules = (
        RequiredWith("path", Is("name", HF), "dataset.name hf needs a folder of parquet/arrow files, a save_to_disk "
                                             "folder or a Hub dataset name"),
        *(OnlyWith(key, Is("name", HF)) for key in ("path", "split", "image_key", "label_key", "cache_dir")),
    )


@dataclass(frozen=True, kw_only=True)
class PartitionConfig(DeclaredOptions):
    """The ``partition`` section: these keys, plus the options of the partitioner ``name``."""

    name: str = option(REQUIRED, roles=(RUN_CONFIG,))
    # at most a million, before any partitioner allocates for them (FEMNIST, the largest dataset here, has 805,263 samples)
    num_clients: int = option(10, Interval(1, 1_000_000), roles=(RUN_CONFIG,))
    # null: an equal share of the pool; for class_subsets the largest size every client can get from
    # its classes; for dirichlet and natural a cap, default none
    samples_per_client: int | None = option(None, at_least(2))
    # of each client's samples, held out as its local test split (stratified by label)
    test_fraction: float = option(0.2, Interval(0, 1, closed="neither"))
    options: Any  # the partitioner's own options dataclass, built from the section's other keys
    val_fraction: float = 0.0  # of each client's samples, held out of training for model selection

    def validate(self, prefix: str) -> None:
        # Its upper bound depends on test_fraction: the two together must leave training samples.
        require(
            0.0 <= self.val_fraction < 1.0 - self.test_fraction,
            join_key(prefix, "val_fraction"),
            f"must be in [0, 1 - test_fraction) = [0, {1.0 - self.test_fraction:g}), got {self.val_fraction}",
        )


# The section's own keys; the rest belong to the partitioner named.
PARTITION_COMMON = set(config_keys(PartitionConfig)) - {"options"}


@dataclass(frozen=True)
class ModelConfig(DeclaredOptions):
    name: str = option(REQUIRED, InRegistry(MODELS, "model", retired=RENAMED_MODELS), roles=(RUN_CONFIG,))


@dataclass(frozen=True)
class ClientConfig(TrainSettings):
    """How a client trains (these keys but ``device`` are fedcluster_flwr.training.TrainSettings, the
    one type every engine's training reads) and where."""

    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: a GPU where the client has one, else the CPU


@dataclass(frozen=True)
class StrategyConfig:
    name: str = option(REQUIRED, roles=(FIXED_ON_BRANCH, RUN_CONFIG))
    options: Any  # the strategy's own options dataclass
    # The class ``name`` selects, from the registry when the config was read: the one lookup
    # between the YAML and the strategy's constructor (fedcluster_flwr.experiment.Experiment.strategy).
    strategy_class: type = derived()


@dataclass(frozen=True)
class SimulationConfig(DeclaredOptions):
    # How a round's client tasks execute; the strategy and the results files are the same on all
    # three (docs/how-to/engines.md). ray: Flower's virtual client engine, one ClientApp call per client.
    # inprocess: the same calls one after another in one process, no Ray (bit for bit ray's rounds).
    # batched: inprocess, with the torch work of a round's clients executed together (stacked).
    engine: Literal["ray", "inprocess", "batched"] = option("ray", roles=(EXECUTION,))
    # batched: memory the stacked clients may take, in GB; null: half the memory free at the start
    # (on the GPU for client.device cuda, else in RAM, at most 4 GB there).
    batched_memory_gb: float | None = option(None, above(0), roles=(EXECUTION,))
    # batched, on a CPU: worker threads (one torch thread each); null: one per core this process may use.
    batched_workers: int | None = option(None, at_least(1), roles=(EXECUTION,))
    # batched: Ray actors the clients are spread over, each running the batched engine on its shard
    # (docs/how-to/ray-cluster-gpu.md). null: none (the run's own process runs them all) on this
    # machine; with ray_address, one per GPU (client.device cuda/auto) or else one per node of the cluster.
    batched_actors: int | None = option(None, at_least(1), roles=(
        EXECUTION, no_effect_under_flwr_run("under flwr run the ServerApp's process runs the batched clients itself")))
    # Ray resources per simulated client
    num_cpus_per_client: float = option(1.0, above(0), roles=(
        EXECUTION, no_effect_under_flwr_run("use flwr run --federation-config \"client-resources-num-cpus=N\"")))
    # e.g. 0.25 packs four clients per GPU; client.device auto uses it
    num_gpus_per_client: float = option(0.0, at_least(0), roles=(
        EXECUTION, no_effect_under_flwr_run("use flwr run --federation-config \"client-resources-num-gpus=X\"")))
    # Fault injection for robustness studies: partition id -> rounds in which its fit raises.
    fail_fit: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Late joiners: partition id -> first round in which the client is online.
    join_round: dict[int, int] = field(default_factory=dict)
    # Seconds to wait for a client's reply (fit, evaluate, properties); null waits for Flower's TTL.
    # Ray only: inprocess and batched run every call to its end in this process (no reply is late).
    round_timeout_s: float | None = option(None, above(0))
    # Deterministic GPU kernels (cuDNN, cuBLAS workspace, torch's deterministic algorithms), so that a
    # seed fixes a CUDA run as it already fixes a CPU run; no effect on CPU results.
    deterministic: bool = False
    # Kernels every x86-64 CPU with AVX2 runs alike (numerics.PORTABLE_NUMERICS), one thread per
    # process: a seed then fixes a CPU run bit for bit across CPU models and vendors.
    portable_numerics: bool = False
    # An existing Ray cluster to run the clients on (engine ray: one actor per client task; batched:
    # the batched engine's shards, see batched_actors): its head's HOST:PORT, as `ray start --head`
    # prints it. null: Ray starts on this machine for this run and ends with it (see
    # docs/how-to/ray-cluster-gpu.md).
    ray_address: str | None = option(None, HostPort("10.0.0.1:6379"), roles=(
        EXECUTION, no_effect_under_flwr_run("Flower's simulation runtime starts its own Ray")))

    rules = (
        OnlyWith("ray_address", Is("engine", "ray", "batched"),
                 "only simulation.engine ray and batched run on a Ray cluster"),
        OnlyWith("batched_memory_gb", Is("engine", "batched")),
        OnlyWith("batched_workers", Is("engine", "batched")),
        OnlyWith("batched_actors", Is("engine", "batched")),
        OnlyWith("round_timeout_s", Is("engine", "ray"),
                 "only simulation.engine ray waits for replies (engine is {engine}): inprocess and batched run every "
                 "client's call to its end in this process, deterministically, so no reply can be late; remove the "
                 "key or run on ray"),
    )

    def validate(self, prefix: str) -> None:
        for pid, first in self.join_round.items():
            require(first >= 1, join_key(prefix, f"join_round.{pid}"), "rounds start at 1")
        for pid, rounds in self.fail_fit.items():
            require(all(r >= 1 for r in rounds), join_key(prefix, f"fail_fit.{pid}"),
                    f"rounds start at 1, got {min(rounds, default=1)}")


@dataclass(frozen=True)
class FaultsConfig(DeclaredOptions):
    """Faults injected on the client side for robustness studies: in every round each client,
    independently and reproducibly (a function of ``seed``, the round and its partition id), fails
    its fit with probability ``drop_rate`` (it raises: a failure) or sends a model full of NaN with
    probability ``nan_rate`` (the reply checks reject it). The run goes on without them."""

    drop_rate: float = option(0.0, Interval(0, 1, closed="left"))
    nan_rate: float = option(0.0, Interval(0, 1, closed="left"))
    seed: int = option(0, SEED_RANGE)

    def validate(self, prefix: str) -> None:
        # One uniform draw per client and round decides: [0, drop) drops, [drop, drop + nan) sends NaN.
        require(
            self.drop_rate + self.nan_rate < 1.0,
            join_key(prefix, "nan_rate"),
            f"drop_rate + nan_rate must be below 1 (some clients must be able to answer), got "
            f"{self.drop_rate:g} + {self.nan_rate:g}",
        )


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig(DeclaredOptions):
    """The whole YAML: its sections, then the top-level keys, declared once here. A section left out
    takes its defaults, except ``model``; ``partition`` (default iid) and ``strategy`` (default
    fedavg) are built by :func:`build_config` from the partitioner / strategy they name."""

    # The sections: what the data, the clients and the model are produced the checkpoint, so a branch
    # keeps them; the strategy's name too (its options may change on a branch where it did not act on them).
    dataset: DatasetConfig = option(factory=DatasetConfig, roles=(FIXED_ON_BRANCH,))
    partition: PartitionConfig = option(REQUIRED, roles=(FIXED_ON_BRANCH,))
    model: ModelConfig = option(REQUIRED, roles=(FIXED_ON_BRANCH,))
    client: ClientConfig = option(factory=ClientConfig, roles=(FIXED_ON_BRANCH,))
    strategy: StrategyConfig
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    # partitions, model init, sampling and local shuffling derive from it
    seed: int = option(0, SEED_RANGE, roles=(FIXED_ON_BRANCH, RUN_CONFIG))
    rounds: int = option(20, at_least(1), roles=(RUN_CONFIG,))
    # for pct_clients_over_target and rounds_to_target
    target_accuracy: float = option(0.9, Interval(0, 1), roles=(RUN_CONFIG,))
    # each run writes <output_dir>/<timestamp>_<strategy>_<dataset>_<partition>/
    output_dir: str = option("outputs", roles=(RUN_CONFIG,))
    # Checkpoint every N rounds (0: only at the end), so that a stopped run resumes from its last
    # complete round: ~5 ms per round on the default config (docs/how-to/resume-and-branch.md).
    checkpoint_every: int = option(1, at_least(0))
    # Log each round's numbers and the final summary to an experiment tracker as well (needs the pip
    # extra of that name; docs/how-to/tracking.md): tensorboard writes <run>/tensorboard/, mlflow logs
    # to $MLFLOW_TRACKING_URI. A resume continues the same tracker run.
    tracking: Literal["none", "tensorboard", "mlflow"] = option("none", roles=(EXECUTION,))

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return dataset_shape(self.dataset)[0]

    @property
    def num_classes(self) -> int:
        return dataset_shape(self.dataset)[1]

    @property
    def input_size(self) -> int:
        """Values per sample (C·H·W): a bound for options that reduce the inputs' dimension."""
        return math.prod(self.input_shape)
