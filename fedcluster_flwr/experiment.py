"""One experiment, as a process builds it from its validated config: data, model, clients, strategy.

:class:`Experiment` is what the ServerApp, the ClientApp, the engines and the benchmarks build
from: one object per process (per ``fedcluster run``'s run process, per ``flwr run``'s run config),
made once from the config, whose parts are made on first need:

* :meth:`~Experiment.data`: the dataset pool and the partition (loaded once per process);
* :meth:`~Experiment.model`: the model, initialised with a seed (the run's by default);
* :meth:`~Experiment.client`: the client of a partition (or of a device's own data);
* :meth:`~Experiment.strategy`: the strategy writing to a run directory, connected to its round log.

The strategy's class is the one the config was read with (``config.strategy.strategy_class``): the
registry is asked once, when the name is read, not again on the way to the constructor. Under
``flwr run`` both apps read the config from the run config (:mod:`fedcluster_flwr.apps.run_config`);
under ``fedcluster run`` the CLI passes the already validated config to the run's process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .algorithms.base import ClusteredStrategy, StrategySetup
from .algorithms.base.directory import Federation
from .client import ClientData, ClusterClient, Faults
from .config.load import config_to_dict
from .config.sections import ExperimentConfig
from .data import DatasetPool, Partition, cluster_names, make_partition
from .data.sources import dataset_pool
from .models import build_model, parameter_names
from .numerics import client_device, configure_torch, numeric_platform, use_configured_numerics
from .plots import run_title, strategy_phase_words
from .results.provenance import software
from .results.recorder import RunRecorder
from .results.round_log import RoundLog
from .results.run_files import RoundRow
from .training import get_weights


@functools.lru_cache(maxsize=4)
def _partition(config_key: tuple[Any, ...]) -> Partition:
    """A partition, made once per process for its dataset, partition section and seed (an
    :class:`Experiment` built again in the same process, as a Ray actor does per message, finds it)."""
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


def majority_accuracy(labels: np.ndarray, partition: Partition) -> dict[int, float]:
    """Per client, the accuracy of always answering the most common label of its test set, as the
    client sees its labels (after its transform's relabelling)."""
    shares = {}
    for pid, (idx, transform) in enumerate(zip(partition.test_indices, partition.transforms)):
        seen = labels[idx] if transform.label_map is None else np.asarray(transform.label_map)[labels[idx]]
        if len(seen):
            shares[pid] = float(np.bincount(seen).max() / len(seen))
    return shares


class Experiment:
    """The experiment of one validated config (see the module docstring)."""

    def __init__(self, config: ExperimentConfig) -> None:
        if config.strategy.strategy_class is None:
            raise TypeError("the config's strategy has no class: read configs with config.load.load_config")
        self.config = config
        self.strategy_class: type[ClusteredStrategy] = config.strategy.strategy_class

    def __repr__(self) -> str:
        return f"Experiment({self.config.strategy.name} on {self.config.dataset.name}, {self.config.partition.name})"

    # ---- data and model ----------------------------------------------------------------------------

    def data(self) -> tuple[DatasetPool, Partition]:
        """The dataset pool and the partition, loaded once per process."""
        config = self.config
        return dataset_pool(config.dataset), _partition((config.dataset, config.partition, config.seed))

    @property
    def model_factory(self) -> Callable[[], torch.nn.Module]:
        """A fresh model, initialised from torch's global generator as it stands."""
        config = self.config
        return functools.partial(build_model, config.model.name, config.input_shape, config.num_classes)

    def model(self, seed: int | None = None) -> torch.nn.Module:
        """The model initialised with ``seed`` (default: the run's seed, the model every strategy starts from)."""
        torch.manual_seed(self.config.seed if seed is None else seed)
        return self.model_factory()

    def weights(self, seed: int | None = None) -> list[np.ndarray]:
        """:meth:`model`'s weights, as arrays."""
        return get_weights(self.model(seed))

    def majority_accuracy(self) -> dict[int, float]:
        """Per client, the accuracy of always answering its test set's most common label."""
        pool, partition = self.data()
        return majority_accuracy(pool.labels, partition)

    # ---- clients -----------------------------------------------------------------------------------

    def client_data(self, pid: int) -> ClientData:
        """Partition ``pid``'s train/test (and validation) tensors, as the simulated client sees them."""
        pool, partition = self.data()
        transform = partition.transforms[pid]
        standardize = self.config.dataset.scaling == "standardized"
        x_train, y_train = pool.tensors(partition.train_indices[pid], transform, standardize)
        x_test, y_test = pool.tensors(partition.test_indices[pid], transform, standardize)
        validation = pool.tensors(partition.val_indices[pid], transform, standardize) if partition.val_indices else (None, None)
        return ClientData(x_train, y_train, x_test, y_test, *validation)

    def client(
        self,
        pid: int,
        num_partitions: int | None = None,
        data: ClientData | None = None,
        client_class: Callable[..., ClusterClient] = ClusterClient,
    ) -> ClusterClient:
        """The client of partition ``pid`` (or, given ``data``, of client ``pid`` on a device's own
        data), told there are ``num_partitions`` (default: ``partition.num_clients``)."""
        config = self.config
        configure_torch(config)  # before the client's data become tensors
        if not 0 <= pid < config.partition.num_clients:
            name = "partition-id" if data is None else "client-id"
            raise ValueError(f"{name} {pid} is outside 0..{config.partition.num_clients - 1} (partition.num_clients)")
        return client_class(
            pid=pid,
            num_partitions=config.partition.num_clients if num_partitions is None else num_partitions,
            data=self.client_data(pid) if data is None else data,
            model_factory=self.model_factory,
            settings=config.client,  # a TrainSettings (and where the client runs, read by client_device)
            seed=config.seed,
            device=client_device(config),
            fail_rounds=config.simulation.fail_fit.get(pid, ()),
            faults=Faults(config.faults.drop_rate, config.faults.nan_rate, config.faults.seed),
        )

    # ---- the strategy ------------------------------------------------------------------------------

    def setup(self) -> StrategySetup:
        """The algorithm's inputs: the initial model, the partition's sizes and true clusters, ..."""
        config = self.config
        _, partition = self.data()
        model = self.model()
        return StrategySetup(
            initial_weights=get_weights(model),
            parameter_names=parameter_names(model),
            init_weights=self.weights,
            input_shape=config.input_shape,
            num_clients=config.partition.num_clients,
            true_clusters=partition.true_clusters,
            train_sizes=[len(idx) for idx in partition.train_indices],
            rounds=config.rounds,
            seed=config.seed,
            cluster_names=cluster_names(config.partition.options, int(partition.true_clusters.max(initial=0)) + 1),
        )

    def strategy(
        self,
        run_dir: Path,
        *,
        on_round: Callable[[RoundRow], None] | None = None,
        fresh: bool = True,
        stop_after: int | None = None,
        make_strategy: Callable[[StrategySetup], Any] | None = None,
    ) -> ClusteredStrategy:
        """The strategy (the config's class, or ``make_strategy``'s from :meth:`setup`) writing to
        ``run_dir`` through its round log (its ``observer``): ``fresh`` starts the run's files there
        (else they are continued: a resume); ``stop_after``: the round after which the log stops
        the run, checkpointed; ``on_round``: called with each round's row as it is recorded."""
        config = self.config
        use_configured_numerics(config)  # the portable pins, before the model's first torch operation
        setup = self.setup()
        strategy = self.strategy_class(config.strategy.options, setup) if make_strategy is None else make_strategy(setup)
        resolved = config_to_dict(config)
        recorder = RunRecorder(run_dir, on_round, resolved, phase_words=strategy_phase_words([type(strategy)]))
        if fresh:
            recorder.start(resolved)
        round_log = RoundLog(
            recorder, setup.true_clusters, config.target_accuracy, config.rounds, config.checkpoint_every,
            stop_round=stop_after, numeric_platform=numeric_platform(), software=software(), title=run_title(config),
            majority_accuracy=self.majority_accuracy(),
        )
        strategy.connect(Federation(join_round=config.simulation.join_round, timeout_s=config.simulation.round_timeout_s),
                         round_log)
        return strategy
