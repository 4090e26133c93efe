"""The registry: names are taken once, and families are found by entry point as well as by
``FEDCLUSTER_ALGORITHMS`` (tests/test_toy_family.py runs one found by the variable)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from fedcluster_flwr import registry
from fedcluster_flwr.algorithms.baselines import FedAvg
from fedcluster_flwr.client import train_received_model
from fedcluster_flwr.protocol import TRAIN

FAMILY_DIR = ROOT / "examples" / "toy_family"


def test_a_strategy_name_is_taken_once(monkeypatch):
    monkeypatch.setattr(registry, "STRATEGIES", dict(registry.strategies()))

    class Impostor(FedAvg):
        name = "fedavg"

    with pytest.raises(ValueError, match=r"strategy name 'fedavg' is taken by .*baselines\.strategy\.FedAvg; .*Impostor needs another name"):
        registry.register(Impostor)
    assert registry.register(FedAvg) is FedAvg  # the same class again is no conflict


def test_a_task_is_handled_by_one_function(monkeypatch):
    monkeypatch.setattr(registry, "HANDLERS", dict(registry.HANDLERS))

    def another_train(client, inputs):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=r"task 'train' is handled by fedcluster_flwr\.client\.train_received_model"):
        registry.handles(TRAIN)(another_train)
    assert registry.handles(TRAIN)(train_received_model) is train_received_model
    assert registry.HANDLERS["train"][1] is train_received_model


def run_python(code: str, pythonpath: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != registry.FAMILIES_VARIABLE}
    environment |= {"PYTHONPATH": os.pathsep.join(pythonpath), **env}
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120)


def test_an_installed_family_is_found_by_its_entry_point(tmp_path):
    """An installed distribution's metadata, as pip writes it for
    ``[project.entry-points."fedcluster_flwr.algorithms"] toy = "fedcluster_toy"``."""
    dist_info = tmp_path / "fedcluster_toy-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedcluster-toy\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\ntoy = fedcluster_toy\n")
    done = run_python("from fedcluster_flwr.registry import strategy_class; print(strategy_class('toy').__module__)",
                      [str(tmp_path), str(FAMILY_DIR)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fedcluster_toy"


def test_a_family_that_fails_while_importing_is_one_error_naming_who_named_it(tmp_path):
    (tmp_path / "broken_family.py").write_text("raise RuntimeError('half-written family')\n")
    done = run_python(
        "from fedcluster_flwr.registry import strategies\n"
        "from fedcluster_flwr.declarations.schema import ConfigError\n"
        "try:\n    strategies()\nexcept ConfigError as err:\n    print(err)\n",
        [str(tmp_path)], **{registry.FAMILIES_VARIABLE: "broken_family"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("algorithm family 'broken_family' (named by environment variable "
                                   "FEDCLUSTER_ALGORITHMS) cannot be imported: RuntimeError: half-written family")
