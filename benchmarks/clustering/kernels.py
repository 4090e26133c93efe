"""Which kernel and which threading for the pairwise distances: the candidates on one N x d matrix.

    python benchmarks/clustering/kernels.py                       # N = 1000, d = 20,000 (l1) / 100,000 (Gram)
    python benchmarks/clustering/kernels.py --repeat 3 --out results/kernels.md

Every candidate computes the same distances of a random float32 matrix; the candidates run
interleaved (a b c ..., a b c ..., as often as --repeat), each reporting wall and CPU seconds
and throughput: l1 in pairs x columns per second, the Gram products in flop/s. ``ours`` is
``fedcluster_flwr.clustering.pairwise_distances``: one worker thread per core, each with a
single-threaded torch, summing its share of the column blocks (for l1 with the compiled kernel
of ``fedcluster_flwr.l1_kernel``); ``workers`` runs another kernel on the same workers;
``torch threads`` runs the same blocks one after another with torch's own thread pool (all
cores) instead.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from scipy.spatial.distance import cdist

from fedcluster_flwr import clustering
from fedcluster_flwr.clustering import GRAM_BLOCK_COLUMNS, available_cores, pairwise_distances
from fedcluster_flwr.numerics import torch_threads


def l1_scipy_cdist(x: np.ndarray) -> None:
    """The former implementation: scipy's cdist on blocks of 64 rows (float64, one thread)."""
    for i in range(0, len(x), 64):
        for j in range(i, len(x), 64):
            cdist(x[i : i + 64], x[j : j + 64], metric="cityblock")


def l1_torch_cdist(x: np.ndarray) -> None:
    """torch.cdist(p=1) on blocks of 64 rows (float32, torch's thread pool)."""
    rows = torch.from_numpy(x)
    with torch_threads(available_cores()):
        for i in range(0, len(x), 64):
            for j in range(i, len(x), 64):
                torch.cdist(rows[i : i + 64], rows[j : j + 64], p=1)


def column_blocks_with_torch_threads(x: np.ndarray, block_sum, width: int) -> None:
    rows = torch.from_numpy(x)
    with torch_threads(available_cores()):
        total = None
        for start in range(0, x.shape[1], width):
            part = block_sum(rows[:, start : start + width]).double()
            total = part if total is None else total + part


def l1_pdist_block(block: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pdist(block.contiguous(), p=1)


def l1_pdist_workers(x: np.ndarray, width: int) -> None:
    """torch's pdist on the workers of ``pairwise_distances`` (its l1 kernel until the compiled one)."""
    pairs = len(x) * (len(x) - 1) // 2
    clustering._sum_over_column_blocks(
        torch.from_numpy(x), lambda block, total: total.add_(l1_pdist_block(block)), width, (pairs,))


CANDIDATES = {
    "l1": {
        "scipy cdist, row blocks (before)": l1_scipy_cdist,
        "torch.cdist p=1, row blocks, torch threads": l1_torch_cdist,
        **{f"torch pdist, {w}-column blocks, torch threads": (lambda x, w=w: column_blocks_with_torch_threads(x, l1_pdist_block, w))
           for w in (128, 1024)},
        **{f"torch pdist, {w}-column blocks, workers (before)": (lambda x, w=w: l1_pdist_workers(x, w))
           for w in (128, 256)},
        **{f"compiled kernel, {w}-column blocks, ours (workers)": (lambda x, w=w: pairwise_distances(x, "l1", block_columns=w))
           for w in (64, 128, 256, 1024)},
    },
    "l2": {
        "numpy X @ X.T (OpenBLAS threads; before)": lambda x: x @ x.T,
        f"torch {GRAM_BLOCK_COLUMNS}-column Gram blocks, torch threads": lambda x: column_blocks_with_torch_threads(
            x, lambda b: b @ b.T, GRAM_BLOCK_COLUMNS),
        **{f"torch {w}-column Gram blocks, ours (workers)": (lambda x, w=w: pairwise_distances(x, "l2", block_columns=w))
           for w in (8192, GRAM_BLOCK_COLUMNS)},
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--l1-dim", type=int, default=20_000)
    parser.add_argument("--gram-dim", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated candidate names to leave out")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    rng = np.random.default_rng(0)
    n = args.clients
    matrices = {"l1": rng.standard_normal((n, args.l1_dim), dtype=np.float32),
                "l2": rng.standard_normal((n, args.gram_dim), dtype=np.float32)}
    pairwise_distances(matrices["l1"][:5, :9], "l1")  # the l1 kernel's compilation (or its cache) is not timed
    work = {"l1": n * (n - 1) / 2 * args.l1_dim, "l2": 2.0 * n * n * args.gram_dim}
    unit = {"l1": "G pair-columns", "l2": "GFLOP"}
    lines = [f"N = {n}, l1: d = {args.l1_dim}, Gram: d = {args.gram_dim}; {available_cores()} cores; "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             "| kernel | round | wall s | CPU s | per wall s | per CPU s | load (1 min) |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for round_ in range(1, args.repeat + 1):
        for metric, candidates in CANDIDATES.items():
            for name, run in candidates.items():
                if name in skip:
                    continue
                wall, cpu = time.perf_counter(), time.process_time()
                run(matrices[metric])
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                line = (f"| {name} | {round_} | {wall:.2f} | {cpu:.2f} | {work[metric] / wall / 1e9:.2f} {unit[metric]} "
                        f"| {work[metric] / cpu / 1e9:.2f} | {os.getloadavg()[0]:.1f} |")
                print(line, flush=True)
                lines.append(line)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
