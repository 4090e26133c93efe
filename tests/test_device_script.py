"""The GPU script of benchmarks/device/ runs on a CPU with tiny sizes (slow tier), so that it works
the first time a GPU is lent: agreement of the engines, a timed round on each, one run of each queued
table (DAC Table 2, DAC's low-data setting, FL+HC's grid, DAC's 4 x 25 setting), packed into one archive.
Fast: what a lease stopped comes back in parts within the device's limits, and a note in the
agreement report (no Ray there) is not a failed case."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from conftest import ROOT
from helpers import load_benchmark


@pytest.fixture
def device_script():
    with mock.patch.dict(os.environ):  # the script sets its environment defaults on import
        yield load_benchmark("device/run.py")


def test_a_note_in_the_agreement_report_is_not_a_failed_case(device_script):
    note = {"batched_actor": "not run: ray is not installed here"}
    assert device_script.agreement_ok({**note, "dac, deterministic=True": {"ok": True}})
    assert not device_script.agreement_ok({**note, "dac, deterministic=True": {"ok": True}, "flhc": {"ok": False}})


def test_the_queue_puts_the_gpu_only_tables_before_the_work_the_cpu_tables_share(device_script, tmp_path):
    names = [step.name for step in device_script.queue(False, tmp_path)]
    order = ["dac_table2", "dac_low", "flhc_grid", "dac_rot4"]  # a DAC step only while runs are left
    assert "flhc_grid" in names and names == [name for name in order if name in names]
    needs = {step.name: step.needs for step in device_script.queue(False, tmp_path)}
    assert needs["flhc_grid"] == "MNIST" and all(needs[name] == "FashionMNIST" for name in names if name.startswith("dac_"))


def test_the_queue_does_not_redo_ali_and_arafas_full_length_runs_made_on_the_cpu(device_script, tmp_path):
    # benchmarks/oneshot's full length (28 training rounds, 6 seeds) is committed from the CPU (#41)
    assert (ROOT / "benchmarks" / "oneshot" / "results" / "fmnist_3tasks_full" / "results.md").is_file()
    commands = [" ".join(step.command) for step in device_script.queue(False, tmp_path)]
    assert not any("oneshot" in command for command in commands), commands


def test_the_timing_step_says_it_did_not_run_without_fashion_mnist(device_script, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCLUSTER_DATA_DIR", str(tmp_path))  # a bundle that carried MNIST only
    (tmp_path / "MNIST").mkdir()
    assert device_script.carried("MNIST") and not device_script.carried("FashionMNIST")
    assert "no FashionMNIST" in device_script.timing("cpu", True, tmp_path)["not run"]


def run_folder(path: Path, *, finished: bool, checkpoint_bytes: int = 0, seed: int = 0) -> bytes:
    """A run folder as the tables leave it: summary.json, a claim, and a checkpoint of random
    (incompressible) bytes when ``checkpoint_bytes``; returns those bytes."""
    (path / "checkpoint").mkdir(parents=True) if checkpoint_bytes else path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"finished": finished}))
    (path / ".claimed").write_text(json.dumps({"pid": 1, "host": "gpu"}))
    blob = np.random.default_rng(seed).bytes(checkpoint_bytes)
    if checkpoint_bytes:
        (path / "checkpoint" / "models.npz").write_bytes(blob)
    return blob


def test_runs_the_budget_stopped_come_back_in_parts_under_their_table_paths(device_script, tmp_path, monkeypatch):
    monkeypatch.setattr(device_script, "PART_BYTES", 4096)
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    for name in ("agreement.json", "timing.json", "results.tar.gz"):
        (out / name).write_text("{}")
    dac_runs, flhc_runs = work / "dac_runs", work / "flhc_runs"
    stopped = run_folder(dac_runs / "rot4_dac_seed1", finished=False, checkpoint_bytes=6000, seed=1)
    run_folder(dac_runs / "rot4_dac_seed0", finished=True, checkpoint_bytes=100)  # finished: its small files went
    run_folder(dac_runs / "rot4_pens_seed1", finished=False)  # stopped before a checkpoint: starts again
    run_folder(dac_runs / "rot4_local_seed1", finished=False, checkpoint_bytes=20000)  # over the room left
    base = run_folder(flhc_runs / "base", finished=False, checkpoint_bytes=300, seed=2)  # shared rounds: go along
    branch = run_folder(flhc_runs / "l1_complete_k25", finished=False, checkpoint_bytes=4000, seed=3)
    Step = device_script.Step
    steps = [Step(name, [], work / name, "dest", runs_dir=dac_runs, runs_home="dac") for name in ("dac_low", "dac_rot4")]
    steps.append(Step("flhc_grid", [], work / "flhc", "dest", shared=("base", "probe"), runs_dir=flhc_runs,
                      runs_home="flhc_sweep_x"))
    report = device_script.pack_stopped(steps, out, work)
    assert report["packed"] == ["dac/rot4_dac_seed1", "flhc_sweep_x/base", "flhc_sweep_x/l1_complete_k25"]
    assert report["no room"] == ["dac/rot4_local_seed1"]  # named, not lost silently
    parts = sorted(out.glob("resume.tar.gz.*"))
    assert [p.name for p in parts] == report["parts"] and len(parts) >= 3  # split: more than one part's bytes
    assert all(p.stat().st_size <= 4096 for p in parts) and len(list(out.iterdir())) <= device_script.BACK_FILES - 1
    joined = tmp_path / "resume.tar.gz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))  # cat resume.tar.gz.* | tar xzf -
    tables = tmp_path / "fedcluster-tables"
    with tarfile.open(joined) as archive:
        archive.extractall(tables, filter="data")
    assert (tables / "dac/rot4_dac_seed1/checkpoint/models.npz").read_bytes() == stopped
    assert (tables / "flhc_sweep_x/base/checkpoint/models.npz").read_bytes() == base
    assert (tables / "flhc_sweep_x/l1_complete_k25/checkpoint/models.npz").read_bytes() == branch
    assert json.loads((tables / "dac/rot4_dac_seed1/summary.json").read_text()) == {"finished": False}
    assert not list(tables.rglob(".claimed"))  # a claim names a process over there
    assert not (work / "resume.tar.gz").exists()


def test_nothing_stopped_sends_no_part(device_script, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_folder(tmp_path / "runs" / "done", finished=True, checkpoint_bytes=10)
    run_folder(tmp_path / "runs" / "base", finished=False, checkpoint_bytes=10)  # shared rounds end early; no branch stopped
    step = device_script.Step("flhc_grid", [], tmp_path / "r", "dest", shared=("base",), runs_dir=tmp_path / "runs",
                              runs_home="flhc_sweep_x")
    assert device_script.pack_stopped([step], out, tmp_path) == {"packed": [], "parts": [], "no room": []}
    assert list(out.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDCLUSTER_DATA_DIR"), reason="needs Fashion-MNIST under FEDCLUSTER_DATA_DIR")
def test_the_device_script_dry_run_on_a_cpu(tmp_path: Path):
    out, work = tmp_path / "out", tmp_path / "work"
    # the modules whose wheels bundle.sh leaves out are refused here, in the script and every step it starts
    left_out = re.search(r'^LEFT_OUT="([^"]+)"', (ROOT / "benchmarks" / "device" / "bundle.sh").read_text(), re.M)
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        f"LEFT_OUT = {set(left_out.group(1).split())!r}\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in LEFT_OUT:\n"
        "            raise ImportError(f'{name}: its wheel is not in the GPU bundle (benchmarks/device/bundle.sh)')\n"
        "sys.meta_path.insert(0, Refuse())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    refused = subprocess.run([sys.executable, "-c", "import sqlalchemy"], env=env, capture_output=True, text=True)
    assert "not in the GPU bundle" in refused.stderr  # installed here (a flwr dependency), refused in the dry run
    done = subprocess.run([sys.executable, "benchmarks/device/run.py", "--device", "cpu", "--tiny", "--budget", "800",
                           "--out", str(out), "--work", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    agreement = json.loads((out / "agreement.json").read_text())
    assert len(agreement) == 4 and all(case["ok"] and case["fit_failures"] == 0 for case in agreement.values())
    assert all(case["engines"] == ["inprocess", "batched", "batched_actor"] for case in agreement.values())
    timing = json.loads((out / "timing.json").read_text())
    assert timing["batched"]["exchange_round_s"] > 0 and timing["inprocess"]["exchange_round_s"] > 0
    # what comes back: a handful of files (the lease returns at most 8), the run folders stay in --work
    assert sorted(p.name for p in out.iterdir()) == ["agreement.json", "results.tar.gz", "tables.json", "timing.json"]
    report = json.loads((out / "tables.json").read_text())
    # a DAC setting whose every run is committed has no step (the low-data one and Table 2 at 500
    # images, since their 18 runs each are); a step's tiny run comes back
    dac_steps = [step for step in ("dac_table2", "dac_low", "dac_rot4") if step in report]
    assert all(report[step] == "exited 0" for step in (*dac_steps, "flhc_grid")), report
    with tarfile.open(out / "results.tar.gz") as archive:
        names = archive.getnames()
        dac = [n for n in names if n.startswith("benchmarks/dac/results/full/") and n.endswith("/summary.json")]
        # one run of each DAC step (--max-runs 1), at the repository path it is committed under
        assert len(dac) == len(dac_steps), names
        assert any("/rot_unequal_low_" in n for n in dac) == ("dac_low" in dac_steps), names
        assert any("/rot4_" in n for n in dac) == ("dac_rot4" in dac_steps), names
        for summary in (json.loads(archive.extractfile(name).read()) for name in dac):
            assert summary["finished"] is True and summary["completed_rounds"] == 2
    flhc = "benchmarks/flhc/results/full/default/"
    assert {f"{flhc}thresholds.json", f"{flhc}base/rounds.jsonl", f"{flhc}probe/summary.json"} <= set(names)
    assert any(n.startswith(f"{flhc}l1_complete_") for n in names)  # the tiny grid's one branch
    assert not any("checkpoint" in n or n.endswith("README.md") for n in names)
