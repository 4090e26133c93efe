"""A table whose run folders are gone with their machine keeps its committed copies
(benchmarks/tables.py, ``kept``): a finished copy made with the run's config is never run again, a
copy made with another config stops the command naming the keys, a shorter copy is run again, longer.
No engine runs here: every run this would start is one of the failures."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override

sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import StaleCopyError, TableRun, advance, collapsed_clients, listed_state  # noqa: E402


def table_run(*overrides: str) -> TableRun:
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("strategy.name=fedavg", "rounds=3", "seed=0", *overrides)])
    return TableRun("fedavg_seed0", config)


def commit_copy(results, run: TableRun, *, finished: bool = True, **changed) -> None:
    """What a finished run leaves in the repository: its summary and resolved config (``changed``
    edits top-level keys of the config, as another version of the table would have had them)."""
    folder = results / run.name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"finished": finished, "completed_rounds": 3}))
    (folder / "config.yaml").write_text(yaml.safe_dump(config_to_dict(run.config) | changed))


def must_not_run(*args, **kwargs):
    raise AssertionError("a kept run was started again")


def test_a_finished_copy_is_kept_when_its_run_folder_is_gone(tmp_path, monkeypatch):
    run, results = table_run(), tmp_path / "results"
    commit_copy(results, run)
    config_yaml = (results / run.name / "config.yaml").read_text()
    monkeypatch.setattr("tables.run_experiment", must_not_run)
    log: list[str] = []
    states = advance([run], runs_root=tmp_path / "runs", results_dir=results, engine="inprocess", log=log.append)
    assert states == {run.name: "kept"}
    assert log == [f"{run.name}: kept (finished in {results / run.name}; its run folder is gone)"]
    assert listed_state(run, tmp_path / "runs", results) == "kept"
    assert (results / run.name / "config.yaml").read_text() == config_yaml  # never overwritten


def test_where_a_copy_ran_does_not_matter(tmp_path, monkeypatch):
    """``simulation`` says how rounds executed (engine, workers), not what they computed."""
    run, results = table_run("simulation.engine=batched"), tmp_path / "results"
    commit_copy(results, table_run("simulation.engine=inprocess"))
    monkeypatch.setattr("tables.run_experiment", must_not_run)
    assert advance([run], runs_root=tmp_path / "runs", results_dir=results, engine="ray", log=lambda _: None) == {
        run.name: "kept"}


def test_a_copy_made_with_another_config_stops_the_table_naming_the_key(tmp_path, monkeypatch):
    run, results = table_run("client.lr=0.05"), tmp_path / "results"
    commit_copy(results, table_run("client.lr=0.1"))
    monkeypatch.setattr("tables.run_experiment", must_not_run)
    with pytest.raises(StaleCopyError, match=r"client\.lr: 0\.1 there, 0\.05 now.*move it aside"):
        advance([run], runs_root=tmp_path / "runs", results_dir=results, engine="inprocess", log=lambda _: None)


def test_a_copy_whose_config_no_longer_loads_stops_the_table_naming_the_file(tmp_path, monkeypatch):
    run, results = table_run(), tmp_path / "results"
    commit_copy(results, run, client={"lr": 0.1, "retired_option": 1})
    monkeypatch.setattr("tables.run_experiment", must_not_run)
    with pytest.raises(StaleCopyError, match=r"fedavg_seed0/config.yaml no longer loads \(client.retired_option"):
        advance([run], runs_root=tmp_path / "runs", results_dir=results, engine="inprocess", log=lambda _: None)


def test_a_shorter_copy_is_run_again_longer_and_a_longer_one_is_kept(tmp_path, monkeypatch):
    results = tmp_path / "results"
    commit_copy(results, table_run("rounds=2"))
    started = []
    monkeypatch.setattr("tables.run_experiment", lambda config, run_dir, **_: started.append(config.rounds))
    advance([table_run("rounds=3")], runs_root=tmp_path / "runs", results_dir=results, engine="inprocess",
            log=lambda _: None)
    assert started == [3]
    started.clear()
    advance([table_run("rounds=1")], runs_root=tmp_path / "runs", results_dir=results, engine="inprocess",
            log=lambda _: None)
    assert started == []


def test_an_unfinished_copy_is_not_kept(tmp_path):
    run, results = table_run(), tmp_path / "results"
    commit_copy(results, run, finished=False)
    assert listed_state(run, tmp_path / "runs", results) == "new"


def test_a_copy_made_before_summaries_named_collapsed_clients_is_read_by_the_same_rule(tmp_path):
    run, results = table_run("partition.num_clients=4", "partition.num_groups=2"), tmp_path / "results"
    commit_copy(results, run)
    summary = json.loads((results / run.name / "summary.json").read_text())
    summary["client_accuracy"] = {"0": 0.0, "1": 0.95, "2": 0.9, "3": 0.05}
    (results / run.name / "summary.json").write_text(json.dumps(summary))
    assert collapsed_clients(results / run.name) == [0, 3]
    (results / run.name / "summary.json").write_text(json.dumps(summary | {"clients_no_better_than_majority": [1]}))
    assert collapsed_clients(results / run.name) == [1]  # a summary that names them is read as it is


def test_the_closing_line_counts_a_run_the_other_command_finished_meanwhile(tmp_path, monkeypatch, capsys):
    """Two table commands on one queue: a run skipped as in use that the other command finished
    while this one ran its own counts as finished in the closing line, not as still running."""
    import argparse

    import tables

    run = table_run()
    results = tmp_path / "results"
    commit_copy(results, run)  # what the other command left when it finished the run
    monkeypatch.setattr(tables, "advance", lambda runs, **kwargs: {r.name: tables.IN_USE for r in runs})
    args = argparse.Namespace(runs_dir=tmp_path / "runs", results_dir=results, render=False, list=False,
                              engine="batched", workers=1, only=None, max_runs=None)
    assert tables.main_loop([run], args, "t", results, render=lambda _: None) == 0
    assert capsys.readouterr().out.startswith("1 of 1 runs finished; runs in ")
