"""Experiment configuration: YAML file + dotted ``key=value`` overrides -> typed config.

The YAML has the sections ``dataset``, ``partition``, ``model``, ``client``,
``strategy`` and ``simulation`` plus a few top-level keys. ``partition`` and
``strategy`` take the options of the partitioner / strategy they name. A key that
belongs to a *different* registered partitioner or strategy is ignored with a
note (so one YAML can carry settings for several strategies and ``--set
strategy.name=...`` switches between them); a key that belongs to none is an error.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .data.datasets import DATASETS
from .data.partitions import PARTITIONERS
from .models import MODELS, RENAMED as RENAMED_MODELS
from .schema import ConfigError, config_keys, describe, from_mapping, join_key, require, to_plain, unknown_key_message
from .strategies import STRATEGIES

@dataclass(frozen=True)
class DatasetConfig:
    name: str = "digits"
    data_dir: str | None = None
    download: bool = False

    def validate(self, prefix: str) -> None:
        require(
            self.name in DATASETS,
            join_key(prefix, "name"),
            f"unknown dataset {describe(self.name)}; available: {', '.join(DATASETS)}",
        )


@dataclass(frozen=True)
class PartitionConfig:
    name: str
    num_clients: int
    samples_per_client: int | None
    test_fraction: float
    options: Any  # the partitioner's own options dataclass
    val_fraction: float = 0.0


PARTITION_COMMON = {"name", "num_clients", "samples_per_client", "test_fraction", "val_fraction"}


@dataclass(frozen=True)
class ModelConfig:
    name: str

    def validate(self, prefix: str) -> None:
        require(self.name not in RENAMED_MODELS, join_key(prefix, "name"), f"'{self.name}' {RENAMED_MODELS.get(self.name)}")
        require(
            self.name in MODELS,
            join_key(prefix, "name"),
            f"unknown model {describe(self.name)}; available: {', '.join(MODELS)}",
        )


@dataclass(frozen=True)
class ClientConfig:
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    device: Literal["auto", "cpu", "cuda"] = "auto"

    def validate(self, prefix: str) -> None:
        require(self.epochs >= 1, join_key(prefix, "epochs"), f"must be >= 1, got {self.epochs}")
        require(self.batch_size >= 1, join_key(prefix, "batch_size"), f"must be >= 1, got {self.batch_size}")
        require(self.lr > 0, join_key(prefix, "lr"), f"must be > 0, got {self.lr}")
        require(0 <= self.momentum < 1, join_key(prefix, "momentum"), f"must be in [0, 1), got {self.momentum}")
        require(self.weight_decay >= 0, join_key(prefix, "weight_decay"), "must be >= 0")


@dataclass(frozen=True)
class StrategyConfig:
    name: str
    options: Any  # the strategy's own options dataclass


@dataclass(frozen=True)
class SimulationConfig:
    num_cpus_per_client: float = 1.0
    num_gpus_per_client: float = 0.0
    # Fault injection for robustness studies: partition id -> rounds in which its fit raises.
    fail_fit: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Late joiners: partition id -> first round in which the client is online.
    join_round: dict[int, int] = field(default_factory=dict)
    # Seconds to wait for a client's reply (fit, evaluate, properties); null waits for Flower's TTL.
    round_timeout_s: float | None = None
    # Deterministic GPU kernels (cuDNN, cuBLAS workspace, torch's deterministic algorithms), so that a
    # seed fixes a CUDA run as it already fixes a CPU run; no effect on CPU results.
    deterministic: bool = False
    # Kernels every x86-64 CPU with AVX2 runs alike (numerics.PORTABLE_NUMERICS), one thread per
    # process: a seed then fixes a CPU run bit for bit across CPU models and vendors.
    portable_numerics: bool = False

    def validate(self, prefix: str) -> None:
        require(self.num_cpus_per_client > 0, join_key(prefix, "num_cpus_per_client"), "must be > 0")
        require(self.num_gpus_per_client >= 0, join_key(prefix, "num_gpus_per_client"), "must be >= 0")
        if self.round_timeout_s is not None:
            require(self.round_timeout_s > 0, join_key(prefix, "round_timeout_s"), "must be > 0")
        for pid, first in self.join_round.items():
            require(first >= 1, join_key(prefix, f"join_round.{pid}"), "rounds start at 1")


@dataclass(frozen=True)
class ExperimentConfig:
    dataset: DatasetConfig
    partition: PartitionConfig
    model: ModelConfig
    client: ClientConfig
    strategy: StrategyConfig
    simulation: SimulationConfig
    seed: int = 0
    rounds: int = 20
    target_accuracy: float = 0.9
    output_dir: str = "outputs"
    checkpoint_every: int = 0  # also checkpoint every N rounds (0: only at the end)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return DATASETS[self.dataset.name].input_shape

    @property
    def num_classes(self) -> int:
        return DATASETS[self.dataset.name].num_classes


TOP_LEVEL_SCALARS = ("seed", "rounds", "target_accuracy", "output_dir", "checkpoint_every")
SECTIONS = ("dataset", "partition", "model", "client", "strategy", "simulation")


# ---- YAML --------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """A ``--set`` value: YAML scalar or flow list (``[0, 180]``), else the raw string."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError:
        return text


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError("config", f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of keys, got {type(data).__name__}")
    return data


# ---- overrides ---------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, Any]:
    """``"strategy.threshold=3.5"`` -> ``("strategy.threshold", 3.5)``."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", f"expected KEY=VALUE with a dotted KEY (e.g. rounds=20), got {text!r}")
    return key, parse_value(value.strip())


def apply_overrides(raw: dict[str, Any], overrides: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each dotted ``(key, value)`` set."""
    merged = _deep_copy(raw)
    for key, value in overrides:
        parts = key.split(".")
        node = merged
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: depth + 1]), f"is a value, cannot set {key} inside it")
            node = child
        node[parts[-1]] = value
    return merged


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---- building ----------------------------------------------------------------------


def _split_named_section(
    raw: Any, section: str, registry: Mapping[str, Any], options_of: Any, common: set[str], notes: list[str]
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Split a ``partition``/``strategy`` mapping into (name, common keys, option keys)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(section, f"expected a mapping of keys, got {describe(raw)}")
    name = raw.get("name")
    require(name is not None, f"{section}.name", f"is required; one of {', '.join(registry)}")
    require(
        isinstance(name, str) and name in registry,
        f"{section}.name",
        f"unknown {section} {describe(name)}; available: {', '.join(registry)}",
    )
    own = set(config_keys(options_of(registry[name])))
    others = {key for entry in registry.values() for key in config_keys(options_of(entry))}
    common_values, option_values = {}, {}
    for key, value in raw.items():
        if key in common:
            common_values[key] = value
        elif key in own:
            option_values[key] = value
        elif key in others:
            notes.append(f"{section}.{key} ignored: not an option of {section} '{name}'")
        else:
            allowed = sorted(common | own)
            raise ConfigError(f"{section}.{key}", unknown_key_message(str(key), allowed, f"for {section} '{name}'"))
    return name, common_values, option_values


@dataclass(frozen=True)
class _PartitionCommon:
    num_clients: int = 10
    samples_per_client: int | None = None
    test_fraction: float = 0.2
    val_fraction: float = 0.0  # of each client's samples, held out of training for model selection

    def validate(self, prefix: str) -> None:
        require(self.num_clients >= 1, f"{prefix}.num_clients", f"must be >= 1, got {self.num_clients}")
        if self.samples_per_client is not None:
            require(self.samples_per_client >= 2, f"{prefix}.samples_per_client", "must be >= 2")
        require(
            0.0 < self.test_fraction < 1.0,
            f"{prefix}.test_fraction",
            f"must be in (0, 1), got {self.test_fraction}",
        )
        require(
            0.0 <= self.val_fraction < 1.0 - self.test_fraction,
            f"{prefix}.val_fraction",
            f"must be in [0, 1 - test_fraction) = [0, {1.0 - self.test_fraction:g}), got {self.val_fraction}",
        )


def build_config(raw: Mapping[str, Any]) -> tuple[ExperimentConfig, list[str]]:
    """Validate a merged raw mapping; return the config and notes on ignored keys."""
    notes: list[str] = []
    allowed = set(TOP_LEVEL_SCALARS) | set(SECTIONS)
    for key in raw:
        if key not in allowed:
            raise ConfigError(str(key), unknown_key_message(str(key), sorted(allowed)))
    scalars = from_mapping(_TopLevel, {k: raw[k] for k in TOP_LEVEL_SCALARS if k in raw})

    part_name, part_common, part_opts = _split_named_section(
        raw.get("partition", {"name": "iid"}), "partition", PARTITIONERS,
        lambda p: p.options, PARTITION_COMMON, notes,
    )
    common = from_mapping(_PartitionCommon, {k: v for k, v in part_common.items() if k != "name"}, "partition")
    partition = PartitionConfig(
        name=part_name,
        num_clients=common.num_clients,
        samples_per_client=common.samples_per_client,
        test_fraction=common.test_fraction,
        val_fraction=common.val_fraction,
        options=from_mapping(PARTITIONERS[part_name].options, part_opts, "partition"),
    )
    strat_name, _, strat_opts = _split_named_section(
        raw.get("strategy", {"name": "fedavg"}), "strategy", STRATEGIES,
        lambda s: s.Options, {"name"}, notes,
    )
    strategy = StrategyConfig(strat_name, from_mapping(STRATEGIES[strat_name].Options, strat_opts, "strategy"))
    if "model" not in raw:
        raise ConfigError("model.name", f"is required; one of {', '.join(MODELS)}")
    config = ExperimentConfig(
        dataset=from_mapping(DatasetConfig, raw.get("dataset"), "dataset"),
        partition=partition,
        model=from_mapping(ModelConfig, raw.get("model"), "model"),
        client=from_mapping(ClientConfig, raw.get("client"), "client"),
        strategy=strategy,
        simulation=from_mapping(SimulationConfig, raw.get("simulation"), "simulation"),
        **dataclasses.asdict(scalars),
    )
    _check_experiment(config)
    return config, notes


@dataclass(frozen=True)
class _TopLevel:
    seed: int = 0
    rounds: int = 20
    target_accuracy: float = 0.9
    output_dir: str = "outputs"
    checkpoint_every: int = 0

    def validate(self, prefix: str) -> None:
        require(self.rounds >= 1, "rounds", f"must be >= 1, got {self.rounds}")
        require(0.0 <= self.target_accuracy <= 1.0, "target_accuracy", f"must be in [0, 1], got {self.target_accuracy}")
        require(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")


def _check_experiment(config: ExperimentConfig) -> None:
    """Checks that span sections."""
    from .models import model_outline

    try:
        model_outline(config.model.name, config.input_shape, config.num_classes)
    except ValueError as err:
        raise ConfigError(
            "model.name",
            f"'{config.model.name}' cannot take {config.dataset.name}'s inputs of shape "
            f"{config.input_shape}: {err}",
        ) from None
    num_clients = config.partition.num_clients
    for key, mapping in (("simulation.fail_fit", config.simulation.fail_fit), ("simulation.join_round", config.simulation.join_round)):
        for pid in mapping:
            require(0 <= pid < num_clients, f"{key}.{pid}", f"partition ids run from 0 to {num_clients - 1}")
    check = getattr(config.strategy.options, "check_experiment", None)
    if callable(check):
        check(config)


def load_config(
    path: str | Path | None, overrides: Iterable[tuple[str, Any]] = ()
) -> tuple[ExperimentConfig, list[str]]:
    """Read YAML ``path`` (or start empty), apply dotted overrides, validate."""
    raw = read_yaml(path) if path is not None else {}
    return build_config(apply_overrides(raw, overrides))


def config_to_dict(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as plain YAML-ready data; loading it gives the same config."""
    plain = to_plain(config)
    for section in ("partition", "strategy"):
        options = plain[section].pop("options") or {}
        plain[section].update(options)
    return plain
