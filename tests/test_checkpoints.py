"""A checkpoint is self-contained: every shipped strategy, stopped after some round and resumed
from ``checkpoint/`` alone (its artifacts deleted), continues bit for bit as the uninterrupted
run, in its rows and in its final ``state_dict()``. Stopping points fall inside each algorithm's
phases (FL+HC clusters in round 4, one-shot HFL in round 2, PENS selects in rounds 2-4, CFL splits in
rounds 3, 4 and 6, PACFL clusters in round 1 and places a late joiner in round 6).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_same_state, rows_without_timing
from trajectories import CASE_STRATEGY, SETTINGS, STRATEGY_OVERRIDES

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.results.checkpoints import load_checkpoint

STOP_AFTER = {
    "oneshot_hfl": 1,  # inside the one-shot phase: eigen-summaries in, relevance rows not yet
    "cfl": 4,  # after CFL's first split (round 3) and its second, with clients 3 and 17 still to place
    "pacfl": 1,  # right after PACFL's one-shot round
}


def case_config(case: str):
    strategy = CASE_STRATEGY.get(case, case)
    overrides = (*SETTINGS, f"strategy.name={strategy}", *STRATEGY_OVERRIDES[case])
    return load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0]


@pytest.mark.parametrize("case", list(STRATEGY_OVERRIDES))
def test_a_resumed_run_continues_bit_for_bit(case, tmp_path):
    config = case_config(case)
    whole = run_in_process(config, tmp_path / "whole")
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    for direction in ("bytes_up", "bytes_down"):  # the per-phase totals split the run's, nothing lost
        assert sum(phase[direction] for phase in summary["bytes_by_phase"].values()) == summary[direction]

    stopped = tmp_path / "stopped"
    run_in_process(config, stopped, stop_after=STOP_AFTER.get(case, 4))
    for artifact in [*stopped.glob("*.npy"), *stopped.glob("*.png")]:
        artifact.unlink()  # the checkpoint alone must carry the state
    resumed = run_in_process(config, stopped, resume=True)

    assert rows_without_timing(resumed.observer.recorder.rows) == rows_without_timing(whole.observer.recorder.rows)
    assert_same_state(resumed.state_dict(), whole.state_dict())
    assert_same_state(load_checkpoint(stopped), load_checkpoint(tmp_path / "whole"), skip=("wall_seconds",))


def test_a_checkpoint_of_the_old_format_is_refused_with_the_reason(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "state.json").write_text('{"round": 3, "strategy": "flhc"}')
    np.savez(folder / "models.npz", round=np.asarray(3))
    with pytest.raises(ValueError, match="checkpoint format 1; this version reads format 2"):
        load_checkpoint(Path(tmp_path))


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_result_files_get_the_mode_the_umask_gives_not_mkstemps_0600(tmp_path, umask, mode):
    import os
    import stat

    from fedcluster_flwr.results.files import atomic_write
    from fedcluster_flwr.results.recorder import RunRecorder

    previous = os.umask(umask)
    try:
        recorder = RunRecorder(tmp_path / "run")
        recorder.start({"seed": 0})
        recorder.log_round({"round": 1})
        recorder.save_checkpoint({"round": 1, "strategy": {"assignment": np.zeros(3)}, "log": {}})
        recorder.write_artifacts({"linkage.npy": np.zeros((2, 4))})
        atomic_write(tmp_path / "run" / "comparison.md", "| x |\n")
    finally:
        os.umask(previous)
    written = sorted(p for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert {p.relative_to(tmp_path / "run").as_posix() for p in written} >= {
        "config.yaml", "rounds.jsonl", "summary.json", "checkpoint/state.json", "checkpoint/models.npz",
        "linkage.npy", "comparison.md"}
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {p.name: oct(mode) for p in written}


def test_a_write_that_fails_leaves_the_former_file_and_no_temporary_file(tmp_path):
    from fedcluster_flwr.results.files import atomic_write, written_aside

    target = tmp_path / "rounds.jsonl"
    atomic_write(target, "former\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with written_aside(target) as handle:
            handle.write("half a ro")
            raise RuntimeError("disk full")
    assert target.read_text() == "former\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rounds.jsonl"]


@pytest.mark.parametrize("case", ["dac"])  # every strategy keeps it the same way (base/model_selection.py)
def test_a_checkpoint_with_the_model_selection_in_the_log_state_resumes_as_one_with_it_in_the_strategys(case, tmp_path):
    """Checkpoints written before the round log became the runner's kept the per-client model
    selection by validation loss (``best_validated``) in the log's state; they resume to the same
    rows as an uninterrupted run."""
    config = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (
        *SETTINGS, f"strategy.name={case}", *STRATEGY_OVERRIDES[case], "partition.val_fraction=0.1")])[0]
    whole = run_in_process(config, tmp_path / "whole")
    stopped = tmp_path / "stopped"
    run_in_process(config, stopped, stop_after=4)
    state_file = stopped / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    state["log"]["best_validated"] = state["strategy"].pop("best_validated")  # as the older version wrote it
    assert state["log"]["best_validated"]
    state_file.write_text(json.dumps(state))
    resumed = run_in_process(config, stopped, resume=True)

    rows = rows_without_timing(whole.observer.recorder.rows)
    assert rows_without_timing(resumed.observer.recorder.rows) == rows
    assert all("mean_best_val_accuracy" in row for row in rows)


# A run folder written by the commit before the Message-API port (legacy Flower API, flat parameter
# lists): FL+HC on the default config, 6 rounds with clustering in round 3, stopped after round 3,
# portable numerics, the inprocess engine. Made with
#   fedcluster run conf/default.yaml --set rounds=6 --set strategy.rounds_before_clustering=2 \
#     --set simulation.engine=inprocess --set simulation.portable_numerics=true --stop-after 3 --out DIR
# at commit 83c5647, on an AMD EPYC (AVX2).
BEFORE_MESSAGE_API = Path(__file__).parent / "fixtures" / "run_before_message_api"


def test_a_run_folder_from_before_the_message_api_resumes_to_the_runs_rounds(tmp_path):
    """Its checkpoint holds the strategy's state only, which the port did not change: resumed by
    today's code it ends as today's uninterrupted run of its config (bit for bit on a CPU of the
    fixture's numeric platform; discrete values exact and floats close on any other)."""
    import shutil
    import subprocess
    import sys

    from trajectories import FLOAT_RTOL

    old = shutil.copytree(BEFORE_MESSAGE_API, tmp_path / "old")
    resumed = subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", "resume", str(old), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    overrides = ["rounds=6", "strategy.rounds_before_clustering=2", "simulation.engine=inprocess",
                 "simulation.portable_numerics=true"]
    fresh = subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", "run", str(DEFAULT_CONFIG), "--out",
                            str(tmp_path / "fresh"), "--no-progress", *[a for o in overrides for a in ("--set", o)]],
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr
    rows = {name: rows_without_timing([json.loads(line) for line in (tmp_path / name / "rounds.jsonl").read_text().splitlines()])
            for name in ("old", "fresh")}
    assert len(rows["old"]) == len(rows["fresh"]) == 6
    discrete = ("round", "phase", "num_clusters", "purity", "fit_clients", "fit_failures", "rejected_updates",
                "bytes_up", "bytes_down", "bytes_eval", "num_evaluated")
    for old_row, fresh_row in zip(rows["old"], rows["fresh"]):
        assert {k: old_row[k] for k in discrete} == {k: fresh_row[k] for k in discrete}
        np.testing.assert_allclose([old_row["mean_client_accuracy"], old_row["mean_test_loss"]],
                                   [fresh_row["mean_client_accuracy"], fresh_row["mean_test_loss"]], rtol=FLOAT_RTOL)
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("old", "fresh")]
    assert summaries[0]["finished"] and summaries[0]["assignment"] == summaries[1]["assignment"]
