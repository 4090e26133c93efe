"""The runner's rules for runs, resumes and branches, checked without starting Ray (the runs
themselves are covered end to end in test_simulation.py; the CLI's messages in test_cli.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import DEFAULT_CONFIG
from helpers import finished_looking_run
from fedcluster_flwr import runner
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.declarations.schema import ConfigError


def config(*overrides: str):
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("dataset.name=mnist", "dataset.name"),
        ("partition.num_groups=2", "partition.num_groups"),
        ("model.name=cnn_digits", "model.name"),
        ("client.lr=0.1", "client.lr"),
        ("seed=3", "seed"),
        ("strategy.name=fedavg", "strategy.name"),
    ],
)
def test_a_branch_cannot_change_what_produced_the_checkpoint(tmp_path, change, key):
    base = finished_looking_run(tmp_path / "base")
    with pytest.raises(ConfigError, match=rf"^{key}: a branch continues the (flhc )?checkpoint of RUN_DIR"):
        runner.plan_continuation(base, out=tmp_path / "new", overrides=[change])
    assert not (tmp_path / "new").exists()


def test_planning_a_continuation_changes_nothing_and_says_what_will_run(tmp_path):
    base = finished_looking_run(tmp_path / "base")
    before = sorted((p, p.read_bytes()) for p in base.rglob("*") if p.is_file())
    resume = runner.plan_continuation(base, rounds=12)
    branch = runner.plan_continuation(base, out=tmp_path / "new", overrides=["strategy.threshold=7.5"])
    assert sorted((p, p.read_bytes()) for p in base.rglob("*") if p.is_file()) == before
    assert not (tmp_path / "new").exists()
    assert (resume.run_dir, resume.is_branch, resume.config.rounds, resume.completed_round) == (base, False, 12, 3)
    assert resume.extended and not branch.extended
    assert (branch.run_dir, branch.is_branch, branch.overrides) == (tmp_path / "new", True, ("strategy.threshold=7.5",))
    assert branch.config.strategy.options.threshold == 7.5 and branch.config.rounds == 30


def test_resuming_with_more_rounds_records_them_in_the_runs_config(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, run_dir, **kw: calls.append((run_dir, kw)) or {})
    base = finished_looking_run(tmp_path / "base", done=30)
    progress = object()
    runner.continue_run(runner.plan_continuation(base, rounds=40), progress=progress)
    assert yaml.safe_load((base / "config.yaml").read_text())["rounds"] == 40
    assert calls == [(base, {"progress": progress, "verbose": False, "resume_from": 30})]


@pytest.mark.parametrize(
    ("strategy", "state", "change", "refused"),
    [
        ("ifca", {}, "strategy.num_clusters=2", True),  # the K models exist from round 1
        ("ifca", {}, "strategy.client_fraction=0.5", False),
        ("oneshot_hfl", {"clustered": True}, "strategy.num_eigenvectors=3", True),
        ("oneshot_hfl", {"clustered": False}, "strategy.num_eigenvectors=3", False),
        ("flhc", {"clustering": None}, "strategy.threshold=5", False),  # not clustered yet
        ("dac", {}, "strategy.tau=5", False),
    ],
)
def test_each_strategy_names_the_options_its_checkpoint_already_used(strategy, state, change, refused):
    base = [("strategy.name", strategy), ("strategy.threshold", None), ("strategy.num_clusters", 4)]
    if strategy == "flhc":
        base = [("strategy.threshold", 20.0)]
    before, _ = load_config(DEFAULT_CONFIG, base)
    after, _ = load_config(DEFAULT_CONFIG, base + [parse_override(change)])
    if refused:
        with pytest.raises(ConfigError, match=rf"{change.split('=')[0]}: the run already acted on it by round 4"):
            runner.check_branch(before, after, {"round": 4, "strategy": state})
    else:
        runner.check_branch(before, after, {"round": 4, "strategy": state})


class RecordedProgress:
    def __init__(self):
        self.calls = []

    def start(self, config, run_dir, completed_round, last_round):
        self.calls.append(("start", completed_round, last_round))

    def round_done(self, row):
        self.calls.append(("round", row["round"]))

    def close(self):
        self.calls.append(("close",))


def test_a_run_that_ends_early_is_a_failure_and_its_progress_is_closed(tmp_path, monkeypatch):
    """Stands in for the simulation engine: it 'ran' 2 of 8 rounds (a crashed ServerApp, say)."""

    def two_rounds(job, progress):
        (tmp_path / "run").mkdir(exist_ok=True)  # claimed by the preflight
        (tmp_path / "run" / "summary.json").write_text(json.dumps({"completed_rounds": 2}))

    monkeypatch.setattr(runner, "_run_in_own_process", two_rounds)
    progress = RecordedProgress()
    with pytest.raises(runner.RunFailed, match=r"^the run stopped after 2 of 8 rounds; partial results in "):
        runner.run_experiment(config("rounds=8"), tmp_path / "run", progress=progress)
    assert progress.calls == [("start", 0, 8), ("close",)]


def test_stop_after_must_fall_between_the_checkpoint_and_the_last_round(tmp_path):
    for resume_from, stop_after in ((0, 30), (0, 0), (5, 5)):
        with pytest.raises(ConfigError, match=rf"--stop-after: must lie after round {resume_from} and before"):
            runner.run_experiment(config(), tmp_path / "x", resume_from=resume_from, stop_after=stop_after)
    assert not (tmp_path / "x").exists()


def test_a_used_results_directory_is_refused(tmp_path):
    (tmp_path / "earlier.txt").write_text("")
    with pytest.raises(ConfigError, match="--out: .* already holds files"):
        runner.preflight(config(), tmp_path)
    runner.preflight(config(), tmp_path, resuming=True)


@pytest.mark.parametrize("process", ["driver", "client"])
def test_the_driver_and_every_client_refuse_a_torch_setting_alike(tmp_path, monkeypatch, process):
    """One check (experiment.configure_torch), one message: before Ray starts and in each client."""

    def start(config):
        if process == "driver":
            runner.preflight(config, tmp_path / "run")
        else:
            Experiment(config).client(0, config.partition.num_clients)

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # refused before any process-wide switch is set
    with pytest.raises(ConfigError, match=r"^simulation\.deterministic: deterministic CUDA kernels need "
                                          r"CUBLAS_WORKSPACE_CONFIG=:4096:8 .* ':0:0'"):
        start(config("simulation.deterministic=true", "client.device=cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^client\.device: is 'cuda' but this machine has no CUDA GPU"):
            start(config("client.device=cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_a_driver_joining_a_ray_cluster_leaves_the_gpu_check_to_the_clients(tmp_path, monkeypatch):
    """The cluster's workers may have GPUs this driver lacks: the driver lets ``cuda`` through,
    and a client on a machine without one refuses it with the same one-line error."""
    monkeypatch.setattr(runner, "check_ray_address", lambda config: None)  # no cluster needed here
    cluster = config("client.device=cuda", "simulation.ray_address=127.0.0.1:6379")
    runner.preflight(cluster, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^client\.device: is 'cuda' but this machine has no CUDA GPU"):
        Experiment(cluster).client(0, cluster.partition.num_clients)


def test_a_run_whose_models_collapsed_says_so(tmp_path):
    """A diverged run (lr 20) ends with every client no better than always answering its most common
    test label: the summary names them and the printout warns; a run that learned names none."""
    from fedcluster_flwr.apps.server_app import run_in_process
    from fedcluster_flwr.results.run_files import format_summary, read_summary

    tiny = ("strategy.name=fedavg", "rounds=2", "partition.num_clients=6", "partition.num_groups=2", "client.epochs=1",
            "seed=0")
    warnings = {}
    for lr in (20, 0.05):
        run_in_process(config(*tiny, f"client.lr={lr}"), tmp_path / str(lr))
        summary = read_summary(tmp_path / str(lr))
        warnings[lr] = [line for line in format_summary(summary, tmp_path).splitlines() if "collapsed" in line]
        if lr == 20:
            assert summary["clients_no_better_than_majority"] == list(range(6))
        else:
            assert summary["clients_no_better_than_majority"] == []
    assert warnings[20] == ["  warning                6 of 6 clients no better than always answering their most common "
                            "test label (what a collapsed model scores): clients_no_better_than_majority in summary.json"]
    assert warnings[0.05] == []


def test_a_client_whose_test_set_holds_one_label_is_never_called_collapsed():
    from fedcluster_flwr.results.round_log import no_better_than_majority

    majority = {0: 0.5, 1: 1.0, 2: 0.2}
    assert no_better_than_majority({0: 0.5, 1: 1.0, 2: 0.9}, majority) == [0]
    assert no_better_than_majority({0: 0.51, 1: 0.0, 2: 0.2}, majority) == [2]


def batched_run(run_dir):
    """A stopped run made on the batched engine with two workers."""
    base = finished_looking_run(run_dir)
    raw = yaml.safe_load((base / "config.yaml").read_text())
    raw["simulation"] |= {"engine": "batched", "batched_workers": 2}
    (base / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return base


def test_a_run_moved_to_another_engine_leaves_that_engines_settings_behind(tmp_path):
    moved = runner.plan_continuation(batched_run(tmp_path / "base"), overrides=["simulation.engine=inprocess"])
    assert (moved.config.simulation.engine, moved.config.simulation.batched_workers) == ("inprocess", None)
    assert moved.notes == ("simulation.batched_workers: 2 dropped (a setting of another engine; the run moves to "
                           "simulation.engine inprocess)",)
    stays = runner.plan_continuation(tmp_path / "base", overrides=["simulation.batched_workers=1"])
    assert (stays.config.simulation.engine, stays.config.simulation.batched_workers, stays.notes) == ("batched", 1, ())


def test_a_ray_run_with_a_round_timeout_moved_in_process_leaves_the_timeout_behind(tmp_path):
    base = finished_looking_run(tmp_path / "base")
    raw = yaml.safe_load((base / "config.yaml").read_text())
    raw["simulation"] |= {"engine": "ray", "round_timeout_s": 60}
    (base / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    moved = runner.plan_continuation(base, overrides=["simulation.engine=batched"])
    assert (moved.config.simulation.engine, moved.config.simulation.round_timeout_s) == ("batched", None)
    assert moved.notes == ("simulation.round_timeout_s: 60.0 dropped (a setting of another engine; the run moves to "
                           "simulation.engine batched)",)
    with pytest.raises(ConfigError, match=r"simulation.round_timeout_s: only simulation.engine ray waits for replies "
                                          r"\(engine is inprocess\)"):
        runner.plan_continuation(base, out=tmp_path / "branch",
                                 overrides=["simulation.engine=inprocess", "simulation.round_timeout_s=5"])


def test_an_engine_setting_the_user_typed_for_another_engine_is_still_an_error(tmp_path):
    with pytest.raises(ConfigError, match="simulation.batched_workers") as err:
        runner.plan_continuation(batched_run(tmp_path / "base"),
                                 overrides=["simulation.engine=inprocess", "simulation.batched_workers=3"])
    assert "only engine batched takes batched_workers (engine is inprocess)" in str(err.value)
