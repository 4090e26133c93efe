"""Refactors keep behaviour: the shipped strategies' per-round trajectories on a small digits
config with injected failures and a late joiner equal the recorded ones
(``tests/fixtures/trajectories.json``; see ``trajectories.py`` for when each was recorded).

The fixture is recorded with portable numerics, so on every x86-64 CPU with AVX2 (and the
fixture's torch and BLAS) the comparison is bit for bit; elsewhere discrete values must still be
equal and floats agree to ``FLOAT_RTOL``. The mode is in every message.
"""

from __future__ import annotations

import pytest

from trajectories import STRATEGIES, assert_matches, comparison_mode, compute_in_fresh_process, load_fixture


@pytest.fixture(scope="module")
def now(tmp_path_factory):
    """This checkout's trajectories, computed once in a fresh process (the pins need one)."""
    return compute_in_fresh_process(tmp_path_factory.mktemp("trajectories") / "now.json")


@pytest.mark.parametrize("name", STRATEGIES)
def test_trajectory_matches_the_recorded_one(name, now):
    recorded = load_fixture()
    exact, mode = comparison_mode(recorded["platform"], now["platform"])
    assert_matches(name, now["trajectories"][name], recorded["trajectories"][name], exact, mode)


def test_every_registered_strategy_has_a_recorded_trajectory():
    """The cases follow the registry: a strategy shipped without a recorded trajectory fails here."""
    from trajectories import CASE_STRATEGY

    from fedcluster_flwr.registry import strategies

    covered = {CASE_STRATEGY.get(case, case) for case in STRATEGIES}
    missing = sorted(set(strategies()) - covered)
    assert not missing, f"no trajectory case for {missing}: add one to tests/trajectories.py, record it with --only"
    assert set(load_fixture()["trajectories"]) == set(STRATEGIES)
