"""The relevance matrix R of one-shot HFL (Ali & Arafa) against ``strategy.eigen_floor`` and k.

    OMP_NUM_THREADS=1 python benchmarks/oneshot/eigen_floor.py                 # seeds 0-5, k 5 and 200
    OMP_NUM_THREADS=1 python benchmarks/oneshot/eigen_floor.py --verify        # one cell through run_in_process too

The setting of ``conf/oneshot_fmnist_3tasks.yaml`` at full scale (10 users, 800 training images
each, Φ = identity, d = 784). Each user's summary and relevance row come from the clients' own task
handlers (``gram_eigen``, then ``relevance`` with the floor in the instruction's config), so the
numbers are what a run computes, without its training rounds; ``--verify`` checks one cell against
a real in-process run of the conf. R = (r + rᵀ)/2 (eq. 5); clusters: the conf's average linkage
into 3. Writes ``<out>/eigen_floor.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedcluster_flwr.client import TaskInput
from fedcluster_flwr.algorithms.oneshot.math import cluster_by_relevance, relevance_matrix, within_and_across
from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.algorithms.oneshot.strategy import feature_config
from fedcluster_flwr.algorithms.oneshot.tasks import (
    EIGEN_FLOOR_KEY, EIGENVALUES, EIGENVECTORS, NUM_EIGENVECTORS_KEY, RELEVANCE, relevance_to_every_client,
    top_gram_eigenpairs,
)
from sklearn.metrics import adjusted_rand_score

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "oneshot_fmnist_3tasks.yaml"


def relevance_for(seed: int, k: int, floors: list[float]) -> tuple[dict[float, np.ndarray], np.ndarray]:
    """R per floor for ``seed`` at ``k`` eigenvectors, and the true tasks."""
    config, _ = load_config(CONF, [("seed", seed), ("strategy.num_eigenvectors", k)])
    n = config.partition.num_clients
    clients = [Experiment(config).client(pid, n) for pid in range(n)]
    base = feature_config(config.strategy.options, 784, seed, share_eigenvalues=False)
    summaries = []
    for client in clients:
        blocks = top_gram_eigenpairs(client, TaskInput(1, {}, base | {NUM_EIGENVECTORS_KEY: k})).blocks
        summaries.append(blocks[EIGENVECTORS] + blocks[EIGENVALUES])
    out = {}
    for floor in floors:
        config_r = base | {EIGEN_FLOOR_KEY: floor}
        rows = np.stack([relevance_to_every_client(c, TaskInput(2, {EIGENVECTORS: summaries}, config_r)).blocks[RELEVANCE][0]
                         for c in clients])
        out[floor] = relevance_matrix(rows)
    return out, Experiment(config).data()[1].true_clusters


def verify(seed: int, k: int, floor: float, expected: np.ndarray) -> float:
    """Largest |R_run − R_here| of an in-process run of the conf (2 one-shot rounds + 1 training)."""
    from fedcluster_flwr.apps.server_app import run_in_process

    config, _ = load_config(CONF, [("seed", seed), ("rounds", 3), ("strategy.num_eigenvectors", k),
                                   ("strategy.eigen_floor", floor)])
    with tempfile.TemporaryDirectory() as folder:
        strategy = run_in_process(config, Path(folder) / "run")
    return float(np.abs(strategy.relevance - expected).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4,5")
    parser.add_argument("--ks", default="5,200")
    parser.add_argument("--floors", default="0,1e-6,1e-3,1e-2")
    parser.add_argument("--verify", action="store_true", help="check seed 0, the last k, floor 1e-3 against run_in_process")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fmnist_3tasks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    floors = [float(f) for f in args.floors.split(",")]
    start = time.time()
    stats: dict[tuple[int, float], list[tuple[float, float, float, float]]] = {}
    kept: dict[tuple[int, int, float], np.ndarray] = {}
    for seed in seeds:
        for k in ks:
            by_floor, true = relevance_for(seed, k, floors)
            for floor, r in by_floor.items():
                kept[(seed, k, floor)] = r
                within, across = within_and_across(r, true)
                mask = (true[:, None] == true[None, :]) & ~np.eye(len(true), dtype=bool)
                labels = cluster_by_relevance(r, "average", num_clusters=3).labels
                stats.setdefault((k, floor), []).append((within, across, float(r[mask].min()), adjusted_rand_score(true, labels)))
    lines = [
        f"R of `conf/oneshot_fmnist_3tasks.yaml` (10 users, 800 train images, Φ = identity, d = 784, paper's eq. 3) "
        f"against `strategy.eigen_floor`, seeds {args.seeds}; mean ± std over seeds ({time.time() - start:.0f} s).",
        "",
        "| k | eigen_floor | R within tasks | R across | gap | min R within | ARI (perfect) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (k, floor), rows in stats.items():
        a = np.asarray(rows)
        gap = a[:, 0] - a[:, 1]
        perfect = int(np.sum(a[:, 3] > 1 - 1e-9))
        lines.append(f"| {k} | {floor:g} | {a[:, 0].mean():.3f} ± {a[:, 0].std():.3f} | {a[:, 1].mean():.3f} ± {a[:, 1].std():.3f} "
                     f"| {gap.mean():.3f} ± {gap.std():.3f} | {a[:, 2].mean():.3f} | {a[:, 3].mean():.2f} ({perfect}/{len(a)}) |")
    if args.verify:
        k, floor = ks[-1], 1e-3 if 1e-3 in floors else floors[-1]
        diff = verify(seeds[0], k, floor, kept[(seeds[0], k, floor)])
        lines += ["", f"run_in_process (seed {seeds[0]}, k {k}, eigen_floor {floor:g}): max |R_run − R_here| = {diff:.2e}"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eigen_floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
