"""The numeric-platform fingerprint and how the behaviour fixture is compared with it."""

from __future__ import annotations

import json

import pytest

import test_behaviour_preserved
import trajectories
from fedcluster_flwr.numerics import describe_platform, numeric_platform, same_numeric_platform


def test_the_fingerprint_names_what_selects_the_kernels():
    here = numeric_platform()
    assert {"machine", "cpu_vendor", "cpu_capability", "torch", "blas", "aten_cpu_capability"} <= set(here)
    assert here["cpu_capability"] in describe_platform(here)


def test_platforms_differing_only_in_the_cpu_model_pick_the_same_kernels():
    here = numeric_platform()
    assert same_numeric_platform(here, here | {"cpu_model": "another model"})
    assert not same_numeric_platform(here, here | {"cpu_capability": "AVX2" if here["cpu_capability"] != "AVX2" else "AVX512"})
    assert not same_numeric_platform(here, here | {"aten_cpu_capability": "avx2", "cpu_model": here["cpu_model"]})


def test_the_fixture_is_compared_bit_for_bit_only_on_its_own_platform(monkeypatch):
    recorded = trajectories.load_fixture()["platform"]
    monkeypatch.setattr(test_behaviour_preserved, "numeric_platform", lambda: dict(recorded))
    exact, mode = test_behaviour_preserved.comparison_mode()
    assert exact and "bit for bit" in mode
    monkeypatch.setattr(test_behaviour_preserved, "numeric_platform", lambda: recorded | {"cpu_vendor": "AuthenticAMD"})
    exact, mode = test_behaviour_preserved.comparison_mode()
    assert not exact and "rtol" in mode and "recorded on" in mode


def test_re_recording_some_strategies_on_another_platform_is_refused(tmp_path, monkeypatch):
    fixture = tmp_path / "fixture.json"
    other = numeric_platform() | {"cpu_capability": "SOMETHING_ELSE"}
    fixture.write_text(json.dumps({"platform": other, "trajectories": {}}))
    with pytest.raises(SystemExit, match="re-record all strategies"):
        trajectories.record(fixture, only=["fedavg"])
