"""What the ServerApp, the ClientApp and the CLI share: config -> data, partition, model, client.

Under ``flwr run`` both apps rebuild the experiment config from the run config
(:mod:`fedcluster_flwr.apps.run_config`); under ``fedcluster run`` the CLI passes the already
validated config to both apps. The torch switches a config sets for a process are in
:mod:`fedcluster_flwr.numerics`, the words the plots use in :mod:`fedcluster_flwr.plots`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .client import ClientData, ClusterClient, Faults
from .config.sections import ExperimentConfig
from .data import DatasetPool, Partition, make_partition
from .data.sources import dataset_pool
from .models import build_model
from .numerics import configure_torch
from .training import get_weights

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
