"""Whom each gossip run talked to, for the DAC table's runs made before ``summary.json`` recorded it:
per true cluster, the share of its members' neighbour draws that went to members of the same cluster
(``exchanges_same_true_cluster``, the diagonal blocks of the paper's Figure 4; see
:func:`fedcluster_flwr.algorithms.dac.math.same_true_cluster_share`).

    python benchmarks/dac/exchanges.py                   # every committed copy that lacks it
    python benchmarks/dac/exchanges.py --runs-dir DIR    # run folders elsewhere (default: the table's)

For each finished copy in ``benchmarks/dac/results/full/`` whose summary has no
``exchanges_same_true_cluster``, it reads ``communication.npy`` (how often client i drew client j,
over the whole run) from the run's folder, checks that folder is the same finished run (its
summary's rounds, clients and wall clock equal the copy's), and writes ``exchanges.json`` beside the
copy; a copy whose run folder is gone is listed and left without. Then re-render the page
(``python benchmarks/dac/table.py --render``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from fedcluster_flwr.algorithms.dac.math import SAME_CLUSTER_DRAWS, same_true_cluster_share
from fedcluster_flwr.results.files import atomic_write

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/tables.py
from tables import default_runs_root  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "full"
FILE = "exchanges.json"
SAME_RUN_KEYS = ("completed_rounds", "true_clusters", "wall_seconds", "mean_best_val_accuracy")


def exchanges_entry(run_dir: Path, copy: Path) -> dict | None:
    """``exchanges.json``'s content for the copy ``copy`` from the run folder ``run_dir``, or None where
    the folder has no communication counts (gone, or not a gossip run). Raises ValueError when the
    folder is another run than the copy (a rerun since)."""
    counts_file = run_dir / "communication.npy"
    if not counts_file.is_file():
        return None
    kept = json.loads((copy / "summary.json").read_text())
    here = json.loads((run_dir / "summary.json").read_text())
    differing = [key for key in SAME_RUN_KEYS if kept.get(key) != here.get(key)]
    if differing or not here.get("finished"):
        raise ValueError(f"{run_dir} is not the run committed in {copy}: "
                         f"{', '.join(differing) or 'finished'} differ")
    counts = np.load(counts_file)
    return {SAME_CLUSTER_DRAWS: same_true_cluster_share(counts, np.asarray(kept["true_clusters"])),
            "neighbour_draws": int(counts.sum()), "from": f"{run_dir.name}/communication.npy"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=Path, default=default_runs_root() / "dac",
                        help="the table's run folders (default: %(default)s)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="the committed copies (default: %(default)s)")
    args = parser.parse_args()
    for copy in sorted(p for p in args.results_dir.iterdir() if (p / "summary.json").is_file()):
        summary = json.loads((copy / "summary.json").read_text())
        if not summary.get("finished") or SAME_CLUSTER_DRAWS in summary or (copy / FILE).is_file():
            continue
        try:
            entry = exchanges_entry(args.runs_dir / copy.name, copy)
        except ValueError as error:
            print(f"{copy.name}: skipped: {error}", file=sys.stderr)
            continue
        if entry is None:
            print(f"{copy.name}: no communication.npy in {args.runs_dir / copy.name} (gone, or no gossip)")
            continue
        atomic_write(copy / FILE, json.dumps(entry, indent=1) + "\n")
        shares = ", ".join(f"{cluster}: {100 * share:.1f} %" for cluster, share in entry[SAME_CLUSTER_DRAWS].items())
        print(f"{copy.name}: {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
