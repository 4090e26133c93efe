"""The Flower apps as `flwr run` loads them: run config -> config, run directory, clients."""

from __future__ import annotations


import pytest
from flwr.common import Context, RecordDict
from ray import cloudpickle

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.client_app import ExperimentClientApp, make_client_fn
from fedcluster_flwr.config import load_config
from fedcluster_flwr.server_app import FLWR_RUN_OUTPUT_ROOT, RunConfigError, flwr_run_dir, server_fn


def context(run_config=None, node_config=None) -> Context:
    return Context(run_id=42, node_id=7, node_config=node_config or {}, state=RecordDict(),
                   run_config={"config": "conf/default.yaml", "set": "", **(run_config or {})})


def test_relative_output_dir_goes_under_the_home_folder_with_the_run_id():
    config, _ = load_config(DEFAULT_CONFIG)
    run_dir = flwr_run_dir(config, 42)
    assert run_dir.parent == FLWR_RUN_OUTPUT_ROOT / "outputs" and run_dir.name.endswith("_flhc_digits_label_swap_run42")


def test_absolute_output_dir_is_kept(tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, [("output_dir", str(tmp_path))])
    assert flwr_run_dir(config, 1).parent == tmp_path


def test_server_fn_fails_a_misconfigured_run(caplog):
    """An Exception (not SystemExit, which Flower's ServerApp thread swallowed): the run is marked failed."""
    with pytest.raises(RunConfigError, match="^strategy.linkage: ward linkage needs distance l2"):
        server_fn(context({"set": "strategy.linkage=ward strategy.distance=l1"}))
    assert "strategy.linkage: ward linkage needs distance l2" in caplog.text


def test_server_fn_builds_the_strategy_from_the_run_config(tmp_path):
    components = server_fn(context({"strategy.name": "oracle", "rounds": 3, "output_dir": str(tmp_path)}))
    assert components.strategy.name == "oracle" and components.config.num_rounds == 3
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "config.yaml").is_file()


def test_client_fn_builds_the_client_of_its_partition():
    client = make_client_fn()(context(node_config={"partition-id": 3, "num-partitions": 20}))
    assert client.numpy_client.get_properties({})["partition_id"] == 3


def test_the_client_app_of_fedcluster_run_travels_to_ray_actors_as_its_config():
    config, _ = load_config(DEFAULT_CONFIG, [("client.epochs", 2)])
    pickled = cloudpickle.dumps(ExperimentClientApp(config))
    assert b"make_client_fn.<locals>" not in pickled  # the config, not closures pickled by value
    app = cloudpickle.loads(pickled)
    assert isinstance(app, ExperimentClientApp) and app.config == config
    assert app._call is not None  # a working ClientApp (Flower calls _call with each message)


def test_client_fn_explains_a_missing_node_config():
    with pytest.raises(ValueError, match="--node-config 'partition-id=<i> num-partitions=<n>'"):
        make_client_fn()(context(node_config={"num-partitions": 20}))
