"""Refactors keep behaviour: the shipped strategies' per-round trajectories on a small digits
config with injected failures and a late joiner equal the recorded ones
(``tests/fixtures/trajectories.json``; see ``trajectories.py`` for when each was recorded).

On the numeric platform the fixture was recorded on, the comparison is bit for bit. Elsewhere
(another instruction set, BLAS or CPU vendor adds in another order) discrete values must still be
equal and floats agree to ``FLOAT_RTOL``; the mode is in pytest's header and in every message.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedcluster_flwr.numerics import describe_platform, numeric_platform, same_numeric_platform
from trajectories import DISCRETE_KEYS, FIXTURE, FLOAT_KEYS, FLOAT_RTOL, STRATEGIES, load_fixture, trajectory


def comparison_mode() -> tuple[bool, str]:
    """(exact?, a sentence saying which comparison runs and why)."""
    recorded = load_fixture()["platform"]
    here = numeric_platform()
    if same_numeric_platform(recorded, here):
        return True, f"bit for bit (this platform is the fixture's: {describe_platform(here)})"
    return False, (
        f"discrete values exact, floats to rtol {FLOAT_RTOL:g}: {FIXTURE.name} was recorded on "
        f"{describe_platform(recorded)}, this is {describe_platform(here)}"
    )


@pytest.mark.parametrize("name", STRATEGIES)
def test_trajectory_matches_the_recorded_one(name):
    recorded = load_fixture()["trajectories"][name]
    exact, mode = comparison_mode()
    now = trajectory(name)
    assert now["assignment"] == recorded["assignment"], f"{name}: final assignment differs ({mode})"
    for rnd, (got, expected) in enumerate(zip(now["rounds"], recorded["rounds"], strict=True), start=1):
        where = f"{name}, round {rnd} ({mode})"
        if exact:
            assert got == expected, where  # floats compared exactly, not approximately
            continue
        assert {k: got[k] for k in DISCRETE_KEYS} == {k: expected[k] for k in DISCRETE_KEYS}, where
        np.testing.assert_allclose(
            [got[k] for k in FLOAT_KEYS], [expected[k] for k in FLOAT_KEYS], rtol=FLOAT_RTOL, atol=0, err_msg=where
        )
