"""DAC (Zec et al.) against its ablation and the gossip baselines on rotated Fashion-MNIST,
the same partitions and seeds for every method.

    python benchmarks/dac/run.py --scale reduced          # ≈ 30 min on 2 CPU cores
    python benchmarks/dac/run.py --scale full             # the paper's setting (hours on CPU; use a GPU)
    python benchmarks/dac/run.py --conf dac_fmnist_rot4.yaml --methods dac,random_gossip

Needs Fashion-MNIST under $FEDCLUSTER_DATA_DIR. Methods: ``dac``, ``dac_var``, ``dac_minus``
(DAC without the two-hop estimates, the paper's "DAC −"), ``random_gossip``, ``oracle_gossip``
and ``local``, all through Flower's Ray engine. Accuracy is each client's test accuracy of its
model with the lowest validation loss so far (the paper's model selection), averaged per true
cluster. Writes ``<out>/results.md``, ``<out>/communication_<method>.png`` (seed 0) and the run
directories under ``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from fedcluster_flwr.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import mean_std, run_or_reuse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
METHODS: dict[str, dict[str, object]] = {
    "dac": {"strategy.name": "dac"},
    "dac_var": {"strategy.name": "dac_var"},
    "dac_minus": {"strategy.name": "dac", "strategy.two_hop": False},
    "random_gossip": {"strategy.name": "random_gossip"},
    "oracle_gossip": {"strategy.name": "oracle_gossip"},
    "local": {"strategy.name": "local"},
}
SCALES: dict[str, dict[str, object]] = {
    "full": {},
    # 100 clients and the cluster sizes kept; less data and training per client, fewer rounds.
    "reduced": {
        "rounds": 15,
        "partition.samples_per_client": 200,
        "partition.test_fraction": 0.25,  # 50 test
        "partition.val_fraction": 0.25,  # 50 validation, 100 train
        "model.name": "mlp_fmnist",
        "client.epochs": 2,
        "client.lr": 0.005,
    },
}


def run_one(conf: Path, scale: str, method: str, seed: int, out: Path, rounds: int | None = None) -> dict:
    items = SCALES[scale] | METHODS[method] | {"seed": seed} | ({"rounds": rounds} if rounds else {})
    config, _ = load_config(conf, list(items.items()))
    return run_or_reuse(config, out / "runs" / f"{method}_seed{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--conf", default="dac_fmnist_rot_unequal.yaml", help="a file in conf/")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=None, help="override the scale's number of rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    conf = ROOT / "conf" / args.conf
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"error: --methods: unknown {unknown}; available: {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out or Path(__file__).resolve().parent / "results" / f"{args.scale}_{conf.stem}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    summaries = {m: [run_one(conf, args.scale, m, seed, out, args.rounds) for seed in seeds] for m in methods}

    config, _ = load_config(conf, list((SCALES[args.scale] | ({"rounds": args.rounds} if args.rounds else {})).items()))
    options = config.partition.options
    clusters = [str(k) for k in range(len(options.angles))]
    names = [f"{int(a)}° ({n})" for a, n in zip(options.angles, options.cluster_sizes)]
    command = f"python benchmarks/dac/run.py --scale {args.scale} --conf {args.conf} --methods {args.methods} --seeds {args.seeds}"
    lines = [
        f"# {conf.stem}, {args.scale} scale, seeds {args.seeds}\n",
        f"`{command}` ({(time.perf_counter() - started) / 60:.0f} min for the runs not reused). Overrides of the conf "
        f"file: {SCALES[args.scale] or 'none'}. Test accuracy of each client's best-validation model after "
        f"{config.rounds} rounds, mean per true cluster (rotation, clients), mean ± std over seeds.\n",
        "| method | " + " | ".join(names) + " | mean client | std across clusters | purity of the similarity's clusters |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    for method, runs in summaries.items():
        per_cluster = [mean_std([s["per_true_cluster_best_val_accuracy"].get(c) for s in runs]) for c in clusters]
        spread = [float(np.std(list(s["per_true_cluster_best_val_accuracy"].values()))) for s in runs]
        purity = "–" if method in ("local", "oracle_gossip") else mean_std([s["purity"] for s in runs])
        lines.append(f"| {method} | " + " | ".join(per_cluster)
                     + f" | {mean_std([s['mean_best_val_accuracy'] for s in runs])} | {mean_std(spread)} | {purity} |")
    lines.append("\nThe purity of `local` and `oracle_gossip` is 1 by construction and left out. "
                 "Heat maps of who sampled whom (seed 0): " + ", ".join(f"`communication_{m}.png`" for m in methods if m != "local"))
    for method in methods:
        source = out / "runs" / f"{method}_seed{seeds[0]}" / "communication.png"
        if source.is_file():
            shutil.copy(source, out / f"communication_{method}.png")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
