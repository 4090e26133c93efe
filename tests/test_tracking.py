"""Experiment tracking (``tracking:``): the logged values read back from TensorBoard's event files
and MLflow's local file store, one tracker run across a resume, a new linked one for a branch, a
missing package as one config error line, and a tracker failure that leaves the run whole."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.results import tracking
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.results.recorder import branch_run
from fedcluster_flwr.results.run_files import read_rounds, read_summary
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.results.tracking import TRACKING_FILE, numeric_fields

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None
needs_tensorboard = pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard not installed: pip install -e '.[tensorboard]'")
needs_mlflow = pytest.mark.skipif(not HAVE_MLFLOW, reason="mlflow not installed: pip install -e '.[mlflow]'")

# The default FL+HC digits run, short: it clusters after round 2, so rows carry per-cluster values.
SETTINGS = ("rounds=4", "strategy.rounds_before_clustering=2", "partition.num_clients=8",
            "partition.num_groups=2")


def tracked_config(backend: str, *extra: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*SETTINGS, f"tracking={backend}", *extra)])[0]


def expected_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every numeric field of rounds.jsonl, by name then round: what the tracker must hold."""
    by_name: dict[str, dict[int, float]] = {}
    for row in read_rounds(run_dir):
        for name, value in numeric_fields({k: v for k, v in row.items() if k != "round"}).items():
            by_name.setdefault(name, {})[row["round"]] = value
    return by_name


def test_numeric_fields_flatten_nested_numbers_and_leave_the_rest_out():
    row = {"a": 1, "b": 0.5, "flag": True, "phase": "x", "none": None, "ids": [1, 2], "per": {"0": 0.25, "1": None}}
    assert numeric_fields(row, "p/") == {"p/a": 1.0, "p/b": 0.5, "p/per/0": 0.25}


def test_tracking_defaults_to_none_and_writes_nothing(tmp_path):
    config = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*SETTINGS, "rounds=2", "strategy.rounds_before_clustering=1")])[0]
    assert config.tracking == "none"
    run_in_process(config, tmp_path / "run")
    assert not (tmp_path / "run" / TRACKING_FILE).exists() and not (tmp_path / "run" / "tensorboard").exists()


@pytest.mark.parametrize("backend", ["tensorboard", "mlflow"])
def test_a_missing_package_is_one_config_error_naming_the_key_and_the_extra(backend, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name == backend else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        run_in_process(tracked_config(backend), tmp_path / "run")
    message = str(caught.value)
    assert message.startswith("tracking: ") and "\n" not in message
    assert f"pip install 'fedcluster-flwr[{backend}]'" in message
    assert not (tmp_path / "run").exists()  # refused before anything is written


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@needs_tensorboard
def test_tensorboard_holds_every_numeric_field_of_every_round_and_one_run_across_a_resume(tmp_path):
    config = tracked_config("tensorboard")
    run_dir = tmp_path / "run"
    run_in_process(config, run_dir, stop_after=2)
    first = json.loads((run_dir / TRACKING_FILE).read_text())
    run_in_process(config, run_dir, resume=True)
    assert json.loads((run_dir / TRACKING_FILE).read_text())["run_id"] == first["run_id"]

    logged = tensorboard_scalars(run_dir)
    expected = expected_metrics(run_dir)
    assert {"mean_client_accuracy", "num_clusters", "purity", "ari", "mean_test_loss", "bytes_up",
            "per_cluster_accuracy/0", "per_true_cluster_accuracy/0"} <= set(expected)
    for name, values in expected.items():
        assert logged[name] == pytest.approx(values, rel=1e-6), name  # float32 in the event files
    summary = read_summary(run_dir)
    assert logged["summary/mean_client_accuracy"] == pytest.approx({4: summary["mean_client_accuracy"]}, rel=1e-6)
    assert logged["summary/bytes_up"] == pytest.approx({4: summary["bytes_up"]}, rel=1e-6)
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # one event file per process that wrote


@needs_tensorboard
def test_tensorboard_purges_the_rounds_a_resume_redoes(tmp_path):
    config = tracked_config("tensorboard")
    run_dir = tmp_path / "run"
    run_in_process(config, run_dir, stop_after=2)
    shutil.copytree(run_dir / "checkpoint", tmp_path / "round2")
    run_in_process(config, run_dir, resume=True)  # rounds 3-4 logged...
    shutil.rmtree(run_dir / "checkpoint")
    shutil.copytree(tmp_path / "round2", run_dir / "checkpoint")  # ...then lost: the last checkpoint is round 2's
    run_in_process(config, run_dir, resume=True)  # rounds 3-4 again

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("mean_client_accuracy")] == [1, 2, 3, 4]  # once each
    assert [e.step for e in events.Scalars("summary/mean_client_accuracy")] == [4]
    assert len(list((run_dir / "tensorboard").iterdir())) == 3


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local MLflow file store in tmp (MLflow 3 refuses one unless MLFLOW_ALLOW_FILE_STORE is set)."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def mlflow_metrics(client, run_id: str) -> dict[str, dict[int, float]]:
    run = client.get_run(run_id)
    return {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in run.data.metrics}


@needs_mlflow
def test_mlflow_holds_every_round_one_run_across_a_resume_and_a_new_linked_run_for_a_branch(tmp_path, mlflow_store):
    config = tracked_config("mlflow")
    run_dir = tmp_path / "run"
    run_in_process(config, run_dir, stop_after=2)
    run_id = json.loads((run_dir / TRACKING_FILE).read_text())["run_id"]
    assert mlflow_store.get_run(run_id).info.status == "RUNNING"
    run_in_process(config, run_dir, resume=True)
    assert json.loads((run_dir / TRACKING_FILE).read_text())["run_id"] == run_id

    finished = mlflow_store.get_run(run_id)
    assert finished.info.status == "FINISHED" and finished.info.run_name == "run"
    assert finished.data.params["strategy.name"] == "flhc" and finished.data.params["tracking"] == "mlflow"
    experiment = mlflow_store.get_experiment_by_name("fedcluster")
    assert [r.info.run_id for r in mlflow_store.search_runs([experiment.experiment_id])] == [run_id]
    logged = mlflow_metrics(mlflow_store, run_id)
    for name, values in expected_metrics(run_dir).items():
        assert logged[name] == pytest.approx(values), name
    summary = read_summary(run_dir)
    assert logged["summary/mean_client_accuracy"] == pytest.approx({4: summary["mean_client_accuracy"]})
    assert logged["summary/num_clusters"] == {4: summary["num_clusters"]}

    # A branch of the run at its round-2 checkpoint... (the run's checkpoint is at 4 now: branch a fresh stop)
    source = tmp_path / "source"
    run_in_process(config, source, stop_after=2)
    source_id = json.loads((source / TRACKING_FILE).read_text())["run_id"]
    branch = tmp_path / "branch"
    branched = tracked_config("mlflow", "client.lr=0.1")
    branch_run(source, branch, config_to_dict(branched), 2, ["client.lr=0.1"])
    run_in_process(branched, branch, resume=True)
    branch_id = json.loads((branch / TRACKING_FILE).read_text())["run_id"]
    assert branch_id not in (source_id, run_id)
    tags = mlflow_store.get_run(branch_id).data.tags
    assert tags["fedcluster.branch_of_run_id"] == source_id and tags["fedcluster.branch_round"] == "2"
    assert sorted(mlflow_metrics(mlflow_store, branch_id)["mean_client_accuracy"]) == [3, 4]
    assert json.loads((source / TRACKING_FILE).read_text())["run_id"] == source_id  # the source keeps its own
    # ...and a resume of the source continues the source's run, not the branch's.
    run_in_process(config, source, resume=True)
    assert sorted(mlflow_metrics(mlflow_store, source_id)["mean_client_accuracy"]) == [1, 2, 3, 4]


@needs_mlflow
def test_a_tracker_failing_mid_run_warns_once_and_the_run_completes(tmp_path, mlflow_store, monkeypatch, caplog):
    config = tracked_config("mlflow")
    calls = []

    def broken(self, metrics, step):
        calls.append(step)
        raise OSError("disk full")

    monkeypatch.setattr(tracking._MLflow, "log", broken)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_in_process(config, tmp_path / "run")
    assert calls == [1]  # dropped after the first failure
    warnings = [r.getMessage() for r in caplog.records if "fedcluster tracking" in r.getMessage()]
    assert len(warnings) == 1 and "disk full" in warnings[0] and "goes on untracked" in warnings[0]
    assert [row["round"] for row in read_rounds(tmp_path / "run")] == [1, 2, 3, 4]
    assert read_summary(tmp_path / "run")["finished"] is True
