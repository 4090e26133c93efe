"""Time and peak memory of FL+HC's clustering step for N clients x d parameters.

    python benchmarks/flhc/clustering_scale.py --clients 1000 --dim 1663370 --distance l2
    python benchmarks/flhc/clustering_scale.py --clients 1000 --dim 1663370 --distance cosine --projection-dim 1024

Builds the update matrix the way the strategy does (one float32 row per client update,
projected on arrival when --projection-dim is given), then runs the blocked pairwise
distances and scipy's linkage. Synthetic updates come from 4 groups, so the run also
checks that the clusters are recovered. Prints one markdown table row; peak memory is
the process's maximum resident set size (ru_maxrss), i.e. including the matrix itself.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from fedcluster_flwr.clustering import UpdateMatrix, cluster_scores, hierarchical_clustering

GROUPS = 4


def synthetic_update(row: int, dim: int, centres: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A client update: its group's direction (one of 4) plus noise."""
    update = rng.standard_normal(dim, dtype=np.float32)
    update += 2.0 * centres[row % GROUPS]
    return update


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=1_663_370, help="parameters (cnn_briggs on MNIST: 1,663,370)")
    parser.add_argument("--distance", choices=("l1", "l2", "cosine"), default="l2")
    parser.add_argument("--linkage", default="average")
    parser.add_argument("--projection-dim", type=int)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((GROUPS, args.dim), dtype=np.float32)
    started = time.perf_counter()
    matrix = UpdateMatrix(args.clients, args.dim, args.projection_dim, seed=0)
    for row in range(args.clients):
        matrix.set_row(row, synthetic_update(row, args.dim, centres, rng))
    filled = time.perf_counter()
    del centres
    result = hierarchical_clustering(matrix.rows, args.distance, args.linkage, num_clusters=GROUPS)
    done = time.perf_counter()
    true = np.arange(args.clients) % GROUPS
    scores = cluster_scores(true, result.labels)
    print(
        "| clients | dim | distance/linkage | projection | fill s | distances+linkage s | peak RSS GB | matrix GB | ARI |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        f"| {args.clients} | {args.dim} | {args.distance}/{args.linkage} | {args.projection_dim or '–'} "
        f"| {filled - started:.1f} | {done - filled:.1f} | {peak_rss_gb():.2f} "
        f"| {matrix.rows.nbytes / 2**30:.2f} | {scores['ari']:.2f} |"
    )


if __name__ == "__main__":
    main()
