"""The leaderboard's page (benchmarks/leaderboard/run.py ``report``) from its cells' numbers: each finished
cell's line in ``cells.jsonl`` outlives its run directory, a rerun replaces it, mean ± the *sample* std over
seeds, a personal-model method's global model beside it; the committed page and the paper page's table
are what the committed ``cells.jsonl`` gives. Nothing trains: the run folders are written here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from helpers import load_benchmark

RESULTS = ROOT / "benchmarks" / "leaderboard" / "results" / "reduced"


@pytest.fixture(scope="module")
def board():
    module = load_benchmark("leaderboard/run.py")
    return module


def write_run(out, shift, method, seed, accuracy, *, finished=True, ari=1.0, global_accuracy=None, seconds=(1.0, 2.0)):
    """A cell's run folder as the runner leaves it: summary.json and rounds.jsonl."""
    folder = out / "runs" / shift / f"{method}_seed{seed}"
    folder.mkdir(parents=True)
    summary = {"finished": finished, "mean_client_accuracy": accuracy, "ari": ari, "purity": 1.0, "num_clusters": 4,
               "client_accuracy": {"0": accuracy}, "assignment": [0], "fit_failures": 0, "wall_seconds": 9.0,
               "software": {"fedcluster_flwr": "0.1.0", "code": "abc1234", "flwr": "1.42.0"},
               "numeric_platform": {"cpu_model": "Test CPU"}, "model_state": "not kept"}
    if global_accuracy is not None:
        summary["mean_global_model_accuracy"] = global_accuracy
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "rounds.jsonl").write_text("".join(json.dumps({"round": r + 1, "seconds": s}) + "\n"
                                                 for r, s in enumerate(seconds)))
    return folder


def rows(page: str, section: str) -> dict[str, list[str]]:
    """The table under ``## section`` as {method: cells}."""
    part = page.split(f"## {section}")[1].split("\n## ")[0]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in part.splitlines() if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in table[1:]}


def test_a_cells_line_outlives_its_run_folder_and_a_rerun_replaces_it(board, tmp_path):
    import shutil

    write_run(tmp_path, "rotation", "fedavg", 0, 0.70)
    write_run(tmp_path, "rotation", "fedavg", 1, 0.80)
    write_run(tmp_path, "rotation", "local", 0, 0.50, finished=False)  # stopped: not a cell yet
    cells = board.collect_cells(tmp_path)
    assert sorted(cells) == [("rotation", "fedavg", 0), ("rotation", "fedavg", 1)]
    line = cells[("rotation", "fedavg", 0)]
    assert line["seconds"] == 3.0 and line["cpu_model"] == "Test CPU" and line["software"]["code"] == "abc1234"
    assert "model_state" not in line  # only the declared keys (CELL_KEYS) travel

    shutil.rmtree(tmp_path / "runs")  # a clean checkout: only cells.jsonl is there
    assert board.collect_cells(tmp_path) == cells
    write_run(tmp_path, "rotation", "fedavg", 1, 0.90)  # seed 1 run again
    again = board.collect_cells(tmp_path)
    assert again[("rotation", "fedavg", 1)]["mean_client_accuracy"] == 0.90
    assert again[("rotation", "fedavg", 0)] == cells[("rotation", "fedavg", 0)]
    on_disk = [json.loads(x) for x in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [(x["seed"], x["mean_client_accuracy"]) for x in on_disk] == [(0, 0.70), (1, 0.90)]


def test_a_damaged_cells_file_is_an_error_naming_its_line(board, tmp_path):
    (tmp_path / "cells.jsonl").write_text('{"shift": "rotation", "method": "fedavg", "seed": 0}\n{"shift": \n')
    with pytest.raises(SystemExit, match=r"cells.jsonl, line 2: not a cell's line"):
        board.collect_cells(tmp_path)


def test_page_is_mean_and_sample_std_with_missing_cells_and_the_global_model(board, tmp_path):
    for seed, (accuracy, global_accuracy) in enumerate([(0.70, 0.60), (0.80, 0.64)]):
        write_run(tmp_path, "rotation", "ditto", seed, accuracy, global_accuracy=global_accuracy)
        write_run(tmp_path, "rotation", "flhc", seed, accuracy + 0.1, ari=0.5 + 0.5 * seed)
    write_run(tmp_path, "label_swap", "flhc", 0, 0.90, seconds=(4.0,))
    page = board.report(tmp_path, "reduced", ["ditto", "flhc"], ["label_swap", "rotation"], [0, 1], "cmd")
    accuracy = rows(page, "Mean client accuracy")
    # 0.70 and 0.80: sample std 0.071 (the population std would be 0.050)
    assert accuracy["ditto"] == ["– (0/2)", "0.750 ± 0.071"]
    assert accuracy["flhc"] == ["0.900 (1/2)", "0.850 ± 0.071"]
    assert rows(page, "The global model")["ditto"] == ["– (0/2)", "0.620 ± 0.028"]
    assert "flhc" not in rows(page, "The global model")  # keeps no personal models
    ari = rows(page, "ARI")
    assert ari["ditto"] == ["–", "–"] and ari["flhc"] == ["1.000 (1/2)", "0.750 ± 0.354"]
    assert rows(page, "Time per cell")["flhc"] == ["4.0", "3.0"]
    assert "(5/8 cells finished; their rounds took 0 min in all)" in page
    assert "Made by code abc1234 on Test CPU" in page
    assert (tmp_path / "leaderboard.md").read_text() == page and (tmp_path / "accuracy.png").is_file()


def test_the_committed_page_is_what_the_committed_cells_give(tmp_path):
    """``--table-only`` on a clean checkout: the committed cells.jsonl renders the committed page, byte for byte."""
    (tmp_path / "cells.jsonl").write_bytes((RESULTS / "cells.jsonl").read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "leaderboard" / "run.py"), "--table-only",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "leaderboard.md").read_text() == (RESULTS / "leaderboard.md").read_text()
    assert (tmp_path / "cells.jsonl").read_bytes() == (RESULTS / "cells.jsonl").read_bytes()


def test_the_paper_pages_table_is_the_cells_means(board):
    """docs/papers/leaderboard.md's accuracy table: every method's mean over seeds, to three decimals."""
    cells = [json.loads(line) for line in (RESULTS / "cells.jsonl").read_text().splitlines()]
    page = (ROOT / "docs" / "papers" / "leaderboard.md").read_text()
    table = page.split("| method | label swap |")[1].split("\n\n")[0]
    shown = {}
    for line in table.splitlines()[2:]:
        method, *entries = [c.strip() for c in line.strip("|").split("|")]
        shown[method] = [float(re.sub(r"\*", "", e)) for e in entries]
    assert sorted(shown) == sorted(board.METHODS)
    for method, entries in shown.items():
        for shift, entry in zip(board.SHIFTS, entries):
            values = [c["mean_client_accuracy"] for c in cells if c["method"] == method and c["shift"] == shift]
            assert len(values) == 3, (method, shift)
            assert entry == pytest.approx(np.mean(values), abs=5e-4), (method, shift)
