"""The GPU script of benchmarks/device/ runs on a CPU with tiny sizes (slow tier), so that it works
the first time a GPU is lent: agreement of the engines, a timed round on each, one run of each queued
table (DAC Table 2, DAC's low-data setting, FL+HC's grid, one-shot HFL), packed into one archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not os.environ.get("FEDCLUSTER_DATA_DIR"), reason="needs Fashion-MNIST under FEDCLUSTER_DATA_DIR")
def test_the_device_script_dry_run_on_a_cpu(tmp_path: Path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run([sys.executable, "benchmarks/device/run.py", "--device", "cpu", "--tiny", "--budget", "800",
                           "--out", str(out), "--work", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=900)
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
    assert all(report[step] == "exited 0" for step in (*dac_steps, "flhc_grid", "oneshot_full")), report
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
    assert "benchmarks/oneshot/results/full/results.md" in names
    assert "benchmarks/oneshot/results/full/oracle_hfl_shared_seed0/summary.json" in names
    assert not any("checkpoint" in n or n.endswith("README.md") for n in names)
