"""DAC (Zec et al.) against its ablations, PENS and the gossip baselines on rotated Fashion-MNIST
(the methods of the paper's Table 2), the same partitions and seeds for every method; and the
variants this project adds (no pretraining, the reference code's two-hop estimate).

    python benchmarks/dac/run.py --scale reduced                        # Table 2's methods, seeds 0-2
    python benchmarks/dac/run.py --scale reduced --report variants.md \
        --methods dac,dac_no_pretraining,dac_minus,dac_minus_no_pretraining,dac_reference_two_hop,dac_var,dac_var_centred
    python benchmarks/dac/run.py --scale reduced --report round_order.md --set simulation.engine=inprocess \
        --methods dac,dac_sequential,random_gossip,random_gossip_sequential   # both round orders
    python benchmarks/dac/run.py --scale full                           # the paper's setting (use a GPU)
    python benchmarks/dac/run.py --scale full --methods dac --seeds 0 --rounds 3   # time a few rounds
    python benchmarks/dac/run.py --scale full --set simulation.num_gpus_per_client=0.0625   # 16 clients per GPU
    python benchmarks/dac/run.py --scale full --set simulation.engine=batched   # a round's clients stacked

Needs Fashion-MNIST under $FEDCLUSTER_DATA_DIR. Table 2's methods (the default ``--methods``):
``dac``, ``dac_var``, ``dac_minus`` (DAC without the two-hop estimates, the paper's "DAC −"),
``pens``, ``random_gossip``, ``oracle_gossip`` and ``local``; the variants ``dac_no_pretraining``,
``dac_minus_no_pretraining``, ``dac_var_centred``, ``dac_reference_two_hop``, and ``dac_sequential``
/ ``random_gossip_sequential`` (the reference code's turn-taking round, on the in-process engine).
The others run through Flower's Ray engine unless ``--set simulation.engine=...`` says otherwise. Every method gets the same number of rounds, so the same local training: with
pretraining (the default, as the reference code) round 1 pretrains and the others exchange; without
it, every round exchanges. Accuracy is each client's test accuracy of its model with the lowest
validation loss so far (the paper's model selection), averaged per true cluster. Writes
``<out>/results.md`` (``--report``), ``<out>/communication_<method>.png`` (seed 0) and the run directories under
``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from fedcluster_flwr.algorithms.dac.math import SAME_CLUSTER_DRAWS, same_true_cluster_share
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.results.run_files import read_rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import mean_std, run_or_reuse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TABLE_2 = ("dac", "dac_var", "dac_minus", "pens", "random_gossip", "oracle_gossip", "local")
METHODS: dict[str, dict[str, object]] = {
    "dac": {"strategy.name": "dac"},
    "dac_var": {"strategy.name": "dac_var"},
    "dac_minus": {"strategy.name": "dac", "strategy.two_hop": False},
    "pens": {"strategy.name": "pens"},
    "random_gossip": {"strategy.name": "random_gossip"},
    "oracle_gossip": {"strategy.name": "oracle_gossip"},
    "local": {"strategy.name": "local"},
    # variants
    "dac_no_pretraining": {"strategy.name": "dac", "strategy.pretrain_epochs": 0},
    "dac_minus_no_pretraining": {"strategy.name": "dac", "strategy.two_hop": False, "strategy.pretrain_epochs": 0},
    "dac_var_centred": {"strategy.name": "dac_var", "strategy.tau_schedule": "centred"},
    "dac_reference_two_hop": {"strategy.name": "dac", "strategy.two_hop_estimate": "reference"},
    # the reference code's turn-taking round (strategy.round_order sequential: the in-process engine only)
    "dac_sequential": {"strategy.name": "dac", "strategy.round_order": "sequential", "simulation.engine": "inprocess"},
    "random_gossip_sequential": {"strategy.name": "random_gossip", "strategy.round_order": "sequential",
                                 "simulation.engine": "inprocess"},
}
SCALES: dict[str, dict[str, object]] = {
    # the conf as it is: 100 clients x (500 train + 100 validation + 100 test), the reference CNN,
    # batch 8, 3 epochs of Adam, pretraining + 100 exchanges; PENS selects for its default 10 exchanges
    "full": {},
    # 100 clients and the cluster sizes kept; less data and training per client, fewer rounds.
    "reduced": {
        "rounds": 16,  # with pretraining: round 1 + 15 exchanges
        "partition.samples_per_client": 200,
        "partition.test_fraction": 0.25,  # 50 test
        "partition.val_fraction": 0.25,  # 50 validation, 100 train
        "model.name": "mlp_fmnist",
        "client.epochs": 2,
        "client.lr": 0.005,
    },
}
PENS_SELECTION = {"full": 10, "reduced": 5}  # selection rounds (ours: the paper's setting is not given)


def run_one(conf: Path, scale: str, method: str, seed: int, out: Path, rounds: int | None = None,
            extra: dict[str, object] | None = None) -> Path:
    items = SCALES[scale] | METHODS[method] | {"seed": seed} | ({"rounds": rounds} if rounds else {}) | (extra or {})
    if METHODS[method]["strategy.name"] == "pens":
        items["strategy.selection_rounds"] = PENS_SELECTION[scale]
    config, _ = load_config(conf, list(items.items()))
    run_dir = out / "runs" / f"{method}_seed{seed}"
    run_or_reuse(config, run_dir)
    return run_dir


def own_cluster_share(run_dir: Path, summary: dict, cluster: int) -> float | None:
    """The share of cluster ``cluster``'s neighbour draws that went to its own cluster, for a run: from
    its summary (gossip runs record it per true cluster), else from its ``communication.npy`` (runs
    made before the summary had it) by the strategy's own function; None where that cluster drew
    nobody (local training). The committed copies of the runs keep the summary, not the ``.npy``."""
    if SAME_CLUSTER_DRAWS in summary:
        return summary[SAME_CLUSTER_DRAWS].get(str(cluster))
    if (run_dir / "communication.npy").is_file():
        counts = np.load(run_dir / "communication.npy")
        return same_true_cluster_share(counts, np.asarray(summary["true_clusters"])).get(str(cluster))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--conf", default="dac_fmnist_rot_unequal.yaml", help="a file in conf/")
    parser.add_argument("--methods", default=",".join(TABLE_2), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=None, help="override the scale's number of rounds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", default="results.md", help="the table's file name in the output folder")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further override for every run, e.g. simulation.num_gpus_per_client=0.0625")
    args = parser.parse_args()
    extra = dict(parse_override(item) for item in args.set)
    conf = ROOT / "conf" / args.conf
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"error: --methods: unknown {unknown}; available: {', '.join(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = args.out or Path(__file__).resolve().parent / "results" / f"{args.scale}_{conf.stem}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = {m: [run_one(conf, args.scale, m, seed, out, args.rounds, extra) for seed in seeds] for m in methods}

    summaries = {m: [json.loads((d / "summary.json").read_text()) for d in dirs] for m, dirs in runs.items()}
    config, _ = load_config(conf, list((SCALES[args.scale] | ({"rounds": args.rounds} if args.rounds else {})).items()))
    options = config.partition.options
    clusters = [str(k) for k in range(len(options.angles))]
    names = [f"{a:g}° ({n})" for a, n in zip(options.angles, options.cluster_sizes)]
    different = int(np.argmax([abs(((a + 180) % 360) - 180) for a in options.angles]))  # the cluster furthest from 0°
    command = (f"python benchmarks/dac/run.py --scale {args.scale} --conf {args.conf} --methods {','.join(methods)} "
               f"--seeds {args.seeds}" + (f" --rounds {args.rounds}" if args.rounds else "")
               + (f" --report {args.report}" if args.report != "results.md" else "")
               + "".join(f" --set {item}" for item in args.set) + (f" --out {args.out}" if args.out else ""))
    lines = [
        f"# {conf.stem}, {args.scale} scale, seeds {args.seeds}\n",
        f"`{command}` ({(time.perf_counter() - started) / 60:.0f} min for the runs not reused). Overrides of the conf "
        f"file: {SCALES[args.scale] or 'none'}; PENS selects for {PENS_SELECTION[args.scale]} exchanges. Test accuracy of "
        f"each client's best-validation model after {config.rounds} rounds, mean per true cluster (rotation, clients), "
        "mean ± sample std (ddof = 1) over seeds. Draws in own cluster: the share of the "
        f"{names[different]} clients' neighbour draws that went to their own cluster (all rounds).\n",
        "| method | " + " | ".join(names) + " | mean client | purity of the similarity's clusters | draws in own cluster "
        f"({names[different]}) | s / round |",
        "|---|" + "---|" * (len(names) + 4),
    ]
    for method, summaries_m in summaries.items():
        per_cluster = [mean_std([s["per_true_cluster_best_val_accuracy"].get(c) for s in summaries_m], ddof=1) for c in clusters]
        purity = "–" if method in ("local", "oracle_gossip") else mean_std([s["purity"] for s in summaries_m], ddof=1)
        shares = []
        seconds = []
        for run_dir, summary in zip(runs[method], summaries_m):
            if (share := own_cluster_share(run_dir, summary, different)) is not None:
                shares.append(share)
            seconds += [r["seconds"] for r in read_rounds(run_dir)]
        share = mean_std(shares, 2, ddof=1) if shares else "–"
        lines.append(f"| {method} | " + " | ".join(per_cluster)
                     + f" | {mean_std([s['mean_best_val_accuracy'] for s in summaries_m], ddof=1)} | {purity} | {share} "
                     f"| {np.mean(seconds):.1f} |")
    lines.append("\nThe purity of `local` and `oracle_gossip` is 1 by construction and left out. Heat maps of who "
                 "sampled whom (seed 0): " + ", ".join(f"`communication_{m}.png`" for m in methods if m != "local"))
    for method in methods:
        source = runs[method][0] / "communication.png"
        if source.is_file():
            shutil.copy(source, out / f"communication_{method}.png")
    text = "\n".join(lines) + "\n"
    (out / args.report).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
