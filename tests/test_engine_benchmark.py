"""benchmarks/engines/run.py's table of the rounds it timed: the ratio the engines README states per
conf (batched over the in-process run timed just before it) is computed from the rows, and a failed
run stays a row with its error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from helpers import load_benchmark

RUN_PY = ROOT / "benchmarks" / "engines" / "run.py"


def load_run_py():
    return load_benchmark("engines/run.py")


def row(conf, engine, seconds, load=1.0):
    return {"conf": conf, "engine": engine, "rounds": len(seconds), "load_before": load, "load": load,
            "wall_seconds": sum(seconds) + 5, "round_seconds": seconds,
            "median_after_first": sorted(seconds[1:])[len(seconds[1:]) // 2]}


def test_the_table_gives_batched_over_inprocess_per_conf_and_keeps_failed_runs(tmp_path: Path):
    rows = [row("a", "ray", [9.0, 4.0, 4.0]), row("a", "inprocess", [3.0, 2.0, 2.0]), row("a", "batched", [2.0, 1.0, 1.0]),
            row("b", "batched", [1.0, 3.0, 3.0]),  # no inprocess row for b before it: no ratio
            row("a", "inprocess", [3.0, 4.0, 4.0]), row("a", "batched", [2.0, 3.0, 3.0]),  # a second pair: its own ratio
            {"conf": "c", "engine": "ray", "rounds": 3, "load_before": 0.5, "load": 0.7, "wall_seconds": 6.0,
             "error": "error: cifar10: missing data_batch_1"},
            {"conf": "a", "engine": "inprocess", "rounds": 3, "load_before": 1.0, "load": 1.0, "wall_seconds": 6.0,
             "error": "killed"}, row("a", "batched", [2.0, 1.0, 1.0])]  # its pair failed: no ratio
    lines = load_run_py().markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[4] == "| a | batched | 2.00 | 1.00 | 9 | 0.50 | 1.0 / 1.0 |"
    assert lines[5].split("|")[6].strip() == ""
    assert lines[7].split("|")[6].strip() == "0.75"
    assert "failed: error: cifar10: missing data_batch_1" in lines[8] and "0.5 / 0.7" in lines[8]
    assert lines[10].split("|")[6].strip() == ""
    log = tmp_path / "rows.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    printed = subprocess.run([sys.executable, str(RUN_PY), "table", str(log)], capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == "\n".join(lines)
