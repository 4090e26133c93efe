"""The GPU script of benchmarks/device/ runs on a CPU with tiny sizes (slow tier), so that it works
the first time a GPU is lent: agreement of the engines, a timed round on each, one table run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not os.environ.get("FEDCLUSTER_DATA_DIR"), reason="needs Fashion-MNIST under FEDCLUSTER_DATA_DIR")
def test_the_device_script_dry_run_on_a_cpu(tmp_path: Path):
    done = subprocess.run([sys.executable, "benchmarks/device/run.py", "--device", "cpu", "--tiny", "--budget", "600",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    agreement = json.loads((tmp_path / "agreement.json").read_text())
    assert len(agreement) == 4 and all(case["ok"] and case["fit_failures"] == 0 for case in agreement.values())
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["batched"]["exchange_round_s"] > 0 and timing["inprocess"]["exchange_round_s"] > 0
    summary = json.loads((tmp_path / "dac_full" / "rot_unequal_dac_seed0" / "summary.json").read_text())
    assert summary["finished"] is True and summary["completed_rounds"] == 2
    assert "rot_unequal" in (tmp_path / "dac_full" / "README.md").read_text()
