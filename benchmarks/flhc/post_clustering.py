"""Where does FL+HC's accuracy go after the clustering round? Per-client evidence from finished runs.

After the clustering round c every cluster model is the average of *all* its members'
updates. From round c + 1 on, each cluster trains only ``max(1, floor(cf * size))`` sampled
members, and their FedAvg replaces the cluster model. A client whose cluster mixes label sets
is then served a model fitted to the label sets that happened to be sampled. This script
sorts the clients of each run by the composition of their cluster (from ``summary.json``:
the assignment and the true cluster = label set) and, round by round, by whether a member
with their own label set trained (``fit_clients`` in ``rounds.jsonl``), and prints:

1. the change of accuracy from round c to c + 1 per kind of cluster;
2. over rounds c + 1 .. last, the mean accuracy of clients in mixed clusters in rounds where
   a member with their label set trained and in rounds where none did.

    python benchmarks/flhc/post_clustering.py RUN_DIR [RUN_DIR ...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedcluster_flwr.results.run_files import read_rounds


def cluster_kind(pid: int, members: list[int], true: np.ndarray) -> str:
    if len(members) == 1:
        return "alone"
    if all(true[m] == true[pid] for m in members):
        return "all members share its label set"
    return "mixed label sets"


def analyse(run_dir: Path) -> list[str]:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = {row["round"]: row for row in read_rounds(run_dir)}
    if any("client_accuracy" not in row or "fit_clients" not in row for row in rows.values()):
        return [f"{run_dir.name}: rounds.jsonl has no client_accuracy / fit_clients (a run made before they were recorded); skipped"]
    clustered = summary.get("clustering_round")
    if clustered is None or clustered + 1 not in rows:
        return [f"{run_dir.name}: no per-cluster round after clustering; skipped"]
    true = np.asarray(summary["true_clusters"])
    assignment = np.asarray(summary["assignment"])
    members = defaultdict(list)
    for pid, cluster in enumerate(assignment):
        members[int(cluster)].append(pid)

    def accuracy(round_number: int, pid: int) -> float | None:
        return rows[round_number]["client_accuracy"].get(str(pid))

    def own_label_set_trained(round_number: int, pid: int) -> bool:
        trained = set(rows[round_number]["fit_clients"])
        return any(m in trained and true[m] == true[pid] for m in members[int(assignment[pid])])

    first = clustered + 1
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for pid in range(len(assignment)):
        before, after = accuracy(clustered, pid), accuracy(first, pid)
        if before is None or after is None:
            continue
        kind = cluster_kind(pid, members[int(assignment[pid])], true)
        if kind == "mixed label sets":
            kind += ", own label set trained" if own_label_set_trained(first, pid) else ", own label set not trained"
        groups[kind].append((before, after))

    sizes = np.bincount(assignment[assignment >= 0])
    lines = [
        f"**{run_dir.name}**: {len(sizes)} clusters (largest {sizes.max()}, {int((sizes == 1).sum())} clients alone), "
        f"clustering round {clustered}",
        "",
        f"| client's cluster | clients | round {clustered} | round {first} | change |",
        "|---|---|---|---|---|",
    ]
    for kind, pairs in sorted(groups.items()):
        b, a = np.mean([p[0] for p in pairs]), np.mean([p[1] for p in pairs])
        lines.append(f"| {kind} | {len(pairs)} | {100 * b:.1f} | {100 * a:.1f} | {100 * (a - b):+.1f} |")

    trained, untrained = [], []
    last = max(rows)
    for round_number in range(first, last + 1):
        for pid in range(len(assignment)):
            if cluster_kind(pid, members[int(assignment[pid])], true) != "mixed label sets":
                continue
            value = accuracy(round_number, pid)
            if value is not None:
                (trained if own_label_set_trained(round_number, pid) else untrained).append(value)
    if trained or untrained:
        def cell(values: list[float]) -> str:
            return f"{100 * np.mean(values):.1f} % ({len(values)} client-rounds)" if values else "–"

        lines += [
            "",
            f"Clients in mixed clusters, rounds {first}..{last}: mean accuracy {cell(trained)} in rounds where a member "
            f"with their label set trained, {cell(untrained)} where none did.",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    args = parser.parse_args()
    text = "\n\n".join("\n".join(analyse(run_dir)) for run_dir in args.run_dirs)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
