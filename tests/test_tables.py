"""A paper table is one command that resumes (benchmarks/tables.py): stopped and run again, it
skips the finished runs, continues the stopped one from its checkpoint, starts the rest, and its
page lists what finished."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override
from fedcluster_flwr.results.recorder import branch_run
from fedcluster_flwr.results.run_files import read_rounds
from fedcluster_flwr.runner import run_experiment

sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import TableRun, advance, run_state, with_engine  # noqa: E402

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



def test_a_run_started_on_the_batched_engine_resumes_on_another(tmp_path):
    """The engine is how rounds execute: a run stopped on `batched` (its config names its workers)
    continues in-process without the batched engine's settings, which no other engine takes."""
    run, root = tiny_runs()[0], tmp_path / "runs"
    run_experiment(with_engine(run.config, "batched", 1), root / run.name, stop_after=1)
    log: list[str] = []
    states = advance([run], runs_root=root, results_dir=tmp_path / "results", engine="inprocess", log=log.append)
    assert states == {run.name: "finished"} and f"{run.name}: resuming from round 1 on inprocess" in log
    engines = [a["engine"] for a in json.loads((root / run.name / "machine.json").read_text())["attempts"]]
    assert engines == ["inprocess"] and "engine: inprocess" in (root / run.name / "config.yaml").read_text()

def test_a_stopped_threshold_sweep_continues_its_base_and_its_branches(tmp_path, monkeypatch, capsys):
    """FL+HC's sweep (benchmarks/flhc/sweep.py) is a table too: a base stopped before the clustering
    round continues from its checkpoint, a branch stopped after it was copied from the base resumes
    from there, the finished branch is not run again, and the page lists every run."""
    spec = importlib.util.spec_from_file_location("flhc_sweep", ROOT / "benchmarks" / "flhc" / "sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    root, results = tmp_path / "runs", tmp_path / "results"
    settings = ["rounds=4", "strategy.rounds_before_clustering=2", "partition.num_clients=8", "partition.num_groups=2",
                "strategy.client_fraction=0.5"]
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in settings])
    run_experiment(config, root / "base", stop_after=1)  # the machine was taken away in the shared rounds

    def sweep_command(*extra: str) -> str:
        argv = ["sweep.py", str(DEFAULT_CONFIG), "--engine", "inprocess", "--runs-dir", str(root), "--results-dir",
                str(results), "--methods", "l1/complete", "--clusters", "2,8", *extra]
        for item in settings:
            argv += ["--set", item]
        monkeypatch.setattr(sys, "argv", argv)
        assert sweep.main() == 0
        return capsys.readouterr().out

    first = sweep_command("--max-runs", "1")
    assert "base: shared rounds 2..2 of 4 on inprocess" in first
    assert [r["round"] for r in read_rounds(root / "base")] == [1, 2]
    cuts = json.loads((results / "thresholds.json").read_text())["methods"]["l1/complete"]["cuts"]
    assert [c["target_clusters"] for c in cuts] == [2, 8] and cuts[1]["clusters"] == 8
    branch = f"l1_complete_{cuts[0]['threshold']:g}"
    assert run_state(root / branch) == "finished" and run_state(root / "singletons") == "new"
    finished_branch = (root / branch / "summary.json").read_text()

    # the second stretch stopped the singletons' branch right after it was copied from the base
    overrides = ["strategy.distance=l1", "strategy.linkage=complete", f"strategy.threshold={cuts[1]['threshold']!r}",
                 "strategy.num_clusters=null"]
    resolved, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in settings + overrides])
    branch_run(root / "base", root / "singletons", config_to_dict(resolved), 2, overrides)
    assert run_state(root / "singletons") == "checkpointed"

    second = sweep_command()
    assert "base: shared rounds" not in second and f"{branch}: " not in second  # neither run again
    assert "singletons: resuming from round 2 on inprocess" in second
    assert "fedavg: starting on inprocess" in second
    assert (root / branch / "summary.json").read_text() == finished_branch
    alone = json.loads((root / "singletons" / "summary.json").read_text())
    assert alone["finished"] and alone["clusters_found"] == 8
    assert read_rounds(root / "singletons")[:2] == read_rounds(root / "base")  # the shared rounds, as the base ran them
    page = (results / "sweep.md").read_text()
    for title in ("l1/complete, K≈2", "every client its own cluster", "fedavg"):
        assert f"| {title} |" in page
    assert {"branch.json", "machine.json", "rounds.jsonl"} <= {p.name for p in (results / "singletons").iterdir()}
    assert (results / "base" / "rounds.jsonl").is_file()


def test_lins_table_extends_a_finished_batched_run_in_process(tmp_path):
    """benchmarks/multimodel/run.py continues a run that finished short of the table's rounds, on the
    engine asked for now: a run made on `batched` (its config names its workers) extends in-process."""
    spec = importlib.util.spec_from_file_location("multimodel_run", ROOT / "benchmarks" / "multimodel" / "run.py")
    multimodel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(multimodel)
    run = tiny_runs()[0]
    run_dir = tmp_path / run.name
    run_experiment(with_engine(dataclasses.replace(run.config, rounds=1), "batched", 1), run_dir)
    multimodel.extend_if_short(run_dir, 2, "inprocess")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["completed_rounds"] == 2
    attempts = json.loads((run_dir / "machine.json").read_text())["attempts"]
    assert [(a["engine"], a["resumed_from_round"]) for a in attempts] == [("inprocess", 1)]
