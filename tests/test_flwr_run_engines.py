"""``simulation.engine: inprocess`` / ``batched`` under ``flwr run``: the ServerApp's main runs the
engine where the grid is Flower's simulation grid (the same rounds as ``fedcluster run``), and refuses
on a deployment's grid (which would train every client on the server)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from flwr.app import Context, RecordDict
from flwr.common.logger import FLOWER_LOGGER
from flwr.superlink.grid import InMemoryGrid
from flwr.superlink.grid.http_grid import HttpGrid

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import FLWR_RUN_LOG_FILTER, RunConfigError, app, run_in_process, runs_here
from fedcluster_flwr.results.run_files import format_summary, read_rounds, read_summary
from fedcluster_flwr.declarations.schema import ConfigError
from helpers import rows_without_timing

SMALL = {"rounds": 2, "partition.num_clients": 6, "strategy.name": "fedavg", "set": "strategy.client_fraction=0.5"}


def simulation_grid() -> InMemoryGrid:
    """A grid of Flower's simulation type (the engine never talks to it: no link state needed)."""
    return InMemoryGrid.__new__(InMemoryGrid)


def deployment_grid() -> HttpGrid:
    """A grid of a deployment's type (flwr 1.42: the ServerApp's HttpGrid to the SuperLink), unconnected."""
    return HttpGrid.__new__(HttpGrid)


def context(run_config) -> Context:
    return Context(run_id=42, node_id=0, node_config={}, state=RecordDict(),
                   run_config={"config": "conf/default.yaml", "set": "", **run_config})


@pytest.fixture
def flwr_run_log():
    yield
    FLOWER_LOGGER.removeFilter(FLWR_RUN_LOG_FILTER)


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_the_engine_runs_in_the_serverapp_on_the_simulations_grid_only(engine):
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(f"simulation.engine={engine}")])
    assert runs_here(simulation_grid(), config)
    with pytest.raises(ConfigError, match=rf"^simulation.engine: '{engine}' runs every client inside the ServerApp.*"
                                          r"a HttpGrid \(a deployment\).*use simulation.engine ray"):
        runs_here(deployment_grid(), config)
    ray, _ = load_config(DEFAULT_CONFIG)
    assert not runs_here(simulation_grid(), ray) and not runs_here(deployment_grid(), ray)


def test_a_deployment_refuses_the_in_process_engine_in_one_line_before_writing_anything(tmp_path, caplog, flwr_run_log):
    run_config = SMALL | {"output_dir": str(tmp_path), "set": SMALL["set"] + " simulation.engine=batched"}
    with pytest.raises(RunConfigError, match="^simulation.engine: 'batched' runs every client inside the ServerApp"):
        app(deployment_grid(), context(run_config))  # Flower marks the run failed
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("fedcluster configuration error: simulation.engine: 'batched'")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_on_the_simulations_grid_the_serverapp_gives_fedcluster_runs_rounds(tmp_path, caplog, flwr_run_log, engine):
    run_config = SMALL | {"output_dir": str(tmp_path / "flwr"), "set": SMALL["set"] + f" simulation.engine={engine}"}
    with caplog.at_level(logging.INFO):
        app(simulation_grid(), context(run_config))
    messages = [r.getMessage() for r in caplog.records]
    (run_dir,) = (tmp_path / "flwr").iterdir()
    assert run_dir.name.endswith("_fedavg_digits_label_swap_run42")
    assert [m for m in messages if m.startswith("[ROUND ")] == ["[ROUND 1/2]", "[ROUND 2/2]"]
    assert [m.split(": mean")[0] for m in messages if m.startswith("fedcluster: round ")] == [
        "fedcluster: round 1", "fedcluster: round 2"]
    expected = format_summary(read_summary(run_dir), run_dir).splitlines()
    assert messages[-len(expected):] == expected  # the lifespan's summary, as on the Ray path
    config, _ = load_config(DEFAULT_CONFIG, [("rounds", 2), ("partition.num_clients", 6), ("strategy.name", "fedavg"),
                                             *map(parse_override, run_config["set"].split())])
    run_in_process(config, tmp_path / "direct")  # what fedcluster run does with this engine
    assert len(read_rounds(run_dir)) == 2
    assert rows_without_timing(read_rounds(run_dir)) == rows_without_timing(read_rounds(tmp_path / "direct"))


@pytest.mark.slow
def test_flwr_run_with_the_batched_engine_gives_fedcluster_runs_rounds(tmp_path):
    """The real thing: a SuperLink of this test's own (simulation runtime, its FLWR_HOME), `flwr run
    --stream` of the default conf with simulation.engine=batched, against `fedcluster run` of it."""
    from test_deployment import simulation_superlink

    out = tmp_path / "out"
    with simulation_superlink(tmp_path) as (flwr, logs):
        # one idle Ray actor: client-resources-num-cpus as large as the machine
        run = flwr("run", str(ROOT), "e2e", "--stream", "--federation-config",
                   f"num-supernodes=20 client-resources-num-cpus={os.cpu_count()}", "--run-config",
                   f"output_dir='{out / 'flwr'}' set='simulation.engine=batched'")
        (logs / "run.out").write_text(run.stdout + run.stderr)
        run_id = re.search(r"Successfully started run (\d+)", run.stdout).group(1)
        status = json.dumps(json.loads(flwr("ls", "e2e", "--run-id", run_id, "--format", "json").stdout))
        assert "finished:completed" in status, run.stdout + run.stderr
        assert "fedcluster: round 30: mean client accuracy" in run.stdout and "Traceback" not in run.stdout
    direct = subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", "run", str(DEFAULT_CONFIG), "--out",
                             str(out / "direct"), "--set", "simulation.engine=batched", "--no-progress"],
                            capture_output=True, text=True, timeout=540)
    assert direct.returncode == 0, direct.stderr
    (flwr_dir,) = (out / "flwr").iterdir()
    assert len(read_rounds(flwr_dir)) == 30
    assert rows_without_timing(read_rounds(flwr_dir)) == rows_without_timing(read_rounds(out / "direct"))
    lines = run.stdout.splitlines()
    assert all(any(line.endswith(summary) for line in lines) for summary in format_summary(read_summary(flwr_dir), flwr_dir).splitlines())


def test_under_flwr_run_batched_actors_are_named_as_without_effect_and_no_actor_starts(tmp_path, caplog, flwr_run_log,
                                                                                        monkeypatch):
    """Flower's simulation runtime owns Ray there: the ServerApp runs the batched clients itself."""
    from fedcluster_flwr.apps import server_app

    monkeypatch.setattr(server_app, "sharded_grid", lambda *a, **kw: pytest.fail("a sharded grid under flwr run"))
    run_config = SMALL | {"output_dir": str(tmp_path), "set": SMALL["set"] + " simulation.engine=batched "
                                                                             "simulation.batched_actors=2"}
    with caplog.at_level(logging.INFO):
        app(simulation_grid(), context(run_config))
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("fedcluster: no effect under flwr run: simulation.batched_actors=2 (") for m in messages)
    (run_dir,) = tmp_path.iterdir()
    assert len(read_rounds(run_dir)) == 2
