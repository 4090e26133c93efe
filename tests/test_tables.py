"""A paper table is one command that resumes (benchmarks/tables.py): stopped and run again, it
skips the finished runs, continues the stopped one from its checkpoint, starts the rest, and its
page lists what finished."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from conftest import DEFAULT_CONFIG, ROOT
from helpers import load_benchmark
from fedcluster_flwr.config.load import config_to_dict, load_config, parse_override
from fedcluster_flwr.results.recorder import branch_run
from fedcluster_flwr.results.run_files import read_rounds
from fedcluster_flwr.runner import run_experiment

sys.path.insert(0, str(ROOT / "benchmarks"))
import tables  # noqa: E402
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



def hold_in_another_process(folder, claim: bool = False) -> subprocess.Popen:
    """Another process that holds ``folder`` as a run or resume does (``holding``), or with ``claim``
    only claims it, as a run that is still loading its data has; it lets go when killed."""
    take = ("from fedcluster_flwr.results.recorder import claim_run_dir as take; take(folder); hold = None"
            if claim else "from fedcluster_flwr.results.recorder import holding; hold = holding(folder); hold.__enter__()")
    holder = subprocess.Popen(
        [sys.executable, "-c", (f"import sys, time; from pathlib import Path; folder = Path(sys.argv[1]); {take}; "
                                "print('taken', flush=True); time.sleep(120)"), str(folder)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert holder.stdout.readline().strip() == "taken"
    return holder


def test_a_run_another_process_runs_or_starts_is_left_to_it(tmp_path):
    """Two table commands may share a queue: a run whose folder another process holds (running or
    resuming it) or has claimed and not yet checkpointed (starting it) is skipped, neither resumed,
    set aside nor recorded, and the next run goes on; once the other lets go, it is continued."""
    runs, root, results = tiny_runs(), tmp_path / "runs", tmp_path / "results"
    run_experiment(runs[0].config, root / runs[0].name, stop_after=1)
    running = hold_in_another_process(root / runs[0].name)
    starting = hold_in_another_process(root / runs[1].name, claim=True)
    try:
        listed = [tables.listed_state(run, root, results) for run in runs]
        assert listed == ["in use", "in use", "new"]
        before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        log: list[str] = []
        states = advance(runs, runs_root=root, results_dir=results, engine="inprocess", log=log.append)
        assert states == {runs[0].name: "in use", runs[1].name: "in use", runs[2].name: "finished"}
        assert log[0] == f"{runs[0].name}: in use, skipped (another process is running it)"
        assert log[1].startswith(f"{runs[1].name}: in use, skipped (pid {starting.pid} claimed it at ")
        assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and runs[2].name not in p.parts} == before
        assert sorted(p.name for p in root.iterdir()) == sorted(r.name for r in runs)  # nothing set aside
    finally:
        for holder in (running, starting):
            holder.kill()
            holder.wait()
    log.clear()
    states = advance(runs, runs_root=root, results_dir=results, engine="inprocess", log=log.append)
    assert states == {run.name: "finished" for run in runs}
    assert f"{runs[0].name}: resuming from round 1 on inprocess" in log
    assert any(line.startswith(f"{runs[1].name}: set aside {runs[1].name}.incomplete-1") for line in log)  # its claimant died


TWO_COMMANDS = """
import json, sys
sys.path[:0] = [sys.argv[1] + "/benchmarks", sys.argv[1] + "/tests"]
from pathlib import Path
from tables import advance
from test_tables import tiny_runs
log = []
states = advance(tiny_runs(), runs_root=Path(sys.argv[2]), results_dir=Path(sys.argv[3]), engine="inprocess",
                 log=log.append)
print(json.dumps({"states": states, "log": log}))
"""


def test_two_table_commands_on_one_queue_run_each_run_once(tmp_path):
    """Two table commands started together on the same runs: every run finishes, started by one of
    them only (one attempt in its machine.json), nothing is set aside, and each skips what the
    other runs."""
    runs, root, results = tiny_runs(), tmp_path / "runs", tmp_path / "results"
    commands = [subprocess.Popen([sys.executable, "-c", TWO_COMMANDS, str(ROOT), str(root), str(results)],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    outputs = [json.loads(command.communicate(timeout=600)[0].strip().splitlines()[-1]) for command in commands]
    assert all(command.returncode == 0 for command in commands)
    assert sorted(p.name for p in root.iterdir()) == sorted(r.name for r in runs)
    for run in runs:
        assert run_state(root / run.name) == "finished"
        assert len(json.loads((root / run.name / "machine.json").read_text())["attempts"]) == 1
        started = [out for out in outputs if f"{run.name}: starting on inprocess" in out["log"]]
        finished_here = [out for out in outputs if f"{run.name}: starting on inprocess" in out["log"]
                         and out["states"][run.name] == "finished"]
        assert len(finished_here) == 1, (run.name, outputs)
        assert len(started) in (1, 2)  # a second start is a lost claim race: skipped, not run


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
    sweep = load_benchmark("flhc/sweep.py")
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
    multimodel = load_benchmark("multimodel/run.py")
    run = tiny_runs()[0]
    run_dir = tmp_path / run.name
    run_experiment(with_engine(dataclasses.replace(run.config, rounds=1), "batched", 1), run_dir)
    multimodel.extend_if_short(run_dir, 2, "inprocess")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["completed_rounds"] == 2
    attempts = json.loads((run_dir / "machine.json").read_text())["attempts"]
    assert [(a["engine"], a["resumed_from_round"]) for a in attempts] == [("inprocess", 1)]
