"""The DAC table's page (benchmarks/dac/table.py ``render``) from committed copies: three readings of
each run (best validation, the last round's current models, round 1), mean ± the *sample* std over
seeds, the pre-training level read from rounds.jsonl where a summary predates it (issue #53).
Nothing runs: the copies are written here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ROOT
from fedcluster_flwr.algorithms.dac.math import same_true_cluster_share
from helpers import load_benchmark


@pytest.fixture(scope="module")
def table():
    module = load_benchmark("dac/table.py")
    return module


def per_cluster(*values: float) -> dict[str, float]:
    return {str(k): v for k, v in enumerate(values)}


def write_copy(results, name, *, best, last, first, first_in_summary=False, wall=3600.0, attempts=((0, 1800.0),)):
    """A finished run's committed small files: ``best``, ``last``, ``first`` are per-cluster accuracies
    (the mean over clients is taken as their mean); round 1's goes into rounds.jsonl, and into the
    summary too when ``first_in_summary`` (runs made since summaries carry it)."""
    folder = results / name
    folder.mkdir(parents=True)
    summary = {
        "finished": True, "completed_rounds": 101, "wall_seconds": wall, "clients_no_better_than_majority": [7],
        "per_true_cluster_best_val_accuracy": per_cluster(*best), "mean_best_val_accuracy": float(np.mean(best)),
        "per_true_cluster_accuracy": per_cluster(*last), "mean_client_accuracy": float(np.mean(last)),
    }
    if first_in_summary:
        summary |= {"per_true_cluster_first_round_accuracy": per_cluster(*first),
                    "first_round_mean_client_accuracy": float(np.mean(first))}
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"round": 1, "phase": "pretrain", "per_true_cluster_accuracy": per_cluster(*first),
             "mean_client_accuracy": float(np.mean(first))},
            {"round": 101, "phase": "dac", "per_true_cluster_accuracy": per_cluster(*last),
             "mean_client_accuracy": float(np.mean(last))}]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    machine = [{"engine": "batched", "device": "cpu", "seconds": seconds, "resumed_from_round": start}
               for start, seconds in attempts]
    (folder / "machine.json").write_text(json.dumps({"attempts": machine}))


def rows_of(page: str, method: str) -> list[list[str]]:
    """The page's rows of ``method`` in the rot_unequal section: its own, the unnamed rows after it and
    the paper's."""
    section = page.split("\n## rot_unequal (")[1].split("\n## ")[0]
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    start = next(i for i, cells in enumerate(lines) if cells[0] == method)
    rows = [lines[start]]
    for cells in lines[start + 1:]:
        if cells[0] not in ("", "*paper*"):
            break
        rows.append(cells)
    return rows


def test_cell_is_mean_and_sample_std_or_the_single_value(table):
    assert table.cell([]) == "–"
    assert table.cell([0.7512]) == "75.12"
    # 0.70 and 0.80: population std 5.00, sample std 7.07
    assert table.cell([0.70, 0.80]) == "75.00 ± 7.07"


def test_page_shows_three_readings_per_method_with_sample_std(table, tmp_path):
    results = tmp_path / "full"
    write_copy(results, "rot_unequal_dac_seed0", best=(0.80, 0.78, 0.76, 0.74), last=(0.72, 0.74, 0.66, 0.68),
               first=(0.70, 0.68, 0.73, 0.69), first_in_summary=True, wall=7200.0, attempts=((0, 1800.0), (80, 1800.0)))
    write_copy(results, "rot_unequal_dac_seed1", best=(0.82, 0.80, 0.78, 0.76), last=(0.74, 0.70, 0.68, 0.70),
               first=(0.72, 0.66, 0.75, 0.71))  # a copy from before summaries kept round 1
    table.render(results)
    page = (results / "README.md").read_text()
    assert "sample** standard deviation (ddof = 1)" in page
    best, last, first = rows_of(page, "dac")[:3]
    assert best[:3] == ["dac", "0,1", "best validation"]
    assert best[3:8] == ["81.00 ± 1.41", "79.00 ± 1.41", "77.00 ± 1.41", "75.00 ± 1.41", "78.00 ± 1.41"]
    assert last[2] == "current, round 101"
    assert last[3:7] == ["73.00 ± 1.41", "72.00 ± 2.83", "67.00 ± 1.41", "69.00 ± 1.41"]
    assert last[9] == "1, 1"  # each seed's collapsed clients, on the current models' row
    assert first[2] == "round 1 (pre-training)"
    # seed 0 from its summary, seed 1 from its rounds.jsonl: both counted
    assert first[3:7] == ["71.00 ± 1.41", "67.00 ± 1.41", "74.00 ± 1.41", "70.00 ± 1.41"]
    assert best[11] == "2.0 h (1.0 h recorded, from round 0, 80), 1.0 h (0.5 h recorded, from round 0)"
    assert rows_of(page, "dac")[3][0] == "*paper*"


def test_one_seed_prints_its_values_and_unfinished_methods_a_dash(table, tmp_path):
    results = tmp_path / "full"
    write_copy(results, "rot_unequal_pens_seed0", best=(0.7949, 0.7575, 0.792, 0.778),
               last=(0.7409, 0.5805, 0.696, 0.708), first=(0.705, 0.686, 0.734, 0.70))
    table.render(results)
    page = (results / "README.md").read_text()
    best, last, first, paper = rows_of(page, "pens")
    assert best[3:5] == ["79.49", "75.75"] and last[3:5] == ["74.09", "58.05"] and first[3:5] == ["70.50", "68.60"]
    assert paper[3:8] == ["74.62", "42.03", "–", "–", "65.91*"]
    assert rows_of(page, "local")[0][1:4] == ["–", "", "–"]
    # the low-data setting has its own section, before any of its runs finished
    assert "## rot_unequal_low (" in page and "100 train / 100 validation / 100 test" in page


def test_the_draws_inside_own_cluster_row_reads_the_summary_or_the_backfilled_file(table, tmp_path):
    results = tmp_path / "full"
    for seed in (0, 1, 2):
        write_copy(results, f"rot_unequal_dac_seed{seed}", best=(0.8,) * 4, last=(0.7,) * 4, first=(0.6,) * 4)
    summary_file = results / "rot_unequal_dac_seed0" / "summary.json"
    summary = json.loads(summary_file.read_text())
    summary_file.write_text(json.dumps(summary | {"exchanges_same_true_cluster": per_cluster(0.9, 0.8, 0.2, 0.4)}))
    (results / "rot_unequal_dac_seed1" / "exchanges.json").write_text(
        json.dumps({"exchanges_same_true_cluster": per_cluster(1.0, 0.9, 0.3, 0.2)}))
    # seed 2: its run folder was gone before the file was computed: not in the row
    write_copy(results, "rot_unequal_local_seed0", best=(0.8,) * 4, last=(0.7,) * 4, first=(0.6,) * 4)
    table.render(results)
    page = (results / "README.md").read_text()
    draws = rows_of(page, "dac")[3]
    assert draws[1:3] == ["0,1", "draws inside own cluster"]
    assert draws[3:8] == ["95.00 ± 7.07", "85.00 ± 7.07", "25.00 ± 7.07", "30.00 ± 14.14", "58.75 ± 1.77"]
    assert rows_of(page, "dac")[4][0] == "*paper*"
    assert [row[2] for row in rows_of(page, "local")] == ["best validation", "current, round 101", "round 1 (pre-training)"]


def paired_rows_of(page: str) -> dict[str, list[str]]:
    """The rot_unequal section's paired differences: method -> its cells after the name."""
    section = page.split("\n## rot_unequal (")[1].split("\n## ")[0]
    table = section.split("| DAC minus, per seed |")[1]
    return {cells[0]: cells[1:] for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_dac_minus_each_method_is_taken_seed_by_seed_on_the_seeds_both_finished(table, tmp_path):
    results = tmp_path / "full"
    write_copy(results, "rot_unequal_dac_seed0", best=(0.80, 0.78, 0.76, 0.74), last=(0.70,) * 4, first=(0.6,) * 4)
    write_copy(results, "rot_unequal_dac_seed1", best=(0.82, 0.80, 0.78, 0.76), last=(0.72,) * 4, first=(0.6,) * 4)
    # random gossip: 3 points under DAC on seed 0, 1 above on seed 1 (means of clusters 0.74 and 0.80)
    write_copy(results, "rot_unequal_random_gossip_seed0", best=(0.74,) * 4, last=(0.71,) * 4, first=(0.6,) * 4)
    write_copy(results, "rot_unequal_random_gossip_seed1", best=(0.80,) * 4, last=(0.70,) * 4, first=(0.6,) * 4)
    # PENS: seeds 1 and 2; only seed 1 is shared with DAC
    write_copy(results, "rot_unequal_pens_seed1", best=(0.70,) * 4, last=(0.75,) * 4, first=(0.6,) * 4)
    write_copy(results, "rot_unequal_pens_seed2", best=(0.10,) * 4, last=(0.10,) * 4, first=(0.6,) * 4)
    table.render(results)
    page = (results / "README.md").read_text()
    assert "**DAC minus each method, seed by seed**" in page
    rows = paired_rows_of(page)
    # gaps +3 and -1 points: mean +1.00, sample std 2.83, DAC above on one of two seeds; current: -1 and +2
    assert rows["random_gossip"] == ["0,1", "+1.00 ± 2.83 (1 of 2)", "+0.50 ± 2.12 (1 of 2)"]
    assert rows["pens"] == ["1", "+9.00 (1 of 1)", "-3.00 (0 of 1)"]  # PENS's seed 2 has no DAC seed to pair
    assert set(rows) == {"random_gossip", "pens"}  # a method with no seed in common has no row
    # a setting where DAC has no finished seed has no paired table
    low = page.split("\n## rot_unequal_low (")[1].split("\n## ")[0]
    assert "DAC minus, per seed" not in low


def test_the_backfill_reads_the_run_folders_counts_and_refuses_another_run(tmp_path):
    exchanges = load_benchmark("dac/exchanges.py")
    results, runs = tmp_path / "full", tmp_path / "runs"
    write_copy(results, "rot4_dac_seed0", best=(0.8,) * 4, last=(0.7,) * 4, first=(0.6,) * 4)
    copy = results / "rot4_dac_seed0"
    summary = json.loads((copy / "summary.json").read_text()) | {"true_clusters": [0, 0, 1, 1]}
    (copy / "summary.json").write_text(json.dumps(summary))
    assert exchanges.exchanges_entry(runs / "rot4_dac_seed0", copy) is None  # no run folder
    (runs / "rot4_dac_seed0").mkdir(parents=True)
    (runs / "rot4_dac_seed0" / "summary.json").write_text(json.dumps(summary))
    np.save(runs / "rot4_dac_seed0" / "communication.npy", np.array([[0, 3, 1, 0], [1, 0, 0, 0], [2, 2, 0, 4], [0, 0, 0, 0]]))
    entry = exchanges.exchanges_entry(runs / "rot4_dac_seed0", copy)
    assert entry["exchanges_same_true_cluster"] == {"0": 4 / 5, "1": 4 / 8} and entry["neighbour_draws"] == 13
    (runs / "rot4_dac_seed0" / "summary.json").write_text(json.dumps(summary | {"wall_seconds": 1.0}))
    with pytest.raises(ValueError, match="wall_seconds differ"):
        exchanges.exchanges_entry(runs / "rot4_dac_seed0", copy)


def test_the_reduced_and_reference_pages_print_the_sample_std():
    """benchmarks/dac/run.py and reference_check.py: ± is the sample std from issue #53 on; the shared
    helper keeps the population std for the other benchmarks' pages unless asked."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import mean_std

    reference_check = load_benchmark("dac/reference_check.py")
    # the reference page's every-run table: DAC, ours, synchronous, 180 degrees, seeds 0-2
    assert reference_check.mean_std([65.2, 67.4, 66.3]) == "66.3 ± 1.1"  # population std: 0.9, as the page printed
    assert reference_check.mean_std([65.2]) == "65.2"
    assert mean_std([0.70, 0.80], ddof=1) == "0.750 ± 0.071"
    assert mean_std([0.70, 0.80]) == "0.750 ± 0.050"  # the default: population
    assert mean_std([0.70, None], ddof=1) == "0.700 (1/2)"


def test_the_reduced_page_reads_own_cluster_draws_from_the_summary_or_the_communication_matrix(tmp_path):
    """benchmarks/dac/run.py: a committed run copy has no communication.npy; its summary's
    ``exchanges_same_true_cluster`` gives the same share; a cluster that drew nobody (local) has none."""
    run = load_benchmark("dac/run.py")
    true = np.array([0, 0, 1, 1, 1])
    counts = np.array([[0, 2, 1, 0, 0], [1, 0, 0, 1, 1], [0, 1, 0, 2, 1], [3, 0, 0, 0, 0], [0, 0, 1, 1, 0]])
    np.save(tmp_path / "communication.npy", counts)
    from_matrix = run.own_cluster_share(tmp_path, {"true_clusters": true.tolist()}, 1)
    assert from_matrix == pytest.approx(5 / 9)  # rows 2-4 drew 9 times, 5 of them among 2-4
    # what the DAC strategy's summary holds
    summary = {"true_clusters": true.tolist(), "exchanges_same_true_cluster": same_true_cluster_share(counts, true)}
    (tmp_path / "communication.npy").unlink()
    assert run.own_cluster_share(tmp_path, summary, 1) == from_matrix
    assert run.own_cluster_share(tmp_path, {"true_clusters": [0], "exchanges_same_true_cluster": {}}, 0) is None
    assert run.own_cluster_share(tmp_path, {"true_clusters": [0]}, 0) is None


REFERENCE_PAGES = {  # page folder: the report's arguments, as its first line names them
    "": dict(exchanges=12, seeds=[0, 1, 2], methods=["dac", "random_gossip"], orders=["synchronous", "sequential"], set=[]),
    "dead_runs": dict(exchanges=5, seeds=[3, 4, 5, 6, 7, 8, 9, 10], methods=["random_gossip"],
                      orders=["synchronous", "sequential"], set=[]),
    "same_init": dict(exchanges=5, seeds=[3, 4, 5, 6, 7, 8, 9, 10], methods=["random_gossip"], orders=["synchronous"],
                      set=["strategy.same_init=true"]),
}


@pytest.mark.parametrize("page", sorted(REFERENCE_PAGES))
def test_the_reference_check_pages_are_their_committed_records(page):
    """Each page under benchmarks/dac/results/reference_check/ is what reference_check.py's report
    makes of the records committed beside it (ours under runs/, the reference code's under
    reference_code/), every run present and finished: the page cannot drift from its evidence."""
    import argparse

    check = load_benchmark("dac/reference_check.py")
    base = ROOT / "benchmarks" / "dac" / "results" / "reference_check"
    folder = base / page if page else base
    settings = dict(REFERENCE_PAGES[page])
    seeds = settings.pop("seeds")
    args = argparse.Namespace(out=folder, reference=base / "reference_code" if page != "same_init" else None,
                              clients=40, train=100, final_test=2000, **settings)
    committed = (folder / "results.md").read_text()
    assert committed.startswith("Written by `python benchmarks/dac/reference_check.py --out ")
    assert committed.split("\n\n", 1)[1] == check.report(args, seeds)
    for method in settings["methods"]:
        for order in settings["orders"]:
            for seed in seeds:
                assert check.finished(folder / "runs" / f"{method}_{order}_seed{seed}" / "reference_check.jsonl")
    assert json.loads((folder / "variant.json").read_text())["set"] == settings["set"]
