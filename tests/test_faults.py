"""Fault rates (``faults.drop_rate``, ``faults.nan_rate``, ``faults.seed``): injected by the clients,
refused and counted by the server's existing checks, and the run goes on."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.client import Faults
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.declarations.schema import ConfigError


def test_the_fault_draw_is_a_seeded_function_of_round_and_client_with_the_configured_rates():
    faults = Faults(drop_rate=0.3, nan_rate=0.1, seed=0)
    draws = [faults.draw(rnd, pid) for rnd in range(1, 201) for pid in range(50)]
    assert abs(draws.count("drop") / len(draws) - 0.3) < 0.02
    assert abs(draws.count("nan") / len(draws) - 0.1) < 0.015
    assert draws == [faults.draw(rnd, pid) for rnd in range(1, 201) for pid in range(50)]  # no hidden state
    assert draws != [Faults(0.3, 0.1, seed=1).draw(rnd, pid) for rnd in range(1, 201) for pid in range(50)]
    assert {Faults().draw(rnd, pid) for rnd in range(1, 20) for pid in range(20)} == {None}


@pytest.mark.parametrize(("override", "message"), [
    ("faults.drop_rate=1", r"^faults.drop_rate: must be in \[0, 1\), got 1"),
    ("faults.nan_rate=-0.1", r"^faults.nan_rate: must be in \[0, 1\), got -0.1"),
    ("faults.seed=-1", r"^faults.seed: must be in \[0, 4294967295\]"),
    ("faults.drop_rat=0.1", r"^faults.drop_rat: unknown key \(did you mean 'drop_rate'\?\)"),
])
def test_fault_options_are_checked_by_their_declared_constraints(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEFAULT_CONFIG, [parse_override(override)])


def test_drop_and_nan_rates_together_must_leave_clients_that_answer():
    with pytest.raises(ConfigError, match=r"^faults.nan_rate: drop_rate \+ nan_rate must be below 1"):
        load_config(DEFAULT_CONFIG, [parse_override("faults.drop_rate=0.5"), parse_override("faults.nan_rate=0.5")])


def test_dropped_clients_fail_and_nan_models_are_rejected_by_the_reply_checks_counted_and_not_aggregated(tmp_path):
    """Real ClusterClients through Flower's client wrapper (the in-process driver): each round's
    failures and rejected replies are exactly the clients the fault draw picked, and no NaN reaches
    a model."""
    overrides = ("rounds=3", "strategy.name=fedavg", "strategy.client_fraction=1.0",
                 "faults.drop_rate=0.2", "faults.nan_rate=0.3", "faults.seed=5")
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
    strategy = run_in_process(config, tmp_path / "run")
    faults = Faults(config.faults.drop_rate, config.faults.nan_rate, config.faults.seed)
    rows = strategy.observer.recorder.rows
    assert len(rows) == config.rounds
    for row in rows:
        drawn = [faults.draw(row["round"], pid) for pid in row["fit_clients"]]
        assert row["fit_failures"] == drawn.count("drop") > 0, row["round"]
        assert row["rejected_updates"] == drawn.count("nan") > 0, row["round"]
        assert row["mean_client_accuracy"] > 0.2  # the survivors' average, not NaN
    for model in [*strategy.models.values(), *strategy.client_models.values()]:
        assert all(np.isfinite(layer).all() for layer in model)
