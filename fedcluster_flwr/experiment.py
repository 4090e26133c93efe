"""What the ServerApp, the ClientApp and the CLI share: config -> data, partition, model, client.

Under ``flwr run`` both apps rebuild the experiment config from the run config
(``config`` names the YAML; the other keys and ``set`` are overrides). Under
``fedcluster run`` the CLI passes the already validated config to both apps.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .client import ClientData, ClusterClient, Faults
from .config import load_config, parse_override
from .config_sections import ExperimentConfig
from .data import DatasetPool, Partition, make_partition
from .data.sources import dataset_pool
from .models import build_model
from .numerics import pin_portable_numerics
from .schema import ConfigError
from .registry import strategies
from .training import get_weights, use_deterministic_kernels

APP_ROOT = Path(__file__).resolve().parent.parent  # the project root (or the installed FAB)
RUN_CONFIG_FILE_KEY = "config"
RUN_CONFIG_SET_KEY = "set"


def resolve_config_path(path: str) -> Path:
    """Absolute paths as they are; relative ones against the app root, then the cwd."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (APP_ROOT, Path.cwd()):
        if (base / candidate).exists():  # a folder too: load_config then says it is not a file
            return base / candidate
    raise ConfigError("config", f"file not found: {path} (looked in {APP_ROOT} and {Path.cwd()})")


def overrides_from_run_config(run_config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Dotted overrides carried by a Flower run config; empty strings mean 'keep the YAML'."""
    overrides = [
        (key, value)
        for key, value in sorted(run_config.items())
        if key not in (RUN_CONFIG_FILE_KEY, RUN_CONFIG_SET_KEY) and value != ""
    ]
    overrides += [parse_override(item) for item in shlex.split(str(run_config.get(RUN_CONFIG_SET_KEY, "")))]
    return overrides


@functools.lru_cache(maxsize=8)
def _config_from_items(items: tuple[tuple[str, Any], ...]) -> tuple[ExperimentConfig, tuple[str, ...]]:
    run_config = dict(items)
    path = resolve_config_path(str(run_config.get(RUN_CONFIG_FILE_KEY, "conf/default.yaml")))
    config, notes = load_config(path, overrides_from_run_config(run_config), strict=True)
    return config, tuple(notes)


def config_from_run_config(run_config: Mapping[str, Any]) -> ExperimentConfig:
    """The experiment config of a ``flwr run`` (cached: the ClientApp reads it with every message)."""
    return _config_from_items(tuple(sorted(run_config.items())))[0]


def run_config_notes(run_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The notes and warnings reading that config gave (ignored keys, fewer clients than groups)."""
    return _config_from_items(tuple(sorted(run_config.items())))[1]


@functools.lru_cache(maxsize=4)
def _partition(config_key: tuple[Any, ...]) -> Partition:
    dataset, partition, seed = config_key
    pool = dataset_pool(dataset)
    return make_partition(
        partition.name,
        partition.options,
        labels=pool.labels,
        num_classes=pool.num_classes,
        num_clients=partition.num_clients,
        samples_per_client=partition.samples_per_client,
        test_fraction=partition.test_fraction,
        val_fraction=partition.val_fraction,
        seed=seed,
        writers=pool.writers,
    )


def experiment_data(config: ExperimentConfig) -> tuple[DatasetPool, Partition]:
    """The dataset pool and partition of ``config``, loaded once per process."""
    dataset = config.dataset
    pool = dataset_pool(dataset)
    return pool, _partition((dataset, config.partition, config.seed))


def use_configured_numerics(config: ExperimentConfig) -> None:
    """``simulation.portable_numerics``: pin this process's CPU kernels before its first torch op."""
    if config.simulation.portable_numerics:
        try:
            pin_portable_numerics()
        except ValueError as err:
            raise ConfigError("simulation.portable_numerics", str(err)) from None


def configure_torch(config: ExperimentConfig, clients_here: bool = True) -> None:
    """Set up this process's torch as ``config`` asks, or refuse what this machine cannot honour:
    ``simulation.portable_numerics``, ``client.device`` and ``simulation.deterministic``.

    The switches are per process, so each process calls it: :func:`make_client` in every client's
    (under ``flwr run`` the first to read the config), and ``fedcluster run`` in its driver before
    Ray starts, so that a mistake is one error line before any worker and the workers inherit the
    environment pins (the driver's own torch work then follows the clients' rules, as it does when
    the in-process driver builds the clients). ``clients_here`` False: the clients run on other
    machines (a Ray cluster's), whose GPUs this one cannot see; each client checks its own.
    """
    use_configured_numerics(config)  # first: the pins must precede this process's first torch operation
    if config.client.device == "cuda" and clients_here and not torch.cuda.is_available():
        raise ConfigError("client.device", "is 'cuda' but this machine has no CUDA GPU; use 'auto' or 'cpu'")
    if config.simulation.deterministic:
        try:
            use_deterministic_kernels()
        except ValueError as err:
            raise ConfigError("simulation.deterministic", str(err)) from None


def configure_driver_torch(config: ExperimentConfig) -> None:
    """:func:`configure_torch` in ``fedcluster run``'s own processes (before Ray starts, and in the
    simulation's process): the clients run on this machine unless ``simulation.ray_address`` joins
    a cluster, whose machines check their own GPUs."""
    configure_torch(config, clients_here=config.simulation.ray_address is None)


def model_factory(config: ExperimentConfig) -> Callable[[], torch.nn.Module]:
    return functools.partial(build_model, config.model.name, config.input_shape, config.num_classes)


def initial_model(config: ExperimentConfig, seed: int | None = None) -> torch.nn.Module:
    """The model initialised with ``seed`` (default: the run's seed, the model every strategy starts from)."""
    torch.manual_seed(config.seed if seed is None else seed)
    return model_factory(config)()


def seeded_weights(config: ExperimentConfig, seed: int) -> list[np.ndarray]:
    return get_weights(initial_model(config, seed))


def initial_weights(config: ExperimentConfig) -> list[np.ndarray]:
    return get_weights(initial_model(config))


def run_title(config: ExperimentConfig) -> str:
    return f"{config.strategy.name} on {config.dataset.name} / {config.partition.name} ({config.partition.num_clients} clients)"


def strategy_phase_words() -> dict[str, str]:
    """How the plots' legend words the registered strategies' phases where "<phase> rounds"
    (:func:`~fedcluster_flwr.plots.phase_words`' default) would not say it: each strategy class's
    own phases (``phase_words``: "pretrain" -> "local pretraining") and a gossip strategy's exchange
    rounds ("dac" -> "dac gossip exchanges", its ``round_word``)."""
    words: dict[str, str] = {}
    for name, cls in strategies().items():
        words.update(cls.phase_words)
        if cls.round_word != "rounds":
            words[name] = f"{name} {cls.round_word}"
    return words


def majority_accuracy(labels: np.ndarray, partition: Partition) -> dict[int, float]:
    """Per client, the accuracy of always answering the most common label of its test set, as the
    client sees its labels (after its transform's relabelling)."""
    shares = {}
    for pid, (idx, transform) in enumerate(zip(partition.test_indices, partition.transforms)):
        seen = labels[idx] if transform.label_map is None else np.asarray(transform.label_map)[labels[idx]]
        if len(seen):
            shares[pid] = float(np.bincount(seen).max() / len(seen))
    return shares


def client_data(config: ExperimentConfig, pid: int) -> ClientData:
    """Partition ``pid``'s train/test (and validation) tensors, as the simulated client sees them."""
    pool, partition = experiment_data(config)
    transform = partition.transforms[pid]
    standardize = config.dataset.scaling == "standardized"
    x_train, y_train = pool.tensors(partition.train_indices[pid], transform, standardize)
    x_test, y_test = pool.tensors(partition.test_indices[pid], transform, standardize)
    validation = pool.tensors(partition.val_indices[pid], transform, standardize) if partition.val_indices else (None, None)
    return ClientData(x_train, y_train, x_test, y_test, *validation)


def client_device(config: ExperimentConfig) -> torch.device:
    """Where the clients train: ``client.device``, ``auto`` meaning the GPU where there is one."""
    device = config.client.device
    return torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")


def make_client(
    config: ExperimentConfig,
    pid: int,
    num_partitions: int,
    data: ClientData | None = None,
    client_class: Callable[..., ClusterClient] = ClusterClient,
) -> ClusterClient:
    """The client of partition ``pid`` (or, given ``data``, of client ``pid`` on a device's own data)."""
    configure_torch(config)  # before the client's data become tensors
    if not 0 <= pid < config.partition.num_clients:
        name = "partition-id" if data is None else "client-id"
        raise ValueError(f"{name} {pid} is outside 0..{config.partition.num_clients - 1} (partition.num_clients)")
    return client_class(
        pid=pid,
        num_partitions=num_partitions,
        data=client_data(config, pid) if data is None else data,
        model_factory=model_factory(config),
        settings=config.client,  # a TrainSettings (and where the client runs, read by client_device)
        seed=config.seed,
        device=client_device(config),
        fail_rounds=config.simulation.fail_fit.get(pid, ()),
        faults=Faults(config.faults.drop_rate, config.faults.nan_rate, config.faults.seed),
    )
