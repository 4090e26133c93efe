"""`fedcluster compare`, `run --stop-after` and `resume --out` (branches): orchestration and user
mistakes as the command line reports them (the runner's rules are tested directly in test_runner.py,
the runs end to end in test_simulation.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml

from conftest import DEFAULT_CONFIG
from fedcluster_flwr import runner
from fedcluster_flwr.cli import commands, console
from fedcluster_flwr.config.load import config_to_dict
from helpers import finished_looking_run


def test_compare_runs_every_strategy_on_the_same_partition(tmp_path, monkeypatch):
    seen = []

    def fake_run(config, run_dir, **kwargs):
        """Stands in for a simulation: records the config and writes a minimal run directory."""
        seen.append(config)
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
        (run_dir / "rounds.jsonl").write_text(json.dumps({"round": 1, "mean_client_accuracy": 0.5}) + "\n")
        return {"mean_client_accuracy": 0.5, "best_mean_client_accuracy": 0.5, "pct_clients_over_target": 0.0,
                "rounds_to_target": None, "num_clusters": 1, "purity": 1.0, "ari": 1.0, "bytes_up": 0,
                "bytes_down": 0, "wall_seconds": 1.0, "fit_failures": 0, "rejected_updates": 0,
                "per_cluster_accuracy": {}, "target_accuracy": 0.9, "nmi": 1.0}

    monkeypatch.setattr(runner, "run_experiment", fake_run)
    code = console.main(["compare", str(DEFAULT_CONFIG), "--strategies", "fedavg,oracle,flhc", "--out", str(tmp_path)])
    assert code == 0
    assert [c.strategy.name for c in seen] == ["fedavg", "oracle", "flhc"]
    assert len({(c.dataset, c.partition, c.model, c.client, c.seed) for c in seen}) == 1  # same experiment
    table = (tmp_path / "comparison.md").read_text()
    assert all(f"| {name} |" in table for name in ("fedavg", "oracle", "flhc"))
    assert (tmp_path / "comparison.png").stat().st_size > 0


def test_a_branch_copies_the_checkpoint_and_records_where_it_came_from(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, run_dir, **kw: calls.append((config, run_dir, kw)) or {})
    monkeypatch.setattr(commands, "format_summary", lambda summary, run_dir: "")
    base = finished_looking_run(tmp_path / "base")
    code = console.main(["resume", str(base), "--out", str(tmp_path / "branch"), "--set", "strategy.threshold=7.5",
                     "--set", "strategy.linkage=average", "--rounds", "12"])
    assert code == 0
    (config, run_dir, kwargs), = calls
    assert run_dir == tmp_path / "branch" and kwargs["resume_from"] == 3
    assert (config.strategy.options.threshold, config.strategy.options.linkage, config.rounds) == (7.5, "average", 12)
    branch = tmp_path / "branch"
    assert yaml.safe_load((branch / "config.yaml").read_text())["strategy"]["threshold"] == 7.5
    assert (branch / "checkpoint" / "models.npz").read_bytes() == (base / "checkpoint" / "models.npz").read_bytes()
    assert not (branch / "accuracy.png").exists()
    assert json.loads((branch / "summary.json").read_text()) == {"finished": False, "completed_rounds": 3}
    provenance = json.loads((branch / "branch.json").read_text())
    assert provenance == {"source": str(base), "round": 3, "overrides": ["strategy.threshold=7.5", "strategy.linkage=average"],
                          "source_branch": None}
    assert yaml.safe_load((base / "config.yaml").read_text())["strategy"]["threshold"] == 20.0  # the base is untouched


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        (["--set", "strategy.threshold=7.5"], "--set: changed options need --out NEW_DIR"),
        (["--out", "NEW", "--set", "partition.num_clients=10"], "partition.num_clients: a branch continues the checkpoint"),
        (["--out", "NEW", "--set", "seed=3"], "seed: a branch continues the checkpoint"),
        (["--out", "NEW", "--set", "strategy.name=fedavg"], "strategy.name: a branch continues the flhc checkpoint"),
        (["--out", "NEW", "--set", "strategy={name: fedavg}"], "strategy.name: a branch continues the flhc checkpoint"),
        (["--out", "NEW", "--set", "client={epochs: 9}"], "client.batch_size: a branch continues the checkpoint"),
        (["--rounds", "0"], "--rounds: must be >= 1"),
        (["--out", "BASE"], "--out: "),
        (["--out", "NEW", "--set", "strategy.threshold=-1"], "strategy.threshold: must be > 0"),
    ],
)
def test_a_branch_that_cannot_continue_the_checkpoint_is_refused(tmp_path, monkeypatch, capsys, extra, phrase):
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **kw: pytest.fail("must not run"))
    base = finished_looking_run(tmp_path / "base")
    args = [a.replace("NEW", str(tmp_path / "new")).replace("BASE", str(base)) for a in extra]
    assert console.main(["resume", str(base), *args]) == 2
    assert phrase in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_stop_after_must_fall_before_the_last_round(tmp_path, capsys):
    assert console.main(["run", str(DEFAULT_CONFIG), "--stop-after", "30", "--out", str(tmp_path / "x")]) == 2
    assert "--stop-after: must lie after round 0 and before the last round (30), got 30" in capsys.readouterr().err


def test_a_branch_cannot_change_what_the_run_already_acted_on(tmp_path, monkeypatch, capsys):
    """FL+HC's clusters came from its clustering options: once it clustered, a branch keeps them."""
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **kw: pytest.fail("must not run"))
    base = finished_looking_run(tmp_path / "base", done=8)
    (base / "checkpoint" / "state.json").write_text(json.dumps({"format": 2, "round": 8, "strategy": {"clustering": {"round": 6}}, "log": {}}))
    np.savez(base / "checkpoint" / "models.npz", round=np.asarray(8))
    assert console.main(["resume", str(base), "--out", str(tmp_path / "new"), "--set", "strategy.threshold=5"]) == 2
    assert "strategy.threshold: the run already acted on it by round 8" in capsys.readouterr().err
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **kw: {})
    monkeypatch.setattr(commands, "format_summary", lambda summary, run_dir: "")
    assert console.main(["resume", str(base), "--out", str(tmp_path / "new"), "--set", "strategy.client_fraction=0.5"]) == 0


def test_a_bad_cublas_setting_is_reported_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    assert console.main(["run", str(DEFAULT_CONFIG), "--set", "simulation.deterministic=true", "--out", str(tmp_path / "x")]) == 2
    assert "simulation.deterministic: deterministic CUDA kernels need CUBLAS_WORKSPACE_CONFIG" in capsys.readouterr().err


def test_resuming_a_finished_run_asks_for_more_rounds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **kw: pytest.fail("must not run"))
    base = finished_looking_run(tmp_path / "base", done=30)
    assert console.main(["resume", str(base)]) == 2
    assert "--rounds: the checkpoint is at round 30 of 30; pass --rounds N > 30" in capsys.readouterr().err
    assert console.main(["resume", str(base), "--out", str(tmp_path / "new"), "--set", "rounds=30"]) == 2
    assert "error: rounds: the checkpoint is at round 30 of 30" in capsys.readouterr().err


def test_fewer_clients_than_groups_runs_with_a_warning_line(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, run_dir, **kw: ran.append(config) or {})
    monkeypatch.setattr(commands, "format_summary", lambda summary, run_dir: "")
    assert console.main(["run", str(DEFAULT_CONFIG), "--set", "partition.num_clients=3", "--out", str(tmp_path / "x")]) == 0
    assert [c.partition.num_clients for c in ran] == [3]
    err = capsys.readouterr().err
    assert "warning: partition.num_clients (3) is below the 4 groups of partition.num_groups" in err
    assert "error" not in err


TINY = ["--set", "rounds=3", "--set", "partition.num_clients=6", "--set", "partition.num_groups=2",
        "--set", "client.epochs=1", "--set", "seed=1"]


def in_process_runs(monkeypatch, stop_in=None):
    """``runner.run_experiment`` as the in-process driver (real rounds, files and checkpoints, no
    Ray); with ``stop_in``, the run of that strategy stops after round 1 as a Ctrl-C there would."""
    import signal

    from fedcluster_flwr.apps.server_app import run_in_process

    calls = []

    def run(config, run_dir, *, resume_from=0, stop_after=None, **kwargs):
        calls.append((config.strategy.name, resume_from))
        if config.strategy.name == stop_in:
            run_in_process(config, run_dir, resume=resume_from > 0, stop_after=1)
            raise runner.Interrupted(signal.SIGINT, run_dir)
        run_in_process(config, run_dir, resume=resume_from > 0, stop_after=stop_after)
        return json.loads((run_dir / "summary.json").read_text())

    monkeypatch.setattr(runner, "run_experiment", run)
    return calls


def test_an_interrupted_compare_is_completed_by_running_it_again(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    args = ["compare", str(DEFAULT_CONFIG), *TINY, "--strategies", "fedavg,local,oracle", "--out", str(out), "--no-progress"]
    calls = in_process_runs(monkeypatch, stop_in="local")
    assert console.main(args) == 130
    assert calls == [("fedavg", 0), ("local", 0)]
    assert f"run it again with --out {out}" in capsys.readouterr().err
    assert json.loads((out / "fedavg" / "summary.json").read_text())["finished"] is True
    assert json.loads((out / "local" / "summary.json").read_text())["completed_rounds"] == 1
    assert not (out / "oracle").exists() and not (out / "comparison.md").exists()
    fedavg_rows = (out / "fedavg" / "rounds.jsonl").read_text()

    calls = in_process_runs(monkeypatch)
    assert console.main(args) == 0
    assert calls == [("local", 1), ("oracle", 0)]  # fedavg kept, local resumed from its round-1 checkpoint
    assert (out / "fedavg" / "rounds.jsonl").read_text() == fedavg_rows
    for name in ("local", "oracle"):
        rows = [json.loads(line) for line in (out / name / "rounds.jsonl").read_text().splitlines()]
        assert [row["round"] for row in rows] == [1, 2, 3]
    table = (out / "comparison.md").read_text()
    assert all(f"| {name} |" in table for name in ("fedavg", "local", "oracle"))
    assert (out / "comparison.png").stat().st_size > 0
    assert runner.plan_continuation(out / "local", rounds=5).completed_round == 3  # a resumed run's checkpoint is its own

    calls = in_process_runs(monkeypatch)  # once complete, a rerun runs nothing and writes the same table
    assert console.main(args) == 0 and calls == []
    assert (out / "comparison.md").read_text() == table


def test_a_compare_rerun_with_other_options_refuses_the_earlier_results(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    in_process_runs(monkeypatch, stop_in="local")
    base = ["compare", str(DEFAULT_CONFIG), *TINY, "--strategies", "fedavg,local", "--out", str(out), "--no-progress"]
    assert console.main(base) == 130
    calls = in_process_runs(monkeypatch)
    assert console.main([*base, "--set", "client.lr=0.01"]) == 2
    assert f"--out: {out / 'fedavg'} holds a run whose client.lr differs from this comparison's" in capsys.readouterr().err
    assert calls == []


def test_a_stopped_compare_is_completed_on_another_engine(tmp_path, monkeypatch):
    """How the rounds execute is not what the comparison compares: rerun with another engine, the
    stopped strategy resumes there (its config.yaml says so) and the finished one is kept."""
    out = tmp_path / "cmp"
    base = ["compare", str(DEFAULT_CONFIG), *TINY, "--strategies", "fedavg,local", "--out", str(out), "--no-progress"]
    in_process_runs(monkeypatch, stop_in="local")
    assert console.main([*base, "--set", "simulation.engine=inprocess"]) == 130
    calls = in_process_runs(monkeypatch)
    assert console.main([*base, "--set", "simulation.engine=batched"]) == 0
    assert calls == [("local", 1)]
    assert yaml.safe_load((out / "local" / "config.yaml").read_text())["simulation"]["engine"] == "batched"
    assert (out / "comparison.md").is_file()


def test_a_checkpoint_copied_in_from_another_run_is_named_not_the_config(tmp_path):
    """Real checkpoints (written by the in-process driver) carry their round's row digest."""
    from fedcluster_flwr.apps.server_app import run_in_process
    from fedcluster_flwr.config.load import load_config, parse_override
    from fedcluster_flwr.declarations.schema import ConfigError

    def tiny(*extra):
        return load_config(DEFAULT_CONFIG, [parse_override(o) for o in TINY[1::2] + list(extra)])[0]

    mine, other = tmp_path / "mine", tmp_path / "other"
    run_in_process(tiny("strategy.name=fedavg"), mine, stop_after=1)
    run_in_process(tiny("strategy.name=local", "partition.num_clients=4"), other, stop_after=1)
    assert runner.plan_continuation(mine).completed_round == 1  # its own checkpoint belongs to it
    shutil.rmtree(mine / "checkpoint")
    shutil.copytree(other / "checkpoint", mine / "checkpoint")
    with pytest.raises(ConfigError, match=f"^{mine / 'checkpoint'}: belongs to another run"):
        runner.plan_continuation(mine)


def test_version_is_the_one_pyproject_declares(capsys):
    import tomllib

    from conftest import ROOT

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as stop:
        console.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedcluster {declared}"
