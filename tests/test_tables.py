"""A paper table is one command that resumes (benchmarks/tables.py): stopped and run again, it
skips the finished runs, continues the stopped one from its checkpoint, starts the rest, and its
page lists what finished."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.runner import run_experiment

sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import TableRun, advance, run_state  # noqa: E402

pytestmark = pytest.mark.slow  # each run is an engine process of its own, as the table commands run them


def tiny_runs() -> list[TableRun]:
    runs = []
    for method, seed in (("fedavg", 0), ("local", 0), ("fedavg", 1)):
        overrides = ("rounds=2", f"strategy.name={method}", f"seed={seed}", "partition.num_clients=4",
                     "partition.num_groups=2")
        config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])
        runs.append(TableRun(f"{method}_seed{seed}", config, {"method": method, "seed": seed}))
    return runs


def test_a_stopped_table_continues_where_it_stopped(tmp_path):
    runs, root, results = tiny_runs(), tmp_path / "runs", tmp_path / "results"
    pages: list[list[str]] = []

    def render() -> None:
        finished = sorted(p.name for p in results.iterdir() if (p / "summary.json").is_file())
        (results / "README.md").write_text("\n".join(finished))
        pages.append(finished)

    results.mkdir()
    log: list[str] = []
    # a first stretch of work: one run, then the machine is taken away during the second, after its
    # round 1 (the state a Ctrl-C leaves: a checkpoint at the last finished round)
    advance(runs, runs_root=root, results_dir=results, engine="inprocess", render=render, max_runs=1, log=log.append)
    run_experiment(runs[1].config, root / runs[1].name, stop_after=1)
    assert [run_state(root / r.name) for r in runs] == ["finished", "checkpointed", "new"]
    first_summary = (root / "fedavg_seed0" / "summary.json").read_text()

    log.clear()
    states = advance(runs, runs_root=root, results_dir=results, engine="inprocess", render=render, log=log.append)
    assert states == {r.name: "finished" for r in runs}
    assert "fedavg_seed0: starting on inprocess" not in log  # the finished run was not run again
    assert "local_seed0: resuming from round 1 on inprocess" in log
    assert "fedavg_seed1: starting on inprocess" in log
    assert (root / "fedavg_seed0" / "summary.json").read_text() == first_summary
    rows = [json.loads(line)["round"] for line in (results / "local_seed0" / "rounds.jsonl").read_text().splitlines()]
    assert rows == [1, 2]  # the resumed run's rows, copied into the repository's results
    assert pages[-1] == ["fedavg_seed0", "fedavg_seed1", "local_seed0"]
    assert (results / "README.md").read_text().splitlines() == pages[-1]
    for run in runs:
        assert {"summary.json", "rounds.jsonl", "config.yaml", "machine.json"} <= {p.name for p in (results / run.name).iterdir()}


def test_a_folder_stopped_before_its_first_checkpoint_is_set_aside_not_lost(tmp_path):
    runs, root, results = tiny_runs()[:1], tmp_path / "runs", tmp_path / "results"
    (root / runs[0].name).mkdir(parents=True)
    (root / runs[0].name / "rounds.jsonl").write_text("")
    log: list[str] = []
    states = advance(runs, runs_root=root, results_dir=results, engine="inprocess", log=log.append)
    assert states == {runs[0].name: "finished"}
    assert (root / f"{runs[0].name}.incomplete-1" / "rounds.jsonl").is_file()
