"""A method added from outside the package, as docs/how-to/add-algorithm.md says: one package
(examples/toy_family/fedcluster_toy), one conf, this test, no file of fedcluster_flwr touched. The
family is found by name (``FEDCLUSTER_ALGORITHMS``), selected with ``--set strategy.name=toy``,
stopped, resumed bit for bit, and its options are checked like a shipped family's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from conftest import ROOT

FAMILY_DIR = ROOT / "examples" / "toy_family"
CONF = FAMILY_DIR / "toy.yaml"


def fedcluster(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(FAMILY_DIR), "FEDCLUSTER_ALGORITHMS": "fedcluster_toy"}
    return subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", *args, "--set", f"output_dir={out}"]
                          if args[0] == "run" else [sys.executable, "-m", "fedcluster_flwr.cli", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def only_run(folder: Path) -> Path:
    (run_dir,) = folder.iterdir()
    return run_dir


def test_a_family_from_outside_the_package_runs_by_name_and_resumes_bit_for_bit(tmp_path):
    # the conf says strategy.name: toy; --set says it again, as a user choosing it would
    whole = fedcluster("run", str(CONF), "--set", "strategy.name=toy", out=tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    stopped = fedcluster("run", str(CONF), "--set", "strategy.name=toy", "--stop-after", "3", out=tmp_path / "stopped")
    assert stopped.returncode == 0, stopped.stderr
    resumed = fedcluster("resume", str(only_run(tmp_path / "stopped")), out=tmp_path)
    assert resumed.returncode == 0, resumed.stderr

    whole_dir, resumed_dir = only_run(tmp_path / "whole"), only_run(tmp_path / "stopped")
    assert rows(resumed_dir) == rows(whole_dir)
    assert len(rows(whole_dir)) == 6 and {r["phase"] for r in rows(whole_dir)} == {"toy"}
    velocity = [r["velocity_norm"] for r in rows(whole_dir)]
    assert all(v > 0 for v in velocity)  # the family's own round metric, from its own state
    summary = json.loads((whole_dir / "summary.json").read_text())
    assert summary["strategy"] == "toy" and summary["finished"] is True
    assert summary["mean_client_accuracy"] > 0.3  # it learns: chance on 10 digits is 0.1
    with np.load(resumed_dir / "checkpoint" / "models.npz") as resumed_arrays, \
            np.load(whole_dir / "checkpoint" / "models.npz") as whole_arrays:
        assert sorted(resumed_arrays.files) == sorted(whole_arrays.files)
        for name in whole_arrays.files:  # the velocity included: the family's state_dict
            np.testing.assert_array_equal(resumed_arrays[name], whole_arrays[name])


def test_the_outside_familys_declared_options_name_the_key():
    code = (
        "from fedcluster_flwr.config.load import load_config, parse_override\n"
        "from fedcluster_flwr.declarations.schema import ConfigError\n"
        "for setting in ('strategy.server_momentum=1.5', 'strategy.server_lr=0'):\n"
        "    try:\n"
        f"        load_config({str(CONF)!r}, [parse_override(setting)])\n"
        "    except ConfigError as err:\n"
        "        print(err)\n"
    )
    env = os.environ | {"PYTHONPATH": str(FAMILY_DIR), "FEDCLUSTER_ALGORITHMS": "fedcluster_toy"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    momentum, lr = done.stdout.splitlines()
    assert momentum.startswith("strategy.server_momentum: must be in [0, 1), got 1.5")
    assert lr.startswith("strategy.server_lr: must be > 0, got 0")


def test_without_the_family_the_name_is_unknown_and_the_error_says_which_names_are_known(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FEDCLUSTER_ALGORITHMS"}
    done = subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", "run", str(CONF), "--set", f"output_dir={tmp_path}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "strategy.name" in done.stderr and "'toy'" in done.stderr and "fedavg" in done.stderr


def test_a_family_that_cannot_be_imported_is_named_with_the_variable_that_named_it(tmp_path):
    env = os.environ | {"FEDCLUSTER_ALGORITHMS": "no_such_family"}
    done = subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", "run", str(CONF), "--set", f"output_dir={tmp_path}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "algorithm family 'no_such_family' (named by environment variable FEDCLUSTER_ALGORITHMS)" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_familys_own_test_passes_with_the_public_api_only():
    """examples/toy_family/test_toy.py, the add-algorithm page's outside test, run as its folder runs it."""
    env = os.environ | {"PYTHONPATH": str(FAMILY_DIR), "FEDCLUSTER_ALGORITHMS": "fedcluster_toy"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_toy.py"],
                          cwd=FAMILY_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
