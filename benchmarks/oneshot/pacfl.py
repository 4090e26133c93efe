"""PACFL (Vahidian et al.) beside one-shot HFL (Ali & Arafa) on Ali & Arafa's Fashion-MNIST tasks.

    python benchmarks/oneshot/pacfl.py                    # seeds 0-2, 15 training rounds
    python benchmarks/oneshot/pacfl.py --seeds 0,1,2,3,4,5

Needs Fashion-MNIST under $FEDCLUSTER_DATA_DIR. Both on the same partition and initial model per seed
(conf/pacfl_fmnist_3tasks.yaml and conf/oneshot_fmnist_3tasks.yaml differ only in ``strategy`` and
``rounds``), each run in process (one process, one torch thread; the same rounds as Flower's Ray
engine, see benchmarks/common.py):

* training runs, the same number of training rounds after each one-shot phase (PACFL's is one round,
  one-shot HFL's two): pacfl (smallest principal angle, p = 3, 3 clusters), oneshot_hfl as its conf
  (the GPS shares the hidden layer) and oneshot_hfl with no shared layers (plain FedAvg per cluster,
  as PACFL trains);
* clustering-only runs (the one-shot round and one training round) of PACFL's other proximities:
  the sum of the principal angles and the reference code's elementwise minimum angle.

Writes ``<out>/pacfl.md``; run directories under ``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fedcluster_flwr.config.load import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run.py's helpers
from common import mean_std, run_or_reuse  # noqa: E402
from run import TASKS, oneshot_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFS = {"pacfl": ROOT / "conf" / "pacfl_fmnist_3tasks.yaml", "oneshot_hfl": ROOT / "conf" / "oneshot_fmnist_3tasks.yaml"}
ONE_SHOT_ROUNDS = {"pacfl": 1, "oneshot_hfl": 2}
# label -> (conf, overrides, trains?)
VARIANTS = {
    "pacfl, smallest angle (eq. 2)": ("pacfl", {}, True),
    "pacfl, sum of angles (eq. 3)": ("pacfl", {"strategy.proximity": "sum_of_angles"}, False),
    "pacfl, reference code's elementwise min angle": ("pacfl", {"strategy.proximity": "elementwise_min_angle"}, False),
    "oneshot_hfl, GPS shares fc": ("oneshot_hfl", {}, True),
    "oneshot_hfl, no shared layers": ("oneshot_hfl", {"strategy.shared_layers": []}, True),
}


def run(label: str, seed: int, training_rounds: int, out: Path) -> dict:
    conf, overrides, trains = VARIANTS[label]
    rounds = ONE_SHOT_ROUNDS[conf] + (training_rounds if trains else 1)
    config, _ = load_config(CONFS[conf], [("seed", seed), ("rounds", rounds), *overrides.items()])
    slug = label.split(",")[0] + "_" + "_".join(f"{v}" for v in overrides.values()).replace("[]", "independent")
    return run_or_reuse(config, out / "runs" / f"{slug.strip('_')}_seed{seed}", engine="inprocess")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--training-rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fmnist_3tasks")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = {label: [run(label, seed, args.training_rounds, args.out) for seed in seeds] for label in VARIANTS}
    n = len(seeds)

    lines = [
        "# PACFL vs one-shot HFL on Fashion-MNIST, 3 tasks (clothes 5 / shoes 3 / bags 2 users)\n",
        f"`python benchmarks/oneshot/pacfl.py --seeds {args.seeds} --training-rounds {args.training_rounds}` "
        f"({(time.perf_counter() - started) / 60:.1f} min for the runs not reused, in process); Φ = identity "
        f"(standardised pixels), mean ± std over seeds {args.seeds}, each seed its own partition and initial model.\n",
        "## Clustering in the one-shot phase\n",
        "PACFL's proximity is an angle in degrees (0: the same subspace), its gap = mean across true tasks − mean within; "
        "one-shot HFL's R is a similarity in [0, 1], its gap = mean within − mean across. Bytes: the one-shot phase "
        "(PACFL: `gram_eigen`; one-shot HFL: `gram_eigen` + `relevance`), all 10 clients, serialized as Flower sends them "
        "(the same on every seed).\n",
        "| method | purity | ARI | perfect | within true tasks | across | gap | one-shot bytes up | one-shot bytes down |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, summaries in runs.items():
        assert len({(oneshot_bytes(s, "up"), oneshot_bytes(s, "down")) for s in summaries}) == 1, label
        if label.startswith("pacfl"):
            within = [s["proximity_within_true_clusters"] for s in summaries]
            across = [s["proximity_across_true_clusters"] for s in summaries]
            gap, unit = [a - w for w, a in zip(within, across)], "°"
        else:
            within = [s["relevance_within_true_clusters"] for s in summaries]
            across = [s["relevance_across_true_clusters"] for s in summaries]
            gap, unit = [w - a for w, a in zip(within, across)], ""
        digits = 1 if unit else 3
        lines.append(
            f"| {label} | {mean_std([s['purity'] for s in summaries], 2)} | {mean_std([s['ari'] for s in summaries], 2)} | "
            f"{sum(s['ari'] == 1.0 for s in summaries)}/{n} | {mean_std(within, digits)}{unit} | {mean_std(across, digits)}{unit} | "
            f"{mean_std(gap, digits)}{unit} | {oneshot_bytes(summaries[0], 'up'):,} | {oneshot_bytes(summaries[0], 'down'):,} |")
    lines += [
        "",
        f"## Test accuracy after {args.training_rounds} training rounds\n",
        "| method | " + " | ".join(TASKS.values()) + " | mean client | rounds in all |",
        "|---|" + "---|" * (len(TASKS) + 2),
    ]
    for label, summaries in runs.items():
        if not VARIANTS[label][2]:
            continue
        per_task = [mean_std([s["per_true_cluster_accuracy"].get(t) for s in summaries]) for t in TASKS]
        lines.append(f"| {label} | " + " | ".join(per_task)
                     + f" | {mean_std([s['mean_client_accuracy'] for s in summaries])} | {summaries[0]['completed_rounds']} |")
    first = runs["pacfl, smallest angle (eq. 2)"][0]
    lines += [
        "",
        f"PACFL's summary per client: p × d = {first['subspace_floats']} floats up, once, nothing down; one-shot HFL's: "
        f"{runs['oneshot_hfl, GPS shares fc'][0]['eigen_summary_floats']} floats up, 10 × that down, then a row of 10 "
        f"relevances up. One model upload: {first['model_bytes']:,} bytes.",
    ]
    text = "\n".join(lines) + "\n"
    (args.out / "pacfl.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
