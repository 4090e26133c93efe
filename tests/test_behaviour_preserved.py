"""Refactors keep behaviour: the shipped strategies' per-round trajectories on a small digits
config with injected failures and a late joiner are bit-identical to the recorded ones
(``tests/fixtures/trajectories.json``; see ``trajectories.py`` for when each was recorded)."""

from __future__ import annotations

import json

import pytest

from trajectories import FIXTURE, STRATEGIES, trajectory


@pytest.mark.parametrize("name", STRATEGIES)
def test_trajectory_is_bit_identical_to_the_recorded_one(name):
    recorded = json.loads(FIXTURE.read_text())[name]
    now = trajectory(name)
    assert now["assignment"] == recorded["assignment"]
    for rnd, (got, expected) in enumerate(zip(now["rounds"], recorded["rounds"], strict=True), start=1):
        assert got == expected, f"{name}, round {rnd}"  # floats compared exactly, not approximately
