"""benchmarks/common.py's run_or_reuse, on which every benchmark's cells run: a finished cell is
reused, a stopped one continues from its checkpoint (the rounds an uninterrupted run gives), and a
stopped run of another experiment in the cell's folder is refused, naming what differs."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.config.load import load_config, parse_override

TINY = ("strategy.name=fedavg", "rounds=3", "partition.num_clients=6", "partition.num_groups=2", "client.epochs=1", "seed=1",
        "simulation.engine=inprocess")


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
        yield common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def tiny(*extra):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*TINY, *extra)])[0]


def accuracies(run_dir):
    return [row["client_accuracy"] for row in map(json.loads, (run_dir / "rounds.jsonl").read_text().splitlines())]


def test_a_stopped_cell_continues_from_its_checkpoint_to_the_uninterrupted_runs_rounds(tmp_path, common):
    config = tiny()
    run_in_process(config, tmp_path / "stopped", stop_after=1)
    summary = common.run_or_reuse(config, tmp_path / "stopped", "inprocess")
    assert summary["finished"] and summary["completed_rounds"] == 3
    common.run_or_reuse(config, tmp_path / "whole", "inprocess")
    assert accuracies(tmp_path / "stopped") == accuracies(tmp_path / "whole")  # same CPU, same process kind
    again = common.run_or_reuse(config, tmp_path / "stopped", "inprocess")  # finished: reused, nothing run
    assert again == summary


def test_a_stopped_run_of_another_experiment_is_refused_with_what_differs(tmp_path, common):
    run_in_process(tiny("strategy.name=local"), tmp_path / "cell", stop_after=1)
    before = sorted(p.name for p in (tmp_path / "cell").iterdir())
    with pytest.raises(SystemExit, match=r"cell: a stopped run of another experiment \(its config.yaml differs in "
                                         r"strategy.client_fraction, strategy.name\); delete the folder"):
        common.run_or_reuse(tiny(), tmp_path / "cell", "inprocess")
    assert sorted(p.name for p in (tmp_path / "cell").iterdir()) == before
