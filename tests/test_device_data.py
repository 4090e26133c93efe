"""A device's own data (data-dir SuperNodes) and `fedcluster export-partitions`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.cli.console import main
from fedcluster_flwr.apps.client_app import FedclusterClientApp
from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.data import DataError
from fedcluster_flwr.data.device import NodeConfigError, load_device_data, node_data_source
from fedcluster_flwr.data.sources import InputFormat, input_format
from fedcluster_flwr.cli.export import config_hash, export_partitions
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.algorithms.baselines.strategy import FedAvg, FractionOptions
from helpers import SyntheticGrid, SyntheticNode, constant_model, synthetic_round, make_setup

THREE_CLIENTS = [("partition.num_clients", 3)]


def context(node_config, overrides=""):
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(),
                   run_config={"config": "conf/default.yaml", "set": overrides})


def splits(data):
    return [data.x_train, data.y_train, data.x_test, data.y_test]


@pytest.mark.parametrize("overrides", [
    THREE_CLIENTS,  # label swap
    [("partition.name", "rotation"), ("partition.num_clients", 4), ("partition.angles", [0, 90]),
     ("partition.cluster_sizes", [2, 2]), ("partition.val_fraction", 0.1)],
])
def test_an_exported_partition_gives_the_data_dir_client_exactly_the_simulated_clients_tensors(tmp_path, overrides):
    config, _ = load_config(DEFAULT_CONFIG, overrides)
    manifest = export_partitions(config, tmp_path)
    assert manifest["num_clients"] == config.partition.num_clients
    for entry in manifest["clients"]:
        pid = entry["client_id"]
        simulated = Experiment(config).client_data(pid)
        device = load_device_data(tmp_path / entry["dir"], input_format(config))
        for got, expected in zip(splits(device) + [device.x_val, device.y_val],
                                 splits(simulated) + [simulated.x_val, simulated.y_val]):
            if expected is None:
                assert got is None
                continue
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got, expected)  # bit for bit


def test_export_partitions_command_writes_a_manifest_with_true_clusters_and_node_configs(tmp_path, capsys):
    assert main(["export-partitions", str(DEFAULT_CONFIG), str(tmp_path), "--set", "partition.num_clients=4"]) == 0
    assert "exported 4 clients of digits" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    config, _ = load_config(tmp_path / "config.yaml")
    assert manifest["config_hash"] == config_hash(load_config_dict(tmp_path))
    assert [c["true_cluster"] for c in manifest["clients"]] == [0, 1, 2, 3]
    assert manifest["clients"][2]["node_config"] == f"data-dir='{tmp_path / 'client_2'}' client-id=2 cluster-id=2"
    assert (tmp_path / "client_3" / "data.npz").is_file()


def load_config_dict(folder):
    import yaml

    return yaml.safe_load((folder / "config.yaml").read_text())


def test_an_image_folder_tree_is_read_as_the_simulation_normalises_it(tmp_path):
    """PNG files hold 8-bit pixels: the round trip is exact up to the 8-bit quantisation."""
    config, _ = load_config(DEFAULT_CONFIG, THREE_CLIENTS)
    export_partitions(config, tmp_path, images=True)
    (tmp_path / "client_1" / "data.npz").unlink()  # the folder now holds only the PNG tree
    device = load_device_data(tmp_path / "client_1", InputFormat.builtin("digits"))
    simulated = Experiment(config).client_data(1)
    for x_device, y_device, x_sim, y_sim in ((device.x_train, device.y_train, simulated.x_train, simulated.y_train),
                                             (device.x_test, device.y_test, simulated.x_test, simulated.y_test)):
        assert sorted(y_device.tolist()) == sorted(y_sim.tolist())
        assert x_device.shape == x_sim.shape
        pixel = 1 / 255 / 0.375  # one 8-bit step, in standardised units
        np.testing.assert_allclose(np.sort(x_device.flatten().numpy()), np.sort(x_sim.flatten().numpy()),
                                   atol=pixel / 2 + 1e-6)  # the tree is grouped by label: compared as sets


def test_with_unit_scaling_the_image_tree_and_the_device_keep_inputs_in_0_1(tmp_path):
    """dataset.scaling unit: the export undoes no standardisation it did not do, and the device
    scales pixels as the simulation did (x/255), up to the 8-bit quantisation."""
    config, _ = load_config(DEFAULT_CONFIG, THREE_CLIENTS + [("dataset.scaling", "unit")])
    export_partitions(config, tmp_path, images=True)
    (tmp_path / "client_2" / "data.npz").unlink()
    device = load_device_data(tmp_path / "client_2", input_format(config))
    simulated = Experiment(config).client_data(2)
    assert float(simulated.x_train.min()) >= 0.0 and float(simulated.x_train.max()) <= 1.0
    np.testing.assert_allclose(np.sort(device.x_train.flatten().numpy()), np.sort(simulated.x_train.flatten().numpy()),
                               atol=1 / 255 / 2 + 1e-6)


def test_eight_bit_images_of_a_dataset_standardised_by_its_own_statistics_are_refused_with_the_reason(tmp_path):
    """An hf dataset is standardised by the pool's mean and std, which a device does not have."""
    folder = tmp_path / "device"
    (folder / "train" / "0").mkdir(parents=True)
    (folder / "test" / "0").mkdir(parents=True)
    from PIL import Image

    for split in ("train", "test"):
        Image.new("L", (8, 8)).save(folder / split / "0" / "a.png")
    inputs = InputFormat("hf", (1, 8, 8), 10, None, None)
    with pytest.raises(DataError, match=r"whole dataset's mean and std.*export-partitions.*dataset.scaling: unit"):
        load_device_data(folder, inputs)
    floats = write_npz(tmp_path / "floats")  # float arrays are the model's inputs already: taken as they are
    assert load_device_data(floats, inputs).x_train.shape == (4, 1, 8, 8)


def write_npz(folder, **arrays):
    folder.mkdir(parents=True, exist_ok=True)
    good = {"x_train": np.zeros((4, 1, 8, 8), np.float32), "y_train": np.arange(4),
            "x_test": np.zeros((2, 1, 8, 8), np.float32), "y_test": np.arange(2)}
    np.savez(folder / "data.npz", **(good | arrays))
    return folder


@pytest.mark.parametrize("arrays, message", [
    ({"x_train": np.zeros((4, 1, 28, 28), np.float32)}, r"data.npz: x_train has shape \(4, 1, 28, 28\), but the model takes digits images \(N, 1, 8, 8\)"),
    ({"y_test": np.array([0, 10])}, r"data.npz: y_test holds labels 0..10; the model has 10 classes"),
    ({"y_train": np.arange(3)}, r"data.npz: y_train has shape \(3,\); expected \(4,\)"),
    ({"x_test": np.full((2, 1, 8, 8), np.nan, np.float32)}, r"data.npz: x_test holds NaN"),
])
def test_a_data_file_that_does_not_fit_the_model_is_one_error_naming_the_file(tmp_path, arrays, message):
    folder = write_npz(tmp_path / "bad", **arrays)
    with pytest.raises(DataError, match=message) as error:
        load_device_data(folder, InputFormat.builtin("digits"))
    assert str(folder / "data.npz") in str(error.value) and "\n" not in str(error.value)


def test_an_image_of_the_wrong_size_is_one_error_naming_the_file(tmp_path):
    from PIL import Image

    (tmp_path / "train" / "3").mkdir(parents=True)
    (tmp_path / "test" / "3").mkdir(parents=True)
    Image.new("L", (28, 28)).save(tmp_path / "train" / "3" / "a.png")
    with pytest.raises(DataError, match=r"train/3/a.png is 28x28 pixels; digits images are 8x8"):
        load_device_data(tmp_path, InputFormat.builtin("digits"))


def test_an_empty_folder_says_what_it_expected(tmp_path):
    with pytest.raises(DataError, match="no data.npz and no train/<label>/\\*.png"):
        load_device_data(tmp_path, InputFormat.builtin("digits"))


@pytest.mark.parametrize("node_config, message", [
    ({"partition-id": 0, "num-partitions": 3, "colour": "red"}, "unknown key\\(s\\) colour"),
    ({"partition-id": 0, "num-partitions": 3, "data-dir": "/d"}, "either data-dir .* or partition-id/num-partitions .*, not both"),
    ({}, "node config lacks 'partition-id' and 'num-partitions' \\(or 'data-dir'\\)"),
    ({"data-dir": "/d"}, "data-dir needs client-id=<i>"),
    ({"data-dir": "/d", "client-id": "x"}, "client-id='x', expected an integer"),
    ({"partition-id": 0, "num-partitions": 3, "cluster-id": 1}, "cluster-id goes with data-dir"),
])
def test_a_bad_node_config_is_one_clear_error(node_config, message):
    with pytest.raises(NodeConfigError, match=message):
        node_data_source(node_config)


def test_the_client_app_builds_a_data_dir_client_that_reports_its_id_size_and_cluster(tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, THREE_CLIENTS)
    export_partitions(config, tmp_path)
    app = FedclusterClientApp()
    client = app.client(context({"data-dir": str(tmp_path / "client_2"), "client-id": 2, "cluster-id": 2},
                                "partition.num_clients=3"))
    assert client.identity() == {"partition_id": 2, "num_partitions": 3, "own_data": 1,
                                 "train_examples": len(Experiment(config).client_data(2).y_train), "true_cluster": 2}
    anonymous = app.client(context({"data-dir": str(tmp_path / "client_0"), "client-id": 0}, "partition.num_clients=3"))
    assert anonymous.identity()["true_cluster"] == -1  # the device does not know it
    with pytest.raises(ValueError, match="client-id 5 is outside 0..2"):
        app.client(context({"data-dir": str(tmp_path / "client_0"), "client-id": 5}, "partition.num_clients=3"))


def device(name, pid, num_partitions, examples, cluster=None):
    """A node on its own data: it tells its size and, if given, its true cluster."""
    facts = {"partition_id": pid, "num_partitions": num_partitions, "own_data": 1, "train_examples": examples,
             "true_cluster": -1 if cluster is None else cluster}
    return SyntheticNode(name, pid, num_partitions, identify=lambda: facts)


def test_a_device_without_a_cluster_id_makes_the_true_cluster_scores_unavailable_not_zero(tmp_path):
    strategy = FedAvg(FractionOptions(client_fraction=1.0), make_setup(tmp_path, 3, true=[0, 1, 1]))
    manager = SyntheticGrid([SyntheticNode("a", 0, 3), SyntheticNode("b", 1, 3), device("c", 2, 3, examples=50)])
    synthetic_round(strategy, manager, 1, lambda c: (constant_model(1.0), 10, {}))
    row = strategy.observer.recorder.rows[-1]
    assert row["purity"] is None and row["ari"] is None and row["nmi"] is None
    assert row["true_cluster_unavailable"] == [2]
    assert row["per_true_cluster_accuracy"] == {"0": 0.8, "1": 0.8}  # client 2 counts under no true cluster
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["true_clusters"] == [0, 1, None] and summary["purity"] is None


def test_a_device_with_a_cluster_id_is_scored_with_it_and_its_size_bounds_its_replies(tmp_path):
    strategy = FedAvg(FractionOptions(client_fraction=1.0), make_setup(tmp_path, 3, true=[0, 0, 0], train_sizes=[10, 10, 10]))
    manager = SyntheticGrid([SyntheticNode("a", 0, 3), SyntheticNode("b", 1, 3), device("c", 2, 3, examples=50, cluster=1)])
    synthetic_round(strategy, manager, 1, lambda c: (constant_model(1.0), 40 if c.pid == 2 else 10, {}))
    row = strategy.observer.recorder.rows[-1]
    assert row["rejected_updates"] == 0  # 40 examples: over the partition's 10, within the device's 50
    assert row["purity"] == pytest.approx(2 / 3) and "true_cluster_unavailable" not in row  # one cluster, true 0, 0, 1
    assert set(row["per_true_cluster_accuracy"]) == {"0", "1"}
