"""docs/how-to/own-app.md: a Flower app of one's own (examples/own_app) whose ServerApp, written as
Flower's quickstart writes one, runs a fedcluster strategy with fedcluster's ClientApp. The page
shows the app's files as they are; the app runs on an in-process grid here and, in the slow tier,
with `flwr run` under Flower's simulation."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest
from flwr.app import Context, RecordDict

from conftest import ROOT
from fedcluster_flwr.engines.inprocess import InProcessGrid, partition_node_configs

APP = ROOT / "examples" / "own_app"
PAGE = ROOT / "docs" / "how-to" / "own-app.md"


@pytest.fixture(scope="module")
def own_app():
    sys.path.insert(0, str(APP))
    try:
        yield importlib.import_module("own_app.server_app"), importlib.import_module("own_app.client_app")
    finally:
        sys.path.remove(str(APP))
        for name in [n for n in sys.modules if n == "own_app" or n.startswith("own_app.")]:
            del sys.modules[name]


def test_the_page_shows_the_apps_files_as_they_are():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks[0] == (APP / "own_app" / "server_app.py").read_text()
    assert blocks[1] == (APP / "own_app" / "client_app.py").read_text()
    (toml,) = re.findall(r"```toml\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert toml in (APP / "pyproject.toml").read_text()


def test_the_apps_serverapp_runs_a_fedcluster_strategy_with_fedclusters_clientapp(own_app, tmp_path, capsys):
    server_app, client_app = own_app
    run_config = {"num-server-rounds": 4, "strategy": "flhc", "output-dir": str(tmp_path)}
    grid = InProcessGrid(client_app.app, partition_node_configs(8), run_id=7, run_config=run_config)
    server_app.app(grid, Context(7, 1, {}, RecordDict(), run_config))
    summary = json.loads((tmp_path / "run7" / "summary.json").read_text())
    assert summary["strategy"] == "flhc" and summary["finished"] and summary["completed_rounds"] == 4
    assert summary["fit_failures"] == summary["rejected_updates"] == 0 and summary["clustering_round"] == 3
    printed = capsys.readouterr().out
    assert f"results in {tmp_path / 'run7'}" in printed and "Aggregated ClientApp-side Evaluate Metrics" in printed


@pytest.mark.slow
def test_flwr_run_runs_the_app_under_flowers_simulation(tmp_path):
    from test_deployment import simulation_superlink

    with simulation_superlink(tmp_path) as (flwr, logs):
        run = flwr("run", str(APP), "e2e", "--stream", "--federation-config", "num-supernodes=8",
                   "--run-config", f"num-server-rounds=3 output-dir='{tmp_path / 'out'}'")
        (logs / "run.out").write_text(run.stdout + run.stderr)
        run_id = re.search(r"Successfully started run (\d+)", run.stdout).group(1)
        status = json.dumps(json.loads(flwr("ls", "e2e", "--run-id", run_id, "--format", "json").stdout))
    assert "finished:completed" in status, run.stdout + run.stderr
    summary = json.loads((tmp_path / "out" / f"run{run_id}" / "summary.json").read_text())
    assert summary["strategy"] == "flhc" and summary["finished"] and summary["fit_failures"] == 0
