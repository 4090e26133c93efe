"""Flower ClientApp: builds the ClusterClient of this node's data from the run config.

The node config says which data: ``partition-id``/``num-partitions`` (a partition of the
experiment's dataset, as in simulation) or ``data-dir``/``client-id`` (the device's own files);
see :mod:`fedcluster_flwr.data.device`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from flwr.app import Context
from flwr.client import Client, NumPyClient
from flwr.common import NDArrays, Scalar
from flwr.clientapp import ClientApp

from . import protocol
from .config_sections import ExperimentConfig
from .data.device import DeviceClient, FolderSource, load_device_data, node_data_source
from .data.sources import input_format
from .experiment import config_from_run_config, configure_torch, make_client


class OutsideTheExperiment(NumPyClient):
    """A node whose partition id the experiment lacks (more SuperNodes than ``partition.num_clients``).

    It still tells the server its partition, so that the server refuses the federation once, naming
    the fix, rather than every such node failing with its own traceback; it does no work.
    """

    def __init__(self, pid: int, num_partitions: int, num_clients: int) -> None:
        self.pid, self.num_partitions, self.num_clients = pid, num_partitions, num_clients

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        return {protocol.PARTITION_ID: self.pid, protocol.NUM_PARTITIONS: self.num_partitions}

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        raise ValueError(f"partition-id {self.pid} is outside 0..{self.num_clients - 1} (partition.num_clients)")

    evaluate = fit  # type: ignore[assignment]


def make_device_client(config: ExperimentConfig, source: FolderSource) -> DeviceClient:
    """The client of a SuperNode started with ``data-dir``: client ``source.client_id`` of the
    experiment, on the folder's data."""
    configure_torch(config)  # before the device's data become tensors (portable numerics' pins)
    data = load_device_data(source.data_dir, input_format(config))
    return make_client(
        config, source.client_id, config.partition.num_clients, data=data,
        client_class=functools.partial(DeviceClient, cluster_id=source.cluster_id),
    )


def make_client_fn(config: ExperimentConfig | None = None) -> Callable[[Context], Client]:
    """client_fn for a fixed config (``fedcluster run``) or one read from the run config."""

    def client_fn(context: Context) -> Client:
        torch.set_num_threads(1)  # one thread per simulated client; Ray runs several at once
        experiment = config if config is not None else config_from_run_config(context.run_config)
        source = node_data_source(context.node_config)
        if isinstance(source, FolderSource):
            return make_device_client(experiment, source).to_client()
        if not 0 <= source.pid < experiment.partition.num_clients:
            return OutsideTheExperiment(source.pid, source.num_partitions, experiment.partition.num_clients).to_client()
        return make_client(experiment, source.pid, source.num_partitions).to_client()

    return client_fn


class ExperimentClientApp(ClientApp):
    """The ClientApp of one given config (``fedcluster run``), pickled as that config.

    Flower's Ray engine pickles the ClientApp into every message it hands an actor; a ClientApp
    made of closures is pickled by value, and cloudpickle searches the loaded modules for each
    function's submodules. Pickled as its config and built again from it, the engine process
    spends ~2.3 ms less of its GIL per message (benchmarks/overhead; 120 messages per round of
    Briggs et al.'s setting).
    """

    def __init__(self, config: ExperimentConfig) -> None:
        super().__init__(client_fn=make_client_fn(config))
        self.config = config

    def __reduce__(self) -> tuple[type[ExperimentClientApp], tuple[ExperimentConfig]]:
        return ExperimentClientApp, (self.config,)


app = ClientApp(client_fn=make_client_fn())
