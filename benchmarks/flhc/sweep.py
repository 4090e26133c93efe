"""FL+HC threshold sweep that shares the rounds before clustering (Briggs et al.'s Table IV protocol),
as a table that resumes: stop it at any moment, run the same command again and it continues.

Briggs et al. report, for each distance x linkage, the best result over a range of
thresholds. Every FL+HC run is FedAvg until the clustering round n + 1, so the sweep runs
those n rounds once and branches the rest:

1. ``base``: the config's first n rounds (``fedcluster run --stop-after n``).
2. ``probe``: a branch of ``base`` that runs only the clustering round and saves the client
   updates (``probe/updates.npy``: 4 bytes x clients x parameters), to measure each distance's
   scale: for every method (``l1/complete``, ...) and every target number of clusters K, the
   threshold midway between the two merge heights that give K clusters (``thresholds.json``).
3. one branch of ``base`` per method x threshold (``fedcluster resume base --out ... --set
   strategy.threshold=...``), run to the config's last round; K = N (every client its own
   cluster) is the same for every method and runs once.
4. the baselines (``fedavg`` by default; ``local``) from scratch on the same partition.

Every step resumes (:mod:`tables`): the base from its last checkpoint, a stopped branch or baseline
from its own, finished runs are kept. Run folders go to ``--runs-dir`` (default
``$FEDCLUSTER_TABLES_DIR/flhc_sweep_<conf>``, else ``~/fedcluster-tables/flhc_sweep_<conf>``: the
probe's updates are 665 MB at the paper's scale); each finished run's small files, the base's and
the thresholds are copied into ``--results-dir`` (default ``benchmarks/flhc/results/full/<conf>/``)
with the page ``sweep.md`` (and ``sweep.json``), rewritten after every finished run. ``--engine``
(default Flower's Ray engine) is how the rounds execute, not what they compute: ``inprocess`` is
the Ray engine's rounds bit for bit in one process. ``--set simulation.*`` settings apply to
every run, e.g. a base made on a GPU branched on a CPU with ``--set simulation.num_gpus_per_client=0``.

    python benchmarks/flhc/sweep.py conf/flhc_mnist_pathological.yaml \\
        --methods l1/complete l2/complete cosine/complete --clusters 10,25,50,75,100 [--set KEY=VALUE ...]
    python benchmarks/flhc/sweep.py conf/flhc_mnist_pathological.yaml --list     # every run and its state
    python benchmarks/flhc/sweep.py conf/flhc_mnist_pathological.yaml --render   # only the page
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy.cluster import hierarchy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import value_at  # noqa: E402
from tables import (  # noqa: E402
    Branch, TableRun, add_table_arguments, advance, default_runs_root, keep_small_files, main_loop, record_attempt,
    recorded_attempts, set_aside, with_engine,
)

from fedcluster_flwr.results.checkpoints import checkpoint_round  # noqa: E402
from fedcluster_flwr.clustering import cluster_scores, pairwise_distances  # noqa: E402
from fedcluster_flwr.config.load import config_differences, config_to_dict, load_config, parse_override  # noqa: E402
from fedcluster_flwr.config.sections import ExperimentConfig  # noqa: E402
from fedcluster_flwr.declarations.schema import ConfigError  # noqa: E402
from fedcluster_flwr.results.files import atomic_write  # noqa: E402
from fedcluster_flwr.results.run_files import read_rounds  # noqa: E402
from fedcluster_flwr.runner import Interrupted, plan_continuation, run_experiment  # noqa: E402

BASE, PROBE = "base", "probe"
RESULTS = Path(__file__).resolve().parent / "results" / "full"


def run_base(config: ExperimentConfig, runs_root: Path, shared_rounds: int, engine: str, workers: int | None) -> Path:
    """The shared rounds 1..n in ``<runs_root>/base``: started, continued from its last checkpoint,
    or reused if a base of the same config (``simulation`` settings aside: where it ran) stopped there."""
    base = runs_root / BASE
    done = checkpoint_round(base)
    if done is not None:
        made_with, _ = load_config(base / "config.yaml", [])
        changed = [key for key, _, _ in config_differences(config_to_dict(made_with), config_to_dict(config), ("simulation",))]
        if changed or done > shared_rounds:
            why = f"was made with another {', '.join(changed)}" if changed else f"is at round {done}, past {shared_rounds}"
            raise SystemExit(f"{base} {why}; give the sweep another --runs-dir (or delete {base} and every branch beside it)")
        if done == shared_rounds:
            return base
    elif base.exists():
        print(f"{BASE}: set aside {set_aside(base).name} (stopped before its first checkpoint)", flush=True)
    print(f"{BASE}: shared rounds {(done or 0) + 1}..{shared_rounds} of {config.rounds} on {engine} -> {base}", flush=True)
    started = time.perf_counter()
    try:
        run_experiment(with_engine(config, engine, workers), base, resume_from=done or 0, stop_after=shared_rounds)
    finally:
        if base.is_dir():
            record_attempt(base, engine, time.perf_counter() - started, done or 0)
    return base


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
    base: Path, runs_root: Path, results_dir: Path, config: ExperimentConfig, methods: list[tuple[str, str]],
    targets: list[int], engine: str, workers: int | None, settings: list[str],
) -> dict[str, Any]:
    """Thresholds per method and target K, measured on the clustering round's updates
    (``<runs_root>/probe/updates.npy``); cached in ``thresholds.json``, which grows as later
    invocations ask for other methods or K."""
    cached = runs_root / "thresholds.json"
    cuts: dict[str, Any] = json.loads(cached.read_text()) if cached.is_file() else {"methods": {}}
    missing = [
        (distance, linkage) for distance, linkage in methods
        if not {c["target_clusters"] for c in cuts["methods"].get(f"{distance}/{linkage}", {}).get("cuts", [])} >= set(targets)
    ]
    if not missing:
        return cuts
    clustering_round = config.strategy.options.rounds_before_clustering + 1
    probe = runs_root / PROBE
    overrides = ("strategy.save_updates=true", "strategy.threshold=null", "strategy.num_clusters=1",
                 f"rounds={clustering_round}", *settings)
    probe_run = TableRun(PROBE, plan_continuation(base, out=probe, overrides=overrides).config, branch=Branch(base, overrides))
    advance([probe_run], runs_root=runs_root, results_dir=results_dir, engine=engine, workers=workers,
            reuse_kept=False)  # its updates.npy, in the run folder, is what the thresholds are measured on
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


def attempts_of(run_dir: Path) -> tuple[float, str | None]:
    """A run's own seconds over every attempt (a resumed run has several) and where it ran: from
    ``machine.json`` (:func:`tables.record_attempt`), or what sweeps before it kept (``timing.json``;
    for their base, its summary's wall time)."""
    if attempts := recorded_attempts(run_dir):
        places = dict.fromkeys(
            a["device"] if a["device"] != "cpu" else f"CPU, {a['cpu_count']} cores, {a['engine']}" for a in attempts)
        return sum(a["seconds"] for a in attempts), "; ".join(places) or None
    if (timing := run_dir / "timing.json").is_file():
        recorded = json.loads(timing.read_text())
        return float(recorded["seconds"]), recorded.get("machine")
    if (summary := run_dir / "summary.json").is_file():
        return float(json.loads(summary.read_text()).get("wall_seconds", float("nan"))), None
    return float("nan"), None


def table_row(name: str, run_dir: Path, summary: dict[str, Any], at: int, extra: dict[str, Any]) -> dict[str, Any]:
    after = value_at(read_rounds(run_dir), "mean_client_accuracy", at)
    seconds, machine = attempts_of(run_dir)
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
        "machine": machine,
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


def sweep_runs(
    conf: str, cuts: dict[str, Any], methods: list[tuple[str, str]], targets: list[int], baselines: list[str],
    base: Path, overrides: list[str],
) -> list[TableRun]:
    """The branches of ``base`` (every method at each K in the order asked, so a table that stops early
    has the first K for every method; K = N once, as ``singletons``) and the baselines; ``overrides``:
    the sweep's ``--set`` (its ``simulation.*`` ones also the branches')."""
    settings = [item for item in overrides if item.startswith("simulation.")]
    count = cuts["clustered_clients"]
    runs, names = [], set()
    for k in targets:
        for distance, linkage in methods:
            method = f"{distance}/{linkage}"
            cut = next((c for c in cuts["methods"].get(method, {}).get("cuts", []) if c["target_clusters"] == k), None)
            if cut is None:
                continue
            alone = cut["clusters"] == count  # every client its own cluster: the same run whatever the method
            name = "singletons" if alone else f"{distance}_{linkage}_{cut['threshold']:g}"
            if name in names:
                continue
            names.add(name)
            branch = (f"strategy.distance={distance}", f"strategy.linkage={linkage}",
                      f"strategy.threshold={cut['threshold']!r}", "strategy.num_clusters=null", *settings)
            config, _ = load_config(conf, [parse_override(i) for i in (*overrides, *branch)])  # the branch's config
            title = "every client its own cluster" if alone else f"{method}, K≈{k}"
            runs.append(TableRun(name, config, {"title": title, "method": None if alone else method,
                                                "threshold": cut["threshold"]}, Branch(base, branch)))
    for name in baselines:
        config, _ = load_config(conf, [parse_override(i) for i in overrides] + [("strategy.name", name)])
        runs.append(TableRun(name, config, {"title": name, "method": None, "threshold": None}))
    return runs


def render(results_dir: Path, runs: list[TableRun], config: ExperimentConfig) -> None:
    """``sweep.md`` and ``sweep.json`` in ``results_dir``, from the copies of the runs that finished."""
    shared = config.strategy.options.rounds_before_clustering
    at = shared + 1
    rows = []
    for run in runs:
        summary_file = results_dir / run.name / "summary.json"
        if summary_file.is_file() and (summary := json.loads(summary_file.read_text())).get("finished"):
            rows.append(table_row(run.labels["title"], results_dir / run.name, summary, at,
                                  {"method": run.labels["method"], "threshold": run.labels["threshold"], "dir": run.name}))
    base_seconds, base_machine = attempts_of(results_dir / BASE)
    note = (
        f"\nMinutes: a branch's own rounds {at}..{config.rounds}, over every attempt (the shared rounds 1..{shared} "
        f"of `{BASE}` took {base_seconds / 60:.1f} min once{f', on {base_machine}' if base_machine else ''}); "
        "a baseline's whole run. Wall time, beside whatever else the machine ran and including any time a "
        "run sat paused: not an engine timing."
    )
    table = markdown(rows, at, config.rounds, config.target_accuracy)
    thresholds = results_dir / "thresholds.json"
    atomic_write(results_dir / "sweep.md", table + "\n" + note + "\n")  # another sweep command may render too
    atomic_write(results_dir / "sweep.json", json.dumps(
        {"rows": rows, "thresholds": json.loads(thresholds.read_text()) if thresholds.is_file() else None}, indent=2) + "\n")
    print(table + "\n" + note, flush=True)


def keep_shared_files(runs_root: Path, results_dir: Path) -> None:
    """The base's small files (it never finishes: it stops at round n) and the thresholds, into ``results_dir``."""
    keep_small_files(runs_root / BASE, results_dir)
    if (runs_root / "thresholds.json").is_file():
        shutil.copy2(runs_root / "thresholds.json", results_dir / "thresholds.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    add_table_arguments(parser, default_engine="ray")
    parser.add_argument("--methods", nargs="+", default=["l1/complete", "l2/complete", "cosine/complete"])
    parser.add_argument("--clusters", default="10,25,50,75",
                        help="target numbers of clusters, run in this order, every method at one K before the "
                             "next (N: every client alone)")
    parser.add_argument("--baselines", default="fedavg", help="comma-separated strategies run from scratch ('' for none)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable); simulation.* ones also apply to the branches")
    parser.add_argument("--thresholds-only", action="store_true",
                        help="run the shared rounds and the probe, print the thresholds per method and K, stop")
    args = parser.parse_args()

    config, _ = load_config(args.config, [parse_override(item) for item in args.set])
    if config.strategy.name != "flhc":
        raise SystemExit(f"{args.config}: strategy.name is {config.strategy.name!r}; the sweep branches an flhc run")
    table = f"flhc_sweep_{Path(args.config).stem}"
    args.runs_dir = (args.runs_dir or default_runs_root() / table).resolve()
    results_dir = (args.results_dir or RESULTS / Path(args.config).stem).resolve()
    runs_root = args.runs_dir
    methods = parse_methods(args.methods)
    targets = list(dict.fromkeys(int(k) for k in args.clusters.split(",") if k.strip()))  # in the order given
    baselines = [n.strip() for n in args.baselines.split(",") if n.strip()]
    # simulation.* settings also apply to the branches, e.g. to continue a GPU-made base on a CPU.
    settings = [item for item in args.set if item.startswith("simulation.")]
    workers = args.workers or None
    if args.list or args.render:
        found = [path for path in (runs_root / "thresholds.json", results_dir / "thresholds.json") if path.is_file()]
        if not found:
            raise SystemExit(f"neither {runs_root} nor {results_dir} holds thresholds yet: run the sweep "
                             "(or --thresholds-only) first")
        cuts = json.loads(found[0].read_text())
    else:
        try:
            base = run_base(config, runs_root, config.strategy.options.rounds_before_clustering, args.engine, workers)
            cuts = probe_cuts(base, runs_root, results_dir, config, methods, targets, args.engine, workers, settings)
        except Interrupted as stop:
            print(f"stopped: {stop}; run the same command again to continue", file=sys.stderr)
            return stop.exit_code
        keep_shared_files(runs_root, results_dir)
    if args.thresholds_only:
        for method, info in cuts["methods"].items():
            print(f"{method}: distances {info['min_distance']:.4g} .. {info['max_distance']:.4g}")
            for c in info["cuts"]:
                print(f"  K={c['target_clusters']}: threshold {c['threshold']:g} -> {c['clusters']} clusters, "
                      f"purity {c['purity']:.2f}, ARI {c['ari']:.2f}, largest {c['largest']}")
        return 0
    runs = sweep_runs(args.config, cuts, methods, targets, baselines, runs_root / BASE, args.set)
    args.results_dir = results_dir
    return main_loop(runs, args, table, results_dir, lambda where: render(where, runs, config))


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
