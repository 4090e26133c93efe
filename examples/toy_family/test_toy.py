"""The toy family's own test, written as a package outside fedcluster-flwr writes one: with the
public API only (no test helper of the project). Run from this folder:

    PYTHONPATH=. FEDCLUSTER_ALGORITHMS=fedcluster_toy python -m pytest test_toy.py
"""

from pathlib import Path

import numpy as np

from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.config.load import load_config

CONF = Path(__file__).with_name("toy.yaml")


def test_server_momentum_learns_and_reports_its_velocity(tmp_path):
    config, _ = load_config(CONF, [("rounds", 4)])
    strategy = run_in_process(config, tmp_path / "run")  # the strategy, as the run left it
    rows = strategy.observer.recorder.rows  # rounds.jsonl's rows
    assert rows[-1]["mean_client_accuracy"] > rows[0]["mean_client_accuracy"]
    assert all(r["fit_failures"] == r["rejected_updates"] == 0 for r in rows)
    assert all(r["velocity_norm"] > 0 for r in rows)  # the family's own round metric


def test_a_stopped_run_resumes_to_the_same_model(tmp_path):
    config, _ = load_config(CONF, [("rounds", 4)])
    whole = run_in_process(config, tmp_path / "whole")
    run_in_process(config, tmp_path / "stopped", stop_after=2)
    resumed = run_in_process(config, tmp_path / "stopped", resume=True)
    assert all(np.array_equal(a, b) for a, b in zip(resumed.models[0], whole.models[0]))
