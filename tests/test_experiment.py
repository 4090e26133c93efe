"""fedcluster_flwr.experiment.Experiment: one object per process, built once from the config; the
registry asked once between the YAML and the strategy's constructor."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from fedcluster_flwr import registry
from fedcluster_flwr.algorithms.multimodel.strategy import IFCA
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.config.load import config_to_dict, load_config
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.results.run_files import read_summary
from helpers import DEFAULT_CONFIG

SMALL = [("rounds", 1), ("partition.num_clients", 4), ("simulation.engine", "inprocess")]
FEDAVG = [("strategy.name", "fedavg"), *SMALL]


class CountingRegistry(dict):
    """The registry's table of strategies, counting how often the whole table is read (every
    lookup by name goes through ``registry.strategies()``, which reads it)."""

    reads = 0

    def items(self):
        type(self).reads += 1
        return super().items()


@pytest.fixture
def counted(monkeypatch):
    registry.load_families()
    CountingRegistry.reads = 0
    monkeypatch.setattr(registry, "STRATEGIES", CountingRegistry(registry.STRATEGIES))
    return CountingRegistry


def test_the_registry_is_asked_once_between_the_yaml_and_the_constructor(counted, tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, [("strategy.name", "ifca"), ("strategy.num_clusters", 2), *SMALL])
    assert counted.reads == 1  # reading strategy.name: the class found there travels with the config
    strategy = run_in_process(config, tmp_path / "run")
    assert isinstance(strategy, IFCA) and read_summary(tmp_path / "run")["completed_rounds"] == 1
    assert counted.reads == 1  # the run, its ClientApp and its recorder did not ask again


def test_the_strategy_class_travels_with_the_config_but_is_never_written_out():
    config, _ = load_config(DEFAULT_CONFIG, [("strategy.name", "ifca"), ("strategy.num_clusters", 2)])
    assert config.strategy.strategy_class is IFCA
    assert pickle.loads(pickle.dumps(config)).strategy.strategy_class is IFCA  # to the run's process, to Ray's actors
    plain = config_to_dict(config)
    assert "strategy_class" not in plain["strategy"] and plain["strategy"]["name"] == "ifca"


def test_an_experiment_builds_what_the_config_describes_the_same_way_each_time():
    config, _ = load_config(DEFAULT_CONFIG, FEDAVG)
    experiment = Experiment(config)
    pool, partition = experiment.data()
    assert experiment.data()[1] is partition  # loaded once per process
    assert all(np.array_equal(a, b) for a, b in zip(experiment.weights(), Experiment(config).weights()))
    assert not all(np.array_equal(a, b) for a, b in zip(experiment.weights(), experiment.weights(seed=config.seed + 1)))
    client = experiment.client(2)
    assert client.identity()["partition_id"] == 2 and client.num_train == len(partition.train_indices[2])
    assert torch.equal(client.data.x_train, experiment.client_data(2).x_train)
    setup = experiment.setup()
    assert setup.num_clients == 4 and list(setup.train_sizes) == [len(i) for i in partition.train_indices]


def test_a_client_outside_the_experiment_is_refused_naming_the_key():
    config, _ = load_config(DEFAULT_CONFIG, FEDAVG)
    with pytest.raises(ValueError, match=r"partition-id 4 is outside 0..3 \(partition.num_clients\)"):
        Experiment(config).client(4)
