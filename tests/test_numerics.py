"""The numeric-platform fingerprint and how the behaviour fixture is compared with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import trajectories
from conftest import DEFAULT_CONFIG
from fedcluster_flwr.numerics import (
    CAPABILITIES_WITHIN_AVX2,
    PORTABLE_NUMERICS,
    describe_platform,
    is_portable,
    numeric_platform,
    pin_portable_numerics,
    same_numeric_platform,
)


def test_the_fingerprint_names_what_selects_the_kernels():
    here = numeric_platform()
    assert {"machine", "cpu_vendor", "cpu_capability", "torch", "blas", "aten_cpu_capability"} <= set(here)
    assert here["cpu_capability"] in describe_platform(here)


def test_platforms_differing_only_in_the_cpu_model_pick_the_same_kernels():
    here = numeric_platform()
    assert same_numeric_platform(here, here | {"cpu_model": "another model"})
    assert not same_numeric_platform(here, here | {"cpu_capability": "AVX2" if here["cpu_capability"] != "AVX2" else "AVX512"})
    other_pin = "avx512" if here["aten_cpu_capability"] != "avx512" else "avx2"
    assert not same_numeric_platform(here, here | {"aten_cpu_capability": other_pin})


def test_the_fixture_is_compared_bit_for_bit_only_on_its_own_platform():
    recorded = trajectories.load_fixture()["platform"]
    exact, mode = trajectories.comparison_mode(recorded, dict(recorded))
    assert exact and "bit for bit" in mode
    exact, mode = trajectories.comparison_mode(recorded, recorded | {"torch": "0.0.1"})
    assert not exact and "rtol" in mode and "recorded on" in mode


def test_re_recording_some_cases_on_another_platform_is_refused(tmp_path):
    fixture = tmp_path / "fixture.json"
    other = numeric_platform() | {"torch": "0.0.1"}
    fixture.write_text(json.dumps({"platform": other, "trajectories": {}}))
    done = subprocess.run([sys.executable, trajectories.__file__, "--out", str(fixture), "--only", "fedavg"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "re-record all cases (drop --only)" in done.stderr
    assert json.loads(fixture.read_text())["platform"] == other  # left as it was


def test_portable_numerics_pin_the_kernels_of_a_fresh_process_to_avx2_compatible_and_one_thread():
    code = (
        "import json, torch\n"
        "from fedcluster_flwr.config.load import load_config, parse_override\n"
        "from fedcluster_flwr.experiment import Experiment\n"
        "from fedcluster_flwr.numerics import numeric_platform\n"
        f"config, _ = load_config({str(DEFAULT_CONFIG)!r}, [parse_override('simulation.portable_numerics=true')])\n"
        "Experiment(config).client(0, config.partition.num_clients)\n"
        "print(json.dumps(numeric_platform() | {'threads': torch.get_num_threads()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_NUMERICS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    pinned = json.loads(done.stdout.strip().splitlines()[-1])
    assert is_portable(pinned) and pinned["threads"] == 1
    assert pinned["cpu_capability"] in CAPABILITIES_WITHIN_AVX2


def test_portable_numerics_refuse_a_conflicting_environment_and_a_process_that_already_chose(monkeypatch):
    for name in PORTABLE_NUMERICS:  # setenv first: then teardown undoes what the pin writes (delenv of an unset name records nothing)
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    with pytest.raises(ValueError, match="portable numerics set MKL_CBWR=COMPATIBLE, but the environment sets MKL_CBWR=AVX2"):
        pin_portable_numerics()
    assert "ATEN_CPU_CAPABILITY" not in os.environ  # nothing half-set
    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with pytest.raises(ValueError, match="already runs torch's AVX512 kernels .* start it with ATEN_CPU_CAPABILITY=avx2"):
        pin_portable_numerics()


def test_a_portable_platform_matches_across_cpu_vendors_and_an_unpinned_one_does_not():
    here = numeric_platform()
    # the other vendor than this machine's, whichever it is
    other = ({"cpu_vendor": "GenuineIntel", "cpu_model": "Intel(R) Xeon(R) Platinum 8481C"}
             if here.get("cpu_vendor") == "AuthenticAMD" else {"cpu_vendor": "AuthenticAMD", "cpu_model": "AMD EPYC 7B12"})
    pinned = here | {name.lower(): value for name, value in PORTABLE_NUMERICS.items()} | {"cpu_capability": "AVX2"}
    assert same_numeric_platform(pinned, pinned | other)
    assert not same_numeric_platform(here, here | other)
