"""FedAvg vs FL+HC on MNIST (Briggs et al., 2020), same partitions, next to the paper's numbers.

    python benchmarks/flhc/run.py --scale reduced            # about 20 min on 2 CPU cores
    python benchmarks/flhc/run.py --scale full               # the paper's setting: ≈ 65 min per setting on CPU
    python benchmarks/flhc/run.py --settings iid_cosine,recommended   # the extra settings

Needs MNIST under $FEDCLUSTER_DATA_DIR. Each setting runs conf/flhc_mnist_<setting>.yaml
with strategy flhc and with strategy fedavg; ``--scale reduced`` keeps the 100 clients
and partitions but trains less per client and for fewer rounds (see SCALES), with
thresholds calibrated for that scale. Writes ``<out>/results.md`` and one run directory
per (setting, strategy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import value_at  # noqa: E402

from fedcluster_flwr.config.load import config_to_dict, load_config  # noqa: E402
from fedcluster_flwr.plots import plot_comparison  # noqa: E402
from fedcluster_flwr.results.run_files import read_rounds, run_curves  # noqa: E402
from fedcluster_flwr.runner import run_experiment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# setting -> (conf file, extra overrides). FedAvg runs once per conf file.
SETTINGS: dict[str, tuple[str, dict[str, object]]] = {
    "label_swap": ("flhc_mnist_label_swap.yaml", {}),
    "pathological": ("flhc_mnist_pathological.yaml", {}),
    "iid": ("flhc_mnist_iid.yaml", {}),
    "iid_cosine": ("flhc_mnist_iid.yaml", {"strategy.distance": "cosine", "strategy.linkage": "average"}),
    "recommended": ("flhc_mnist_recommended.yaml", {}),
}

# The paper's values as quoted in shared/DESIGN.md (mean client accuracy, %).
PAPER = {
    "label_swap": {"flhc_after": 98.7, "flhc_last": 99.1, "fedavg_last": 80.0},
    "pathological": {"flhc_after": 99.2, "flhc_last": 99.3, "fedavg_last": None},
}

# Overrides per scale. "full" is the conf files as they are (the paper's setting).
SCALES: dict[str, dict[str, object]] = {
    "full": {},
    "reduced": {
        "rounds": 12,
        "strategy.rounds_before_clustering": 5,
        "client.batch_size": 32,
        "client.epochs": 1,
        "client.lr": 0.05,
    },
}
# Cuts calibrated with benchmarks/flhc/calibrate.py at the reduced scale (see README); the
# pathological conf's full-scale cut (cosine, from sweep.py) has no reduced-scale calibration.
REDUCED_CUTS: dict[str, dict[str, object]] = {
    "label_swap": {"strategy.threshold": 0.8},
    "pathological": {"strategy.distance": "l1", "strategy.linkage": "complete", "strategy.threshold": 550.0},
    "iid": {"strategy.threshold": 2.0},
    "iid_cosine": {"strategy.threshold": 0.8},
    "recommended": {"strategy.threshold": 550.0},
}


def overrides(setting: str, scale: str, strategy: str) -> list[tuple[str, object]]:
    items = dict(SCALES[scale])
    if strategy == "flhc":
        items.update(SETTINGS[setting][1])
        if scale == "reduced":
            items.update(REDUCED_CUTS[setting])
    items["strategy.name"] = strategy
    return list(items.items())


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--settings", default="label_swap,pathological,iid", help=f"comma-separated; of {', '.join(SETTINGS)}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = (args.out or ROOT / "benchmarks" / "flhc" / "results" / args.scale).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# FL+HC vs FedAvg on MNIST ({args.scale} scale)",
        "",
        "Mean client test accuracy (%), each client on its own cluster's model and its own test split.",
        "",
        "| setting | FL+HC distance/linkage, threshold | clusters | purity | ARI | FL+HC after clustering "
        "| FedAvg same round | FL+HC last round | FedAvg last round | % clients ≥ target FL+HC / FedAvg "
        "| paper FL+HC after / last | paper FedAvg | minutes FL+HC / FedAvg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fedavg_runs: dict[str, tuple] = {}
    for setting in args.settings.split(","):
        path = ROOT / "conf" / SETTINGS[setting][0]
        runs = {}
        for strategy in ("flhc", "fedavg"):
            config, _ = load_config(path, overrides(setting, args.scale, strategy))
            key = json.dumps(config_to_dict(config), sort_keys=True)
            if strategy == "fedavg" and key in fedavg_runs:  # same partition and training: reuse
                runs[strategy] = fedavg_runs[key]
                continue
            run_dir = out / f"{setting}_{strategy}"
            shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own earlier output
            started = time.perf_counter()
            print(f"[{setting}] {strategy}: {config.rounds} rounds -> {run_dir}", flush=True)
            summary = run_experiment(config, run_dir)
            runs[strategy] = (config, summary, read_rounds(run_dir), (time.perf_counter() - started) / 60, run_dir)
            if strategy == "fedavg":
                fedavg_runs[key] = runs[strategy]
        flhc_config, flhc, flhc_rows, flhc_min, flhc_dir = runs["flhc"]
        _, fedavg, fedavg_rows, fedavg_min, fedavg_dir = runs["fedavg"]
        opts = flhc_config.strategy.options
        clustering_round = flhc["clustering_round"]
        paper = PAPER.get(setting, {})
        lines.append(
            f"| {setting} ({flhc_config.partition.name}) | {opts.distance}/{opts.linkage}, {opts.threshold:g} "
            f"| {flhc['clusters_found']} | {flhc['purity']:.2f} | {flhc['ari']:.2f} "
            f"| {pct(value_at(flhc_rows, 'mean_client_accuracy', clustering_round))} (round {clustering_round}) "
            f"| {pct(value_at(fedavg_rows, 'mean_client_accuracy', clustering_round))} "
            f"| {pct(flhc['mean_client_accuracy'])} | {pct(fedavg['mean_client_accuracy'])} "
            f"| {flhc['pct_clients_over_target']:.0f} / {fedavg['pct_clients_over_target']:.0f} "
            f"| {paper.get('flhc_after') or '–'} / {paper.get('flhc_last') or '–'} | {paper.get('fedavg_last') or '–'} "
            f"| {flhc_min:.1f} / {fedavg_min:.1f} |"
        )
        plot_comparison(run_curves([flhc_dir, fedavg_dir]), out / f"{setting}.png")
        (out / "results.md").write_text("\n".join(lines) + "\n")
    target = load_config(ROOT / "conf" / "flhc_mnist_iid.yaml")[0].target_accuracy
    lines += [
        "",
        f"Target accuracy {target:g}. Scale overrides: {json.dumps(SCALES[args.scale])}"
        + (f"; cuts {json.dumps(REDUCED_CUTS)}" if args.scale == "reduced" else ""),
        f"Command: python benchmarks/flhc/run.py --scale {args.scale} --settings {args.settings}",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
