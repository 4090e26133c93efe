"""Which FL+HC distance thresholds separate the true clusters of a run?

FL+HC's threshold is in the units of the chosen distance between client updates,
which depend on the model, learning rate and local steps; this script measures them.
Run an FL+HC experiment with ``strategy.save_updates=true`` (``rounds`` can stop at
the clustering round), then:

    python benchmarks/flhc/calibrate.py RUN_DIR [--at l1/complete=1800 ...] [--out calibration.md]

For every distance x linkage it prints the largest within-true-cluster distance, the
smallest across-true-cluster distance, and the interval [low, high) of thresholds whose
cut gives exactly the true clusters (ARI 1.0), if there is one (scipy's fcluster keeps a
merge at exactly the threshold). ``--at`` adds the clusters, purity and ARI of given cuts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from fedcluster_flwr.clustering import DISTANCES, LINKAGES, cluster_scores, pairwise_distances


def exact_threshold_interval(tree: np.ndarray, true: np.ndarray) -> tuple[float, float] | None:
    """Thresholds t with fcluster(t, 'distance') == the true partition: low <= t < high."""
    k = len(np.unique(true))
    heights = np.sort(tree[:, 2])
    n = len(true)
    low = heights[n - k - 1] if n - k - 1 >= 0 else 0.0
    high = heights[n - k] if n - k < len(heights) else np.inf
    if not low < high:
        return None
    cut = hierarchy.fcluster(tree, t=(low + high) / 2 if np.isfinite(high) else low + 1, criterion="distance")
    return (float(low), float(high)) if cluster_scores(true, cut)["ari"] == 1.0 else None


def cuts_report(condensed: dict[str, np.ndarray], true: np.ndarray, cuts: list[str]) -> list[str]:
    """Lines for ``distance/linkage=threshold`` cuts: clusters found, purity, ARI."""
    lines = ["", "| cut | clusters | purity | ARI | largest cluster |", "|---|---|---|---|---|"]
    for cut in cuts:
        distance, linkage, threshold = parse_cut(cut)
        tree = hierarchy.linkage(condensed[distance], method=linkage)
        labels = hierarchy.fcluster(tree, t=threshold, criterion="distance")
        scores = cluster_scores(true, labels)
        lines.append(f"| {cut} | {labels.max()} | {scores['purity']:.2f} | {scores['ari']:.2f} | {np.bincount(labels).max()} |")
    return lines


def parse_cut(cut: str) -> tuple[str, str, float]:
    """``l1/complete=1800`` -> ("l1", "complete", 1800.0), or exit with the allowed forms."""
    try:
        method, threshold = cut.split("=")
        distance, linkage = method.split("/")
        value = float(threshold)
    except ValueError:
        raise SystemExit(f"error: --at {cut!r}: expected DISTANCE/LINKAGE=THRESHOLD, e.g. l1/complete=1800") from None
    if distance not in DISTANCES or linkage not in LINKAGES or (linkage == "ward" and distance != "l2"):
        raise SystemExit(f"error: --at {cut!r}: distance one of {DISTANCES}, linkage one of {LINKAGES} (ward only with l2)")
    return distance, linkage, value


def calibrate(run_dir: Path, cuts: list[str]) -> str:
    updates = np.load(run_dir / "updates.npy")
    summary = json.loads((run_dir / "summary.json").read_text())
    true = np.asarray(summary["true_clusters"])[summary["clustered_clients"]]
    same = true[:, None] == true[None, :]
    off_diagonal = ~np.eye(len(true), dtype=bool)
    lines = [
        f"Calibration of {run_dir.name}: {len(true)} clients, {len(np.unique(true))} true clusters, "
        f"updates of dimension {updates.shape[1]}",
        "",
        "| distance | linkage | max within | min across | thresholds giving the true clusters |",
        "|---|---|---|---|---|",
    ]
    for cut in cuts:
        parse_cut(cut)  # fail on a malformed cut before the long distance computations
    condensed_by_distance = {}
    for distance in DISTANCES:
        condensed = condensed_by_distance[distance] = pairwise_distances(updates, distance)
        square = squareform(condensed)
        within = square[same & off_diagonal].max() if (same & off_diagonal).any() else float("nan")
        across = square[~same].min() if (~same).any() else float("nan")
        for linkage in LINKAGES:
            if linkage == "ward" and distance != "l2":
                continue
            interval = exact_threshold_interval(hierarchy.linkage(condensed, method=linkage), true)
            text = "none" if interval is None else f"[{interval[0]:.4g}, {interval[1]:.4g})"
            lines.append(f"| {distance} | {linkage} | {within:.4g} | {across:.4g} | {text} |")
    return "\n".join(lines + (cuts_report(condensed_by_distance, true, cuts) if cuts else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--at", nargs="*", default=[], metavar="DISTANCE/LINKAGE=THRESHOLD")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = calibrate(args.run_dir, args.at)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
