"""IFCA vs gradloss (Lin et al.) on class subsets, oracle and FedAvg beside them, over seeds.

    python benchmarks/multimodel/run.py --scale reduced                 # ≈ 30 min on 2 CPU cores
    python benchmarks/multimodel/run.py --scale full --conf multimodel_fmnist_cnn.yaml
    python benchmarks/multimodel/run.py --methods gradloss-0.2-mean,gradloss-0.5-mean --seeds 0,1,2

Needs MNIST / Fashion-MNIST under $FEDCLUSTER_DATA_DIR. Every method runs the same conf file with
the same seeds (so the same partitions, initial models and client samples) through Flower's Ray
simulation engine. A method is ``ifca``, ``gradloss-<lambda>`` (the conf's loss reduction, ``sum``
as in the paper) or ``gradloss-<lambda>-<mean|sum>``, ``oracle`` or ``fedavg``; ``-reseed`` turns on
``cluster_guard: reseed_empty`` (a refill of empty clusters) for ifca and gradloss. Writes
``<out>/results.md`` (mean ± std over seeds), ``<out>/purity.png`` and one run directory per
(method, seed) under ``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from fedcluster_flwr.config import load_config
from fedcluster_flwr.results import read_rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import mean_std, run_or_reuse, value_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_METHODS = "ifca,gradloss-0.1,gradloss-0.2,gradloss-0.5,gradloss-0.2-mean,oracle,fedavg"
PURITY_TARGET = 0.9
ACCURACY_TARGET = 0.8
PURITY_ROUNDS = (1, 5, 10, 20)

# Overrides per scale; "full" is the conf file as it is.
SCALES: dict[str, dict[str, object]] = {
    "full": {},
    "reduced": {"rounds": 25, "partition.samples_per_client": 200},  # 160 train + 40 test per client
}


def method_overrides(method: str) -> dict[str, object]:
    """``ifca[-reseed]``, ``gradloss-<lambda>[-mean|-sum][-reseed]``, ``oracle`` or ``fedavg``."""
    name, *options = method.split("-")
    items: dict[str, object] = {"strategy.name": name}
    for option in options:
        if option == "reseed" and name in ("ifca", "gradloss"):
            items["strategy.cluster_guard"] = "reseed_empty"
        elif option in ("mean", "sum") and name == "gradloss":
            items["strategy.loss_reduction"] = option
        elif name == "gradloss" and option.replace(".", "", 1).isdigit():
            items["strategy.lambda"] = float(option)
        else:
            raise SystemExit(f"error: {method}: unknown option {option!r} (see --help)")
    if name == "gradloss" and "strategy.lambda" not in items:
        raise SystemExit(f"error: {method}: give gradloss's lambda, e.g. gradloss-0.2")
    return items


def first_round(rows: list[dict], key: str, target: float) -> int | None:
    return next((r["round"] for r in rows if r.get(key) is not None and r[key] >= target), None)


def run_one(conf: Path, scale: str, method: str, seed: int, out: Path) -> list[dict]:
    items = SCALES[scale] | method_overrides(method) | {"seed": seed}
    config, _ = load_config(conf, list(items.items()))
    run_dir = out / "runs" / f"{method}_seed{seed}"
    run_or_reuse(config, run_dir)
    return read_rounds(run_dir)


def table(results: dict[str, list[list[dict]]], rounds: int) -> str:
    header = (
        f"| method | rounds to purity ≥ {PURITY_TARGET} | "
        + " | ".join(f"purity r{r}" for r in PURITY_ROUNDS if r <= rounds)
        + f" | rounds to mean acc. ≥ {ACCURACY_TARGET} | final mean acc. | final purity |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for method, runs in results.items():
        cells = [mean_std([first_round(rows, "purity", PURITY_TARGET) for rows in runs], 1)]
        cells += [mean_std([value_at(rows, "purity", r) for rows in runs], 2) for r in PURITY_ROUNDS if r <= rounds]
        cells.append(mean_std([first_round(rows, "mean_client_accuracy", ACCURACY_TARGET) for rows in runs], 1))
        cells.append(mean_std([rows[-1]["mean_client_accuracy"] for rows in runs]))
        cells.append(mean_std([rows[-1]["purity"] for rows in runs], 2))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_purity(results: dict[str, list[list[dict]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, runs in results.items():
        if method in ("oracle", "fedavg"):
            continue  # purity 1 and 0.25 by construction
        curves = np.array([[np.nan if r["purity"] is None else r["purity"] for r in rows] for rows in runs])
        rounds = [r["round"] for r in runs[0]]
        mean, std = np.nanmean(curves, axis=0), np.nanstd(curves, axis=0)
        ax.plot(rounds, mean, lw=1.8, label=method)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.15)
    ax.axhline(PURITY_TARGET, color="grey", ls="--", lw=1)
    ax.set(xlabel="round", ylabel="purity (mean ± std over seeds)", ylim=(0, 1.02), title=title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--conf", default="multimodel_mnist_mlp.yaml", help="a file in conf/")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    conf = ROOT / "conf" / args.conf
    out = args.out or Path(__file__).resolve().parent / "results" / f"{args.scale}_{conf.stem}"
    out.mkdir(parents=True, exist_ok=True)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    for method in methods:
        method_overrides(method)  # reject a malformed method before hours of runs
    started = time.perf_counter()
    results = {m: [run_one(conf, args.scale, m, seed, out) for seed in seeds] for m in methods}
    rounds = len(next(iter(results.values()))[0])
    command = f"python benchmarks/multimodel/run.py --scale {args.scale} --conf {args.conf} --methods {args.methods} --seeds {args.seeds}"
    text = (
        f"# {conf.stem}, {args.scale} scale: seeds {args.seeds}, {rounds} rounds\n\n"
        f"`{command}` ({(time.perf_counter() - started) / 60:.0f} min for the runs not reused).\n"
        f"Overrides of the conf file: {SCALES[args.scale] or 'none'}. Purity over all clients with an identity; "
        f"a cell `(k/n)` averages the k seeds that reached the target.\n\n{table(results, rounds)}\n"
    )
    (out / "results.md").write_text(text)
    plot_purity(results, out / "purity.png", f"{conf.stem} ({args.scale})")
    print(text)


if __name__ == "__main__":
    main()
