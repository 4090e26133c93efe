"""Time and peak memory of the server's clustering step for N clients x d parameters, against scipy.

    python benchmarks/clustering/run.py                        # the sweep: N in {100, 300, 1000} x l1/l2/cosine
    python benchmarks/clustering/run.py --clients 1000 --repeat 2   # only N = 1000, twice, interleaved
    python benchmarks/clustering/run.py case --clients 1000 --distance l1          # one case, here
    python benchmarks/clustering/run.py case --clients 1000 --distance cosine --projection-dim 1024

A case builds the update matrix the way FL+HC does (one float32 row per client update as it
arrives, projected on arrival with --projection-dim) from synthetic updates in 4 groups, then
times the pairwise distances (``fedcluster_flwr.clustering.pairwise_distances``, or with
``--impl scipy`` ``scipy.spatial.distance.pdist``) and scipy's linkage, and checks that the 4
groups are recovered (ARI). The fedcluster_flwr it imports is the one on the path: the sweep's
``--baseline /path/to/other/checkout`` runs every case with that checkout's code too, first
(interleaved), and each case records the commit its code came from.

Memory, from /proc/self/status, in GiB: ``peak_gb`` is the process's peak resident set (VmHWM, as
ru_maxrss: matrix included), ``step_gb`` the peak of the clustering step above the resident set
when it started (VmHWM reset through /proc/self/clear_refs). ``step_cpu_s``: the step's CPU
seconds (all threads), what it costs when the machine is shared.

The sweep runs every case in a fresh process (so each peak is its own) and appends the cases'
JSON to ``results/results.json``, then writes ``results/results.md`` from all recorded cases.
scipy runs at the N of ``--scipy-clients`` (default 100, 300): it converts the whole matrix to
float64 (2x its size) and computes in one thread, which at N = 1000 would need about 19 GiB and
more than 10 minutes per distance. There, the case also reports the largest relative difference
between our distances and scipy's (float64).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fedcluster_flwr.clustering import UpdateMatrix, cluster_condensed, cluster_scores, pairwise_distances
from fedcluster_flwr.numerics import cpu_identity
from fedcluster_flwr.results.provenance import code_version

HERE = Path(__file__).resolve().parent
DIM = 1_663_370  # cnn_briggs on MNIST
GROUPS = 4
LINKAGE = {"l1": "complete", "l2": "ward", "cosine": "average"}  # the shipped FL+HC confs' pairs
SCIPY_METRIC = {"l1": "cityblock", "l2": "euclidean", "cosine": "cosine"}


def synthetic_update(row: int, dim: int, centres: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A client update: its group's direction (one of 4) plus noise."""
    update = rng.standard_normal(dim, dtype=np.float32)
    update += 2.0 * centres[row % GROUPS]
    return update


def memory_status(field: str) -> float | None:
    """``VmHWM`` or ``VmRSS`` of this process in GiB (None where /proc is not available)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run_case(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((GROUPS, args.dim), dtype=np.float32)
    started = time.perf_counter()
    matrix = UpdateMatrix(args.clients, args.dim, args.projection_dim, seed=0)
    for row in range(args.clients):
        matrix.set_row(row, synthetic_update(row, args.dim, centres, rng))
    del centres
    fill_s = time.perf_counter() - started
    load_before = os.getloadavg()[0]
    rss_before = memory_status("VmRSS")
    step_measured = reset_peak()
    started, cpu_started = time.perf_counter(), time.process_time()
    if args.impl == "scipy":
        from scipy.spatial.distance import pdist

        distances = pdist(matrix.rows, SCIPY_METRIC[args.distance])
    else:
        distances = pairwise_distances(matrix.rows, args.distance)
    distances_s = time.perf_counter() - started
    result = cluster_condensed(distances, args.clients, args.linkage or LINKAGE[args.distance], num_clusters=GROUPS)
    step_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    peak = memory_status("VmHWM")
    case = {
        "clients": args.clients, "dim": args.dim, "distance": args.distance,
        "linkage": args.linkage or LINKAGE[args.distance], "projection_dim": args.projection_dim, "impl": args.impl,
        "fill_s": round(fill_s, 2), "distances_s": round(distances_s, 2), "linkage_s": round(step_s - distances_s, 2),
        "step_s": round(step_s, 2), "step_cpu_s": round(cpu_s, 2),
        "peak_gb": round(peak, 3) if peak is not None else None,
        "step_gb": round(peak - rss_before, 3) if step_measured and peak is not None and rss_before else None,
        "matrix_gb": round(matrix.rows.nbytes / 2**30, 3),
        "ari": round(cluster_scores(np.arange(args.clients) % GROUPS, result.labels)["ari"], 4),
        "cores": len(os.sched_getaffinity(0)),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "cpu": cpu_identity()[1], "when": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": code_version(),
    }
    if args.save_distances:
        np.save(args.save_distances, distances)
    if args.compare_with:
        ours = np.load(args.compare_with)
        positive = distances > 0
        scipy_values = distances[positive]
        case["max_rel_error_vs_scipy"] = float(np.max(np.abs(ours[positive] - scipy_values) / scipy_values))
    return case


def sweep(args: argparse.Namespace) -> None:
    results_file = HERE / "results" / "results.json"
    recorded = json.loads(results_file.read_text()) if results_file.is_file() else []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeat):  # interleaved: every case once, then again
            for clients in args.clients:
                for distance in args.distances:
                    ours = Path(folder) / f"{clients}_{distance}.npy"
                    runs = [("fedcluster", args.baseline)] if args.baseline else []
                    runs += [("fedcluster", None)] + ([("scipy", None)] if clients in args.scipy_clients else [])
                    for impl, code in runs:
                        command = [sys.executable, __file__, "case", "--clients", str(clients), "--dim", str(args.dim),
                                   "--distance", distance, "--impl", impl]
                        if code is None:
                            command += ["--save-distances" if impl == "fedcluster" else "--compare-with", str(ours)]
                        env = dict(os.environ, PYTHONPATH=str(code)) if code else None
                        done = subprocess.run(command, capture_output=True, text=True, env=env)
                        if done.returncode != 0:
                            print(done.stderr, file=sys.stderr)
                            raise SystemExit(f"case failed: {' '.join(command)}")
                        case = json.loads(done.stdout.strip().splitlines()[-1])
                        print(json.dumps(case), flush=True)
                        recorded.append(case)
                        results_file.write_text(json.dumps(recorded, indent=1) + "\n")
    (HERE / "results" / "results.md").write_text(table(recorded))


def table(cases: list[dict]) -> str:
    """Every recorded case, one row each, ordered by N, distance and implementation."""
    lines = [
        "| N | d | distance / linkage | impl | distances s | linkage s | step s | step CPU s | peak GiB | step GiB "
        "| matrix GiB | max rel. error vs scipy | ARI | fill s | load before / after | when | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"l1": 0, "l2": 1, "cosine": 2}
    def key(c: dict) -> tuple:
        return c["clients"], c["projection_dim"] or 0, order[c["distance"]], c["impl"], c["when"]

    for c in sorted(cases, key=key):
        error = c.get("max_rel_error_vs_scipy")
        projection = f" (projected to {c['projection_dim']})" if c["projection_dim"] else ""
        lines.append(
            f"| {c['clients']} | {c['dim']}{projection} | {c['distance']} / {c['linkage']} | {c['impl']} "
            f"| {c['distances_s']} "
            f"| {c['linkage_s']} | {c['step_s']} | {c.get('step_cpu_s', '–')} | {c['peak_gb']} | {c['step_gb']} "
            f"| {c['matrix_gb']} | {'–' if error is None else f'{error:.1e}'} | {c['ari']} | {c['fill_s']} "
            f"| {c['load_before']} / {c['load_after']} | {c['when']} | {c.get('commit', '–')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("case", help="one case in this process; prints its JSON")
    one.add_argument("--clients", type=int, default=1000)
    one.add_argument("--dim", type=int, default=DIM)
    one.add_argument("--distance", choices=tuple(LINKAGE), default="l1")
    one.add_argument("--linkage", help="default: l1 complete, l2 ward, cosine average")
    one.add_argument("--projection-dim", type=int)
    one.add_argument("--impl", choices=("fedcluster", "scipy"), default="fedcluster")
    one.add_argument("--save-distances", type=Path)
    one.add_argument("--compare-with", type=Path, help="a fedcluster case's distances: report the largest difference")
    parser.add_argument("--clients", type=lambda s: [int(n) for n in s.split(",")], default=[100, 300, 1000])
    parser.add_argument("--distances", type=lambda s: s.split(","), default=list(LINKAGE))
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--scipy-clients", type=lambda s: [int(n) for n in s.split(",")], default=[100, 300])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another checkout whose fedcluster_flwr also runs every case")
    parser.add_argument("--table", action="store_true", help="only rewrite results.md from results.json")
    args = parser.parse_args()
    if args.command == "case":
        print(json.dumps(run_case(args)))
    elif args.table:
        (HERE / "results" / "results.md").write_text(table(json.loads((HERE / "results" / "results.json").read_text())))
    else:
        sweep(args)


if __name__ == "__main__":
    main()
