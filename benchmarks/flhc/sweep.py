"""FL+HC threshold sweep that shares the rounds before clustering (Briggs et al.'s Table IV protocol).

Briggs et al. report, for each distance x linkage, the best result over a range of
thresholds. Every FL+HC run is FedAvg until the clustering round n + 1, so the sweep runs
those n rounds once and branches the rest:

1. ``base``: the config's first n rounds (``fedcluster run --stop-after n``).
2. ``probe``: a branch of ``base`` that runs only the clustering round and saves the client
   updates (``probe/updates.npy``: 4 bytes x clients x parameters), to measure each distance's scale: for every method (``l1/complete``, ...) and
   every target number of clusters K, the threshold midway between the two merge heights
   that give K clusters.
3. one branch of ``base`` per method x threshold (``fedcluster resume base --out ... --set
   strategy.threshold=...``), run to the config's last round; K = N (every client its own
   cluster) is the same for every method and runs once.
4. the baselines (``fedavg`` by default; ``local``) from scratch on the same partition.

``--set simulation.*`` settings also apply to the branches (a base made on a GPU can be
branched on a CPU with ``--set simulation.num_gpus_per_client=0``); ``--table-only`` runs
nothing and tabulates the runs that finished.

Every run goes through Flower's Ray engine; a run that finished earlier in ``--out`` is
reused, so an interrupted sweep continues where it stopped. The table goes to
``<out>/sweep.md`` and ``<out>/sweep.json``.

    python benchmarks/flhc/sweep.py conf/flhc_mnist_pathological.yaml --out DIR \\
        --methods l1/complete l2/complete cosine/complete --clusters 10,25,50,75,100 [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.cluster import hierarchy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import finished_summary, run_or_reuse, value_at  # noqa: E402

from fedcluster_flwr.clustering import cluster_scores, pairwise_distances  # noqa: E402
from fedcluster_flwr.config import config_to_dict, load_config, parse_override  # noqa: E402
from fedcluster_flwr.config_sections import ExperimentConfig  # noqa: E402
from fedcluster_flwr.schema import ConfigError  # noqa: E402
from fedcluster_flwr.run_files import read_rounds  # noqa: E402
from fedcluster_flwr.runner import continue_run, plan_continuation, run_experiment  # noqa: E402

BASE, PROBE = "base", "probe"


def checkpoint_round(run_dir: Path) -> int | None:
    state = run_dir / "checkpoint" / "state.json"
    return int(json.loads(state.read_text())["round"]) if state.is_file() else None


def run_base(config: ExperimentConfig, out: Path, shared_rounds: int) -> Path:
    """The shared rounds 1..n in ``<out>/base``, reused if a base of the same config (``simulation``
    settings aside: where it ran) stopped there."""
    base = out / BASE
    if not base.exists():
        print(f"shared rounds 1..{shared_rounds} of {config.rounds} -> {base}", flush=True)
        run_experiment(config, base, stop_after=shared_rounds)
        return base
    made_with, _ = load_config(base / "config.yaml", [])

    def experiment(c: ExperimentConfig) -> dict[str, Any]:
        return {k: v for k, v in config_to_dict(c).items() if k != "simulation"}

    if experiment(made_with) != experiment(config) or checkpoint_round(base) != shared_rounds:
        raise SystemExit(
            f"{base} was made with another config or holds no checkpoint at round {shared_rounds}; "
            f"give the sweep a new --out (or delete {base} and every branch beside it)"
        )
    return base


def branch(base: Path, target: Path, overrides: list[str], rounds: int | None = None) -> tuple[dict[str, Any], float]:
    """The summary of a branch of ``base`` with ``overrides`` (reused if it finished) and its own seconds."""
    if (summary := finished_summary(target)) is not None:
        return summary, float(json.loads((target / "timing.json").read_text())["seconds"])
    if target.exists():
        raise SystemExit(f"{target} holds an unfinished branch; delete it and run the sweep again")
    started = time.perf_counter()
    summary = continue_run(plan_continuation(base, out=target, overrides=overrides, rounds=rounds))
    seconds = time.perf_counter() - started
    (target / "timing.json").write_text(json.dumps({"seconds": seconds, "machine": machine()}) + "\n")
    return summary, seconds


def machine() -> str:
    """Where the clients trained: the GPU's name, or the CPU's core count."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU, {os.cpu_count()} cores"


def thresholds_for(heights: np.ndarray, count: int, targets: list[int]) -> dict[int, float]:
    """For each K in ``targets``, a threshold cutting a dendrogram with merge ``heights`` into K
    clusters: midway between the (count-K)-th and (count-K+1)-th smallest heights."""
    ordered = np.sort(heights)
    chosen = {}
    for k in targets:
        if not 1 <= k <= count:
            raise SystemExit(f"--clusters: {k} clusters of {count} clustered clients is impossible")
        below = ordered[count - k - 1] if count - k - 1 >= 0 else 0.0
        above = ordered[count - k] if count - k < len(ordered) else ordered[-1] * 2
        threshold = (below + above) / 2 if below > 0 else above / 2
        rounded = float(f"{threshold:.4g}")
        chosen[k] = rounded if below < rounded < above or (below == 0 and rounded < above) else float(threshold)
    return chosen


def probe_cuts(
    base: Path, out: Path, config: ExperimentConfig, methods: list[tuple[str, str]], targets: list[int]
) -> dict[str, Any]:
    """Thresholds per method and target K, measured on the clustering round's updates
    (``<out>/probe/updates.npy``); cached in ``<out>/thresholds.json``, which grows as later
    invocations ask for other methods or K."""
    cached = out / "thresholds.json"
    cuts: dict[str, Any] = json.loads(cached.read_text()) if cached.is_file() else {"methods": {}}
    missing = [
        (distance, linkage) for distance, linkage in methods
        if not {c["target_clusters"] for c in cuts["methods"].get(f"{distance}/{linkage}", {}).get("cuts", [])} >= set(targets)
    ]
    if not missing:
        return cuts
    clustering_round = config.strategy.options.rounds_before_clustering + 1
    probe = out / PROBE
    branch(base, probe, ["strategy.save_updates=true", "strategy.threshold=null", "strategy.num_clusters=1"],
           rounds=clustering_round)
    if not (probe / "updates.npy").is_file():
        raise SystemExit(f"{probe}/updates.npy is gone; delete {probe} to measure the thresholds again")
    updates = np.load(probe / "updates.npy")
    summary = json.loads((probe / "summary.json").read_text())
    true = np.asarray(summary["true_clusters"])[summary["clustered_clients"]]
    cuts["clustered_clients"] = len(updates)
    for distance, linkage in missing:
        condensed = pairwise_distances(updates, distance)
        tree = hierarchy.linkage(condensed, method=linkage)
        entry = cuts["methods"].setdefault(f"{distance}/{linkage}", {"cuts": []})
        entry.update(min_distance=float(condensed.min()), median_distance=float(np.median(condensed)),
                     max_distance=float(condensed.max()))
        known = {c["target_clusters"] for c in entry["cuts"]}
        for k, threshold in thresholds_for(tree[:, 2], len(updates), [k for k in targets if k not in known]).items():
            labels = hierarchy.fcluster(tree, t=threshold, criterion="distance")
            scores = cluster_scores(true, labels)
            entry["cuts"].append({
                "target_clusters": k, "threshold": threshold, "clusters": int(labels.max()),
                "purity": scores["purity"], "ari": scores["ari"], "largest": int(np.bincount(labels).max()),
            })
        entry["cuts"].sort(key=lambda c: c["target_clusters"])
    cached.write_text(json.dumps(cuts, indent=2) + "\n")
    return cuts


def table_row(name: str, run_dir: Path, summary: dict[str, Any], seconds: float, at: int, extra: dict[str, Any]) -> dict[str, Any]:
    after = value_at(read_rounds(run_dir), "mean_client_accuracy", at)
    return {
        "run": name,
        **extra,
        f"accuracy_round_{at}": after,
        "accuracy_last": summary["mean_client_accuracy"],
        "best_accuracy": summary["best_mean_client_accuracy"],
        "pct_over_target_last": summary["pct_clients_over_target"],
        "rounds_to_target": summary["rounds_to_target"],
        "clusters_found": summary.get("clusters_found"),
        "purity": summary.get("purity"),
        "ari": summary.get("ari"),
        "gigabytes_up": summary["bytes_up"] / 1e9,
        "seconds": seconds,
        "machine": json.loads(timing.read_text()).get("machine") if (timing := run_dir / "timing.json").is_file() else None,
    }


def markdown(rows: list[dict[str, Any]], at: int, last: int, target: float) -> str:
    def pct(v: Any) -> str:
        return "–" if v is None else f"{100 * v:.1f}"

    def num(v: Any, spec: str) -> str:
        return "–" if v is None else format(v, spec)

    lines = [
        f"| run | threshold | clusters (purity, ARI) | round {at} | round {last} | best | % clients ≥ {100 * target:g} % at {last} "
        "| rounds to target | GB up | minutes | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        clusters = "–" if r["clusters_found"] is None else f"{r['clusters_found']} ({num(r['purity'], '.2f')}, {num(r['ari'], '.2f')})"
        lines.append(
            f"| {r['run']} | {num(r.get('threshold'), 'g')} | {clusters} | {pct(r[f'accuracy_round_{at}'])} "
            f"| {pct(r['accuracy_last'])} | {pct(r['best_accuracy'])} | {num(r['pct_over_target_last'], '.0f')} "
            f"| {num(r['rounds_to_target'], 'd')} | {r['gigabytes_up']:.1f} | {r['seconds'] / 60:.1f} | {r.get('machine') or '–'} |"
        )
    return "\n".join(lines)


def parse_methods(values: list[str]) -> list[tuple[str, str]]:
    methods = []
    for value in values:
        distance, _, linkage = value.partition("/")
        if not linkage:
            raise SystemExit(f"--methods: {value!r} is not DISTANCE/LINKAGE, e.g. l1/complete")
        methods.append((distance, linkage))
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--methods", nargs="+", default=["l1/complete", "l2/complete", "cosine/complete"])
    parser.add_argument("--clusters", default="10,25,50,75",
                        help="target numbers of clusters, run in this order (N: every client alone)")
    parser.add_argument("--baselines", default="fedavg", help="comma-separated strategies run from scratch ('' for none)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--thresholds-only", action="store_true",
                        help="run the shared rounds and the probe, print the thresholds per method and K, stop")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: the table of the runs in --out that finished")
    args = parser.parse_args()

    config, _ = load_config(args.config, [parse_override(item) for item in args.set])
    if config.strategy.name != "flhc":
        raise SystemExit(f"{args.config}: strategy.name is {config.strategy.name!r}; the sweep branches an flhc run")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    methods = parse_methods(args.methods)
    targets = list(dict.fromkeys(int(k) for k in args.clusters.split(",") if k.strip()))  # in the order given
    shared = config.strategy.options.rounds_before_clustering
    clustering_round = shared + 1

    # simulation.* settings also apply to the branches, e.g. to continue a GPU-made base on a CPU.
    branch_settings = [item for item in args.set if item.startswith("simulation.")]
    started = time.perf_counter()
    if args.table_only:
        base, cuts = out / BASE, json.loads((out / "thresholds.json").read_text())
    else:
        base = run_base(config, out, shared)
        cuts = probe_cuts(base, out, config, methods, targets)
    count = cuts["clustered_clients"]
    if args.thresholds_only:
        for method, info in cuts["methods"].items():
            print(f"{method}: distances {info['min_distance']:.4g} .. {info['max_distance']:.4g}")
            for c in info["cuts"]:
                print(f"  K={c['target_clusters']}: threshold {c['threshold']:g} -> {c['clusters']} clusters, "
                      f"purity {c['purity']:.2f}, ARI {c['ari']:.2f}, largest {c['largest']}")
        return
    rows = []
    singleton_done = False
    for distance, linkage in methods:
        method = f"{distance}/{linkage}"
        for cut in [c for k in targets for c in cuts["methods"][method]["cuts"] if c["target_clusters"] == k]:
            if cut["clusters"] == count:  # every client alone: the same run whatever the method
                if singleton_done:
                    continue
                singleton_done, name = True, "every client its own cluster"
            else:
                name = f"{method}, K≈{cut['target_clusters']}"
            run_dir = out / ("singletons" if cut["clusters"] == count else f"{distance}_{linkage}_{cut['threshold']:g}")
            if args.table_only and finished_summary(run_dir) is None:
                continue
            summary, seconds = branch(base, run_dir, [
                f"strategy.distance={distance}", f"strategy.linkage={linkage}",
                f"strategy.threshold={cut['threshold']!r}", "strategy.num_clusters=null", *branch_settings,
            ])
            rows.append(table_row(name, run_dir, summary, seconds, clustering_round,
                                  {"method": method, "threshold": cut["threshold"], "dir": run_dir.name}))
            print(markdown(rows[-1:], clustering_round, config.rounds, config.target_accuracy).splitlines()[-1], flush=True)
    for name in [n.strip() for n in args.baselines.split(",") if n.strip()]:
        if args.table_only and finished_summary(out / name) is None:
            continue
        baseline, _ = load_config(args.config, [parse_override(i) for i in args.set] + [("strategy.name", name)])
        summary = run_or_reuse(baseline, out / name)
        rows.append(table_row(name, out / name, summary, summary["wall_seconds"], clustering_round,
                              {"method": None, "threshold": None, "dir": name}))
    table = markdown(rows, clustering_round, config.rounds, config.target_accuracy)
    total = time.perf_counter() - started
    base_summary = json.loads((base / "summary.json").read_text())
    note = (
        f"\nMinutes: a branch's own rounds {clustering_round}..{config.rounds} (the shared rounds 1..{shared} of "
        f"`{BASE}` took {base_summary.get('wall_seconds', 0) / 60:.1f} min once); a baseline's whole run. "
        f"This invocation: {total / 60:.1f} min (reused runs count 0)."
    )
    (out / "sweep.md").write_text(table + "\n" + note + "\n")
    (out / "sweep.json").write_text(json.dumps({"rows": rows, "thresholds": cuts, "seconds": total}, indent=2) + "\n")
    print(table + "\n" + note)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
