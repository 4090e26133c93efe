"""The Flower apps as `flwr run` loads them: run config -> config, run directory, clients; the
ServerApp's main on a grid, the ClientApp on a node's context."""

from __future__ import annotations


import logging

import pytest
from flwr.app import Context, RecordDict
from flwr.common import log
from flwr.common.logger import FLOWER_LOGGER
from ray import cloudpickle

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.apps import client_app
from fedcluster_flwr.apps.client_app import FedclusterClientApp
from fedcluster_flwr.apps.server_app import (
    FLWR_RUN_LOG_FILTER,
    FLWR_RUN_OUTPUT_ROOT,
    RunConfigError,
    app,
    flwr_run_dir,
    flwr_run_notes,
    flwr_run_summary,
    node_states,
    start_flwr_run,
)
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.data.device import NodeConfigError
from fedcluster_flwr.engines.inprocess import InProcessGrid, partition_node_configs
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.results.run_files import format_summary, read_summary


def context(run_config=None, node_config=None) -> Context:
    return Context(run_id=42, node_id=7, node_config=node_config or {}, state=RecordDict(),
                   run_config={"config": "conf/default.yaml", "set": "", **(run_config or {})})


def simulation_grid(run_config, num_clients: int) -> InProcessGrid:
    """What Flower's simulation gives `flwr run`'s ServerApp, without Ray: a grid whose nodes run the
    project's ClientApp (``apps.client_app:app``, which reads the experiment from the run config)."""
    return InProcessGrid(client_app.app, partition_node_configs(num_clients), run_config=context(run_config).run_config)


def test_relative_output_dir_goes_under_the_home_folder_with_the_run_id():
    config, _ = load_config(DEFAULT_CONFIG)
    run_dir = flwr_run_dir(config, 42)
    assert run_dir.parent == FLWR_RUN_OUTPUT_ROOT / "outputs" and run_dir.name.endswith("_flhc_digits_label_swap_run42")


def test_absolute_output_dir_is_kept(tmp_path):
    config, _ = load_config(DEFAULT_CONFIG, [("output_dir", str(tmp_path))])
    assert flwr_run_dir(config, 1).parent == tmp_path


def test_a_misconfigured_flwr_run_fails(caplog, flwr_run_log):
    """An Exception (not SystemExit, which Flower's ServerApp thread swallowed): the run is marked failed."""
    with pytest.raises(RunConfigError, match="^strategy.linkage: ward linkage needs distance l2"):
        app(None, context({"set": "strategy.linkage=ward strategy.distance=l1"}))
    assert "strategy.linkage: ward linkage needs distance l2" in caplog.text


def test_the_flwr_run_server_app_serves_the_run_configs_experiment_on_its_grid(tmp_path, flwr_run_log):
    run_config = {"strategy.name": "oracle", "rounds": 2, "partition.num_clients": 8, "output_dir": str(tmp_path)}
    app(simulation_grid(run_config, 8), context(run_config))
    (run_dir,) = tmp_path.iterdir()
    summary = read_summary(run_dir)
    assert summary["strategy"] == "oracle" and summary["finished"] and summary["completed_rounds"] == 2
    assert summary["fit_failures"] == 0 and (run_dir / "config.yaml").is_file()


def test_the_client_app_builds_the_client_of_its_partition():
    client = FedclusterClientApp().client(context(node_config={"partition-id": 3, "num-partitions": 20}))
    assert client.identity()["partition_id"] == 3


def test_the_client_app_of_fedcluster_run_travels_to_ray_actors_as_its_experiment():
    config, _ = load_config(DEFAULT_CONFIG, [("client.epochs", 2)])
    pickled = cloudpickle.dumps(FedclusterClientApp(Experiment(config)))
    assert b"<locals>" not in pickled and b"functools" not in pickled  # the experiment, not its handlers pickled by value
    loaded = cloudpickle.loads(pickled)
    assert isinstance(loaded, FedclusterClientApp) and loaded.experiment(context()).config == config
    assert {"train.default", "evaluate.default", "query.identify"} <= set(loaded._registered_funcs)  # a working ClientApp


def test_the_client_app_explains_a_missing_node_config():
    with pytest.raises(NodeConfigError, match="--node-config 'partition-id=<i> num-partitions=<n>'"):
        FedclusterClientApp().client(context(node_config={"num-partitions": 20}))


# ---- what a `flwr run` logs: notes, the summary at the end, a config error in one line ----------------


@pytest.fixture
def flwr_run_log():
    """The ServerApp's log filter is process-wide under `flwr run` (the process ends with the run);
    in the test process it is taken off again."""
    yield
    FLOWER_LOGGER.removeFilter(FLWR_RUN_LOG_FILTER)


def test_flwr_run_shows_the_configs_warnings_as_fedcluster_run_does(tmp_path, caplog):
    """3 clients for the default config's 4 label-swap groups: fedcluster run prints a warning,
    and so does the ServerApp's log under flwr run."""
    with caplog.at_level(logging.INFO):
        start_flwr_run(context({"partition.num_clients": 3, "strategy.name": "fedavg", "rounds": 1,
                                "output_dir": str(tmp_path)}))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("fedcluster: partition.num_clients (3) is below the 4 groups") for w in warnings), warnings


def test_flwr_run_names_the_options_it_ignores(tmp_path, caplog):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override("simulation.engine=batched"),
                                             parse_override("simulation.batched_workers=2"),
                                             parse_override("simulation.num_cpus_per_client=2")])
    notes = flwr_run_notes(config)
    # the engine and its options apply: flwr_run_main runs it in Flower's simulation (tests/test_flwr_run_engines.py)
    assert [note.split(" (")[0] for note in notes] == ["simulation.num_cpus_per_client=2.0"]
    assert "client-resources-num-cpus" in notes[0]
    assert flwr_run_notes(load_config(DEFAULT_CONFIG)[0]) == []  # the defaults ask for nothing flwr run drops
    with caplog.at_level(logging.WARNING):
        start_flwr_run(context({"set": "simulation.num_cpus_per_client=2", "strategy.name": "fedavg", "rounds": 1,
                                "output_dir": str(tmp_path)}))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("fedcluster: no effect under flwr run: simulation.num_cpus_per_client=2.0 (")


SMALL_RUN_CONFIG = {"rounds": 2, "partition.num_clients": 8, "strategy.name": "fedavg"}


def test_the_flwr_run_server_app_ends_with_fedcluster_runs_summary(tmp_path, caplog, flwr_run_log):
    run_config = SMALL_RUN_CONFIG | {"output_dir": str(tmp_path)}
    with caplog.at_level(logging.INFO):
        app(simulation_grid(run_config, 8), context(run_config))
    (run_dir,) = tmp_path.iterdir()
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(": mean")[0] for m in messages if m.startswith("fedcluster: round ")] == [
        "fedcluster: round 1", "fedcluster: round 2"]
    expected = format_summary(read_summary(run_dir), run_dir).splitlines()
    assert messages[-len(expected):] == expected and messages[-len(expected) - 1] == "fedcluster: 2 rounds done"


def test_a_config_error_under_flwr_run_is_one_line_and_fails_the_run(caplog, flwr_run_log):
    with pytest.raises(RunConfigError) as raised:  # Flower marks the run failed: `flwr ls` shows finished:failed
        app(None, context({"rounds": "abc"}))
    log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=raised.value)  # as flwr/simulation/app.py does
    log(logging.ERROR, "%s raised an exception", "Simulation", exc_info=ValueError("a bug"))  # any other: kept whole
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["fedcluster configuration error: rounds: expected an integer, got 'abc'",
                                                "Simulation raised an exception"]
    assert errors[0].exc_info is None and isinstance(errors[1].exc_info[1], ValueError)


def test_an_unfinished_flwr_run_says_where_it_stopped(tmp_path):
    (tmp_path / "summary.json").write_text('{"finished": false, "completed_rounds": 3}')
    assert flwr_run_summary(tmp_path) == f"fedcluster: the run stopped after round 3; its results so far are in {tmp_path}"


@pytest.mark.slow
def test_flwr_run_ends_with_the_summary_and_a_config_error_fails_the_run(tmp_path):
    """The real thing: a SuperLink of this test's own (simulation runtime, its FLWR_HOME, stopped at
    the end with everything it started), `flwr run --stream` once with a bad config and once with a
    2-round run that sets an option flwr run ignores."""
    import json
    import re

    from conftest import ROOT
    from test_deployment import simulation_superlink

    out = tmp_path / "out"
    with simulation_superlink(tmp_path) as (flwr, logs):
        def status(output: str) -> str:
            run_id = re.search(r"Successfully started run (\d+)", output).group(1)
            return json.dumps(json.loads(flwr("ls", "e2e", "--run-id", run_id, "--format", "json").stdout))

        run = ("run", str(ROOT), "e2e", "--stream", "--federation-config", "num-supernodes=8", "--run-config")

        bad = flwr(*run, "rounds='abc'")
        (logs / "bad_run.out").write_text(bad.stdout + bad.stderr)  # kept for a look at what the user sees
        assert bad.stdout.count("fedcluster configuration error: rounds: expected an integer, got 'abc'") == 1
        assert "Traceback" not in bad.stdout + bad.stderr
        assert "finished:failed" in status(bad.stdout)
        # flwr 1.42's `flwr run --stream` only streams the log: it exits 0 whatever the run's status.
        # If a Flower release changes that, the README's advice (check `flwr ls`) can be relaxed.
        assert bad.returncode == 0

        good = flwr(*run, f"rounds=2 partition.num_clients=8 strategy.name='fedavg' output_dir='{out}' "
                          "set='simulation.num_cpus_per_client=2'")
        (logs / "good_run.out").write_text(good.stdout + good.stderr)
        assert good.returncode == 0, good.stdout + good.stderr
        (run_dir,) = out.iterdir()
        expected = format_summary(read_summary(run_dir), run_dir).splitlines()
        lines = good.stdout.splitlines()
        assert all(any(line.endswith(summary_line) for line in lines) for summary_line in expected)
        assert "History (" not in good.stdout and "no effect under flwr run: simulation.num_cpus_per_client=2.0" in good.stdout
        assert "finished:completed" in status(good.stdout)


def test_node_states_are_read_on_our_grids_and_nowhere_a_node_keeps_its_own():
    """Which grid shows its nodes' Context.state: ours (in-process), Flower's in-memory one (the Ray
    engine's, where fedcluster noted them) and no other (a deployment: the state stays on the device).
    Every branch runs here, so a name one of them needs is found missing by the fast tier."""
    from flwr.superlink.grid import InMemoryGrid

    assert node_states(object()) is None  # a deployment's grid
    flower_grid = InMemoryGrid.__new__(InMemoryGrid)  # no run: only its type is asked
    assert node_states(flower_grid) is None  # not noting: the grid was not started by fedcluster run
