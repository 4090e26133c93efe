"""End-to-end runs through Flower's Ray simulation engine on the bundled digits data."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.runner import continue_run, plan_continuation, run_experiment
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.numerics import is_portable
from fedcluster_flwr.results.run_files import read_rounds

pytestmark = pytest.mark.slow


def run(tmp_path, name, *overrides, engine="ray"):
    """(summary, run folder) of the default config with ``overrides`` (20 rounds unless given),
    through Flower's Ray engine or, for a reference run the test compares the engine against,
    the in-process driver: the same rounds bit for bit
    (test_the_in_process_driver_reproduces_the_ray_engine_bit_for_bit), without Ray's ~25 s start."""
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in ("rounds=20", *overrides)])
    if engine == "inprocess":
        run_in_process(config, tmp_path / name)
        return json.loads((tmp_path / name / "summary.json").read_text()), tmp_path / name
    return run_experiment(config, tmp_path / name), tmp_path / name


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", *args], capture_output=True, text=True,
                          timeout=900, cwd=DEFAULT_CONFIG.parent.parent)


@pytest.fixture(scope="module")
def label_swap_runs(tmp_path_factory):
    """FedAvg (in-process) and FL+HC (through `fedcluster run`) on the default label-swap config."""
    tmp_path = tmp_path_factory.mktemp("label_swap")
    runs = {"fedavg": run(tmp_path, "fedavg", "strategy.name=fedavg", engine="inprocess")}
    result = cli("run", str(DEFAULT_CONFIG), "--set", "rounds=20", "--out", str(tmp_path / "flhc"), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    runs["flhc"] = (json.loads((tmp_path / "flhc" / "summary.json").read_text()), tmp_path / "flhc", result.stdout)
    return runs


def test_fedavg_learns_but_suffers_from_swapped_labels(label_swap_runs):
    summary, _ = label_swap_runs["fedavg"]
    assert summary["finished"] and summary["completed_rounds"] == 20
    assert 0.5 < summary["mean_client_accuracy"] < 0.85  # one model cannot fit 4 labelings
    assert summary["num_clusters"] == 1


def test_flhc_finds_the_groups_and_beats_fedavg(label_swap_runs):
    fedavg, _ = label_swap_runs["fedavg"]
    flhc, run_dir, _ = label_swap_runs["flhc"]
    assert flhc["clusters_found"] == 4
    assert flhc["purity"] == 1.0 and flhc["ari"] == 1.0
    assert flhc["mean_client_accuracy"] > fedavg["mean_client_accuracy"] + 0.10
    rows = read_rounds(run_dir)
    assert [r["phase"] for r in rows].count("clustering") == 1
    assert rows[-1]["num_clusters"] == 4
    for name in ("config.yaml", "rounds.jsonl", "summary.json", "accuracy.png", "clients_over_target.png",
                 "dendrogram.png", "linkage.npy", "checkpoint/models.npz"):
        assert (run_dir / name).is_file(), name


def test_fedcluster_run_prints_the_summary(label_swap_runs):
    summary, run_dir, stdout = label_swap_runs["flhc"]
    assert f"flhc on digits / label_swap (20 clients), 20 rounds -> {run_dir}" in stdout
    assert f"mean client accuracy   {100 * summary['mean_client_accuracy']:.1f} %" in stdout
    assert "clusters               4 (purity 1.00, ARI 1.00, NMI 1.00)" in stdout
    assert f"results                {run_dir}" in stdout


def test_fedcluster_plot_overlays_runs(label_swap_runs, tmp_path):
    dirs = [str(label_swap_runs[name][1]) for name in ("fedavg", "flhc")]
    result = cli("plot", *dirs, "--out", str(tmp_path / "both.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "both.png").stat().st_size > 10_000


def test_resume_refuses_a_finished_run_without_more_rounds(label_swap_runs):
    result = cli("resume", str(label_swap_runs["flhc"][1]))
    assert result.returncode == 2
    assert "--rounds: the checkpoint is at round 20 of 20; pass --rounds N > 20" in result.stderr


def test_a_failing_client_and_a_late_joiner_are_placed_by_training_loss(tmp_path):
    """Client 3 crashes in the clustering round (6); client 17 joins at round 9. Neither kills
    the run or touches a model; both end up in their true group's cluster."""
    summary, run_dir = run(tmp_path, "faults", "rounds=12", "simulation.fail_fit={3: [6]}", "simulation.join_round={17: 9}")
    rows = read_rounds(run_dir)
    assert rows[5]["phase"] == "clustering" and rows[5]["fit_failures"] == 1
    assert rows[5]["unassigned_clients"] == 1  # the failed client (the late joiner is not online yet)
    assert rows[8]["unassigned_clients"] == 0  # round 9: both placed in the round they came online
    assert rows[-1]["unassigned_clients"] == 0
    assignment, true = summary["assignment"], summary["true_clusters"]
    for pid in (3, 17):
        peers = [p for p in range(len(true)) if true[p] == true[pid] and p != pid]
        assert assignment[pid] == assignment[peers[0]], pid
    assert summary["purity"] == 1.0 and summary["fit_failures"] == 1
    json.loads((run_dir / "summary.json").read_text(), parse_constant=pytest.fail)  # strict JSON, no NaN


def test_resume_continues_a_run_exactly(tmp_path):
    """4 rounds, then `fedcluster resume --rounds 6`, equals 6 uninterrupted rounds."""
    settings = ("rounds=6", "strategy.rounds_before_clustering=2", "checkpoint_every=2")
    run(tmp_path, "whole", *settings, engine="inprocess")
    run(tmp_path, "resumed", *settings, "rounds=4")
    result = subprocess.run(
        [sys.executable, "-m", "fedcluster_flwr.cli", "resume", str(tmp_path / "resumed"), "--rounds", "6", "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]

    def metrics(name):
        return [(r["round"], r["phase"], r["mean_client_accuracy"], r["num_clusters"], r["bytes_up"])
                for r in read_rounds(tmp_path / name)]

    assert metrics("resumed") == metrics("whole")
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["finished"] and summary["completed_rounds"] == 6
    assert "rounds: 6" in (tmp_path / "resumed" / "config.yaml").read_text()


def test_branches_of_a_stopped_run_share_its_rounds(tmp_path):
    """`run --stop-after 2` and branches of it (a threshold sweep's shared prefix): the unchanged
    branch equals the uninterrupted run; a branch with a tiny threshold clusters differently
    from the same rounds 1-2."""
    settings = [parse_override(o) for o in ("rounds=5", "strategy.rounds_before_clustering=2")]
    config, _ = load_config(DEFAULT_CONFIG, settings)
    run_in_process(config, tmp_path / "whole")  # the reference (bit for bit the Ray engine's)
    stopped = run_experiment(config, tmp_path / "base", stop_after=2)
    assert not stopped["finished"] and stopped["completed_rounds"] == 2
    continue_run(plan_continuation(tmp_path / "base", out=tmp_path / "same"))
    split = continue_run(plan_continuation(tmp_path / "base", out=tmp_path / "alone", overrides=["strategy.threshold=1e-6"]))

    def metrics(name):
        return [(r["round"], r["phase"], r["mean_client_accuracy"], r["num_clusters"], r["client_accuracy"])
                for r in read_rounds(tmp_path / name)]

    assert metrics("same") == metrics("whole")
    assert metrics("alone")[:2] == metrics("whole")[:2] and metrics("alone")[2:] != metrics("whole")[2:]
    assert split["clusters_found"] == config.partition.num_clients  # every client its own cluster
    assert json.loads((tmp_path / "alone" / "branch.json").read_text())["overrides"] == ["strategy.threshold=1e-6"]
    assert len(read_rounds(tmp_path / "base")) == 2  # the base is left as it stopped


def test_ifca_recovers_disjoint_class_subsets_through_ray(tmp_path):
    """K = 2 cluster models on digits split by class (0-4 vs 5-9): IFCA finds the two groups, and
    every sampled client downloads both models."""
    summary, run_dir = run(
        tmp_path, "ifca", "rounds=8", "strategy.name=ifca", "strategy.num_clusters=2", "strategy.client_fraction=0.5",
        "partition.name=class_subsets", "partition.samples_per_client=70", "partition.subsets=[[0,1,2,3,4],[5,6,7,8,9]]",
    )
    assert summary["finished"] and summary["purity"] == 1.0 and summary["ari"] == 1.0
    assert sorted(summary["cluster_sizes"]) == [10, 10]
    rows = read_rounds(run_dir)
    assert rows[-1]["identity_changes"] == 0 and rows[-1]["identified_clients"] == 20
    assert summary["mean_client_accuracy"] > 0.9
    assert set(summary["per_true_cluster_accuracy"]) == {"0", "1"}
    assert rows[1]["bytes_down"] >= 2 * rows[1]["bytes_up"]  # two models down, one up, per sampled client


def test_oneshot_hfl_recovers_label_group_tasks_through_ray(tmp_path):
    """Two tasks on digits (labels 0-4 vs 5-9, 10 % minority labels): the one-shot rounds
    (gram_eigen, relevance) find the tasks before any training; the GPS shares the hidden layer."""
    summary, run_dir = run(
        tmp_path, "oneshot", "rounds=6", "strategy.name=oneshot_hfl", "strategy.num_clusters=2",
        "strategy.linkage=complete", "strategy.shared_layers=[fc]", "strategy.client_fraction=0.5",
        "partition.name=label_groups", "partition.samples_per_client=70", "partition.groups=[[0,1,2,3,4],[5,6,7,8,9]]",
    )
    assert summary["finished"] and summary["clustering_round"] == 2
    assert summary["purity"] == 1.0 and summary["ari"] == 1.0 and summary["clusters_found"] == 2
    assert summary["relevance_within_true_clusters"] > summary["relevance_across_true_clusters"]
    rows = read_rounds(run_dir)
    assert [r["phase"] for r in rows] == ["gram_eigen", "relevance", "lps", "lps", "lps", "lps"]
    assert rows[0]["bytes_gps"] == 0 and rows[-1]["bytes_gps"] > 0
    assert summary["mean_client_accuracy"] > 0.8
    for name in ("relevance.npy", "similarity.png", "dendrogram.png"):
        assert (run_dir / name).is_file(), name


@pytest.fixture(scope="module")
def rotation_gossip_runs(tmp_path_factory):
    """DAC and random gossip on digits, 15 clients upright and 5 rotated by 180 degrees."""
    tmp_path = tmp_path_factory.mktemp("gossip")
    settings = (
        "rounds=12", "partition.name=rotation", "partition.angles=[0,180]", "partition.cluster_sizes=[15,5]",
        "partition.val_fraction=0.1", "strategy.client_fraction=1.0", "strategy.num_neighbours=3",
        "strategy.same_init=true", "client.optimizer=adam", "client.lr=0.003",
    )
    return {"dac": run(tmp_path, "dac", *settings, "strategy.name=dac"),  # through Ray; the baseline in-process
            "random_gossip": run(tmp_path, "random_gossip", *settings, "strategy.name=random_gossip", engine="inprocess")}


def test_dac_beats_random_gossip_on_the_minority_cluster_through_ray(rotation_gossip_runs):
    (dac, dac_dir), (random, _) = rotation_gossip_runs["dac"], rotation_gossip_runs["random_gossip"]
    minority = "1"  # the 5 rotated clients
    assert dac["per_true_cluster_accuracy"][minority] > random["per_true_cluster_accuracy"][minority] + 0.05
    assert dac["purity"] == 1.0  # the similarity matrix's clusters are the rotations
    communication = np.load(dac_dir / "communication.npy")
    assert communication[15:, 15:].sum() > communication[15:, :15].sum()  # the rotated mostly sample each other
    assert communication.trace() == 0 and communication.sum() == (12 - 1) * 20 * 3  # round 1 pretrains
    rows = read_rounds(dac_dir)
    assert rows[0]["phase"] == "pretrain" and {r["phase"] for r in rows[1:]} == {"dac"}
    assert "mean_best_val_accuracy" in rows[-1] and rows[-1]["tau"] == 30.0
    for name in ("communication.png", "similarity.npy"):
        assert (dac_dir / name).is_file(), name


def test_the_in_process_driver_reproduces_the_ray_engine_bit_for_bit(tmp_path):
    """fedcluster_flwr/engines/inprocess.py (used by the behaviour-preservation test) is a faithful stand-in for
    Flower's Ray engine: FL+HC with failures and a late joiner gives the same rounds in both."""
    from trajectories import KEYS, SETTINGS

    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*SETTINGS, "strategy.name=flhc")])
    in_process = run_in_process(config, tmp_path / "in_process")
    run_experiment(config, tmp_path / "ray")
    ray_rows = read_rounds(tmp_path / "ray")
    assert len(ray_rows) == len(in_process.observer.recorder.rows) == config.rounds
    for ours, theirs in zip(in_process.observer.recorder.rows, ray_rows, strict=True):
        assert {k: ours[k] for k in KEYS} == {k: theirs[k] for k in KEYS}, ours["round"]
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert summary["assignment"] == in_process.assignment.tolist()


def test_portable_numerics_reach_every_process_of_a_ray_run(tmp_path):
    """`fedcluster run` with portable numerics (the driver and every Ray worker pinned) gives the
    behaviour fixture's FL+HC trajectory, recorded in one pinned process: bit for bit on the
    fixture's platform, which on this AVX-512 machine would differ (~1e-8) if any process were unpinned."""
    from trajectories import KEYS, PORTABLE, SETTINGS, assert_matches, comparison_mode, load_fixture

    out = tmp_path / "flhc"
    sets = [item for override in (*SETTINGS, PORTABLE, "strategy.name=flhc") for item in ("--set", override)]
    result = cli("run", str(DEFAULT_CONFIG), *sets, "--out", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    fixture = load_fixture()
    summary = json.loads((out / "summary.json").read_text())
    assert is_portable(summary["numeric_platform"])
    exact, mode = comparison_mode(fixture["platform"], summary["numeric_platform"])
    now = {"rounds": [{k: row[k] for k in KEYS} for row in read_rounds(out)], "assignment": summary["assignment"]}
    assert_matches("flhc through Ray", now, fixture["trajectories"]["flhc"], exact, mode)
