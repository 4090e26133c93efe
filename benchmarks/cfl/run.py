"""CFL vs FL+HC vs IFCA on 4-group label-swapped MNIST: same partitions, same seed, same initial model.

    python benchmarks/cfl/run.py                       # 1 seed, in-process (one process, one torch thread)
    python benchmarks/cfl/run.py --seeds 0,1,2
    python benchmarks/cfl/run.py --engine ray          # through Flower's Ray engine (the same rounds)

Each method runs conf/cfl_mnist_label_swap.yaml (20 clients x 300 MNIST images, cnn_briggs, every
client every round) with its strategy swapped in (METHODS): only the strategy section differs.
Writes ``<out>/results.md``: ARI, purity, the first round with purity 1 (that holds to the end),
mean client accuracy at the last round, and CFL's splits (round, α_max^cross, both update norms).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ENGINES, mean_std, run_or_reuse  # noqa: E402

from fedcluster_flwr.config.load import load_config  # noqa: E402
from fedcluster_flwr.results.run_files import read_rounds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "cfl_mnist_label_swap.yaml"

# method -> its strategy overrides; everything else is the conf file's.
METHODS: dict[str, dict[str, object]] = {
    "cfl": {},
    # FL+HC (Briggs et al.): the label-swap conf's cosine/average cut, clustering after 10 rounds
    "flhc": {"strategy.name": "flhc", "strategy.rounds_before_clustering": 10, "strategy.distance": "cosine",
             "strategy.linkage": "average", "strategy.threshold": 0.95},
    # IFCA (Ghosh et al.) with the true number of clusters
    "ifca": {"strategy.name": "ifca", "strategy.num_clusters": 4},
}


def rounds_to_purity_one(rows: list[dict]) -> int | None:
    """The first round from which purity stays 1 (every cluster one true group) to the end."""
    first = None
    for row in rows:
        if row.get("purity") == 1.0:
            first = row["round"] if first is None else first
        else:
            first = None
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--engine", choices=ENGINES, default="inprocess")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "cfl" / "results")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = args.methods.split(",")
    table = [
        "| method | ARI | purity | rounds to purity 1 | mean client accuracy | clusters |",
        "|---|---|---|---|---|---|",
    ]
    splits_lines = []
    for method in methods:
        results = []
        for seed in seeds:
            overrides = [("seed", seed), *METHODS[method].items()]
            config, _ = load_config(CONF, overrides)
            run_dir = args.out / f"{method}_seed{seed}"
            summary = run_or_reuse(config, run_dir, args.engine)
            rows = read_rounds(run_dir)
            results.append((summary, rows))
            for split in summary.get("splits", []):
                splits_lines.append(
                    f"| {seed} | {split['round']} | {split['parent']} → {split['children']} | "
                    f"{len(split['members'][0])} + {len(split['members'][1])} | {split['alpha_max_cross']:.3f} | "
                    f"{split['mean_update_norm']:.3f} | {split['max_update_norm']:.3f} |"
                )
        table.append(
            f"| {method} | {mean_std([s['ari'] for s, _ in results])} | {mean_std([s['purity'] for s, _ in results])} | "
            f"{mean_std([rounds_to_purity_one(r) for _, r in results], 1)} | "
            f"{mean_std([s['mean_client_accuracy'] for s, _ in results])} | "
            f"{mean_std([s['num_clusters'] for s, _ in results], 1)} |"
        )
    text = "\n".join(
        [f"Seeds {seeds}, engine {args.engine}, {CONF.name}.", "", *table, "", "CFL's splits:", "",
         "| seed | round | parent → children | sizes | α_max^cross | ‖mean Δθ‖ | max ‖Δθ_i‖ |",
         "|---|---|---|---|---|---|---|", *splits_lines, ""]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    print(text)
    (args.out / "methods.json").write_text(json.dumps(METHODS, indent=1))


if __name__ == "__main__":
    main()
