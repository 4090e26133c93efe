"""One-shot data-similarity clustering + hierarchical training (Ali & Arafa) against random and
oracle clusters, with and without shared layers, over seeds; and the clustering vs k (their Fig. 4).

    python benchmarks/oneshot/run.py                     # Fashion-MNIST 3 tasks, 5 seeds, 12 min on 2 CPU cores
    python benchmarks/oneshot/run.py --seeds 0,1,2,3,4,5,6,7,8,9 --training-rounds 28

Needs Fashion-MNIST under $FEDCLUSTER_DATA_DIR. Two parts, both on conf/oneshot_fmnist_3tasks.yaml
with seeds 0..4 (each seed its own partition and initial model):

* clustering vs k (no training, in process): every client's Gram eigenpairs and relevance rows
  computed by the client's own task handlers, then R and the HAC clustering for k = 1..50,
  beside random clustering into the same number of clusters;
* training through Flower's Ray engine: oneshot_hfl, random_clusters and oracle_hfl, each with
  the conf's shared layers and with none (independent LPS models), for the same number of
  training rounds (oneshot_hfl runs two more: its one-shot phase).

Writes ``<out>/results.md``, ``<out>/k_sweep.png`` and the run directories under ``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from fedcluster_flwr import protocol
from fedcluster_flwr.client import TaskInput, relevance_to_every_client, top_gram_eigenpairs
from fedcluster_flwr.clustering import cluster_by_relevance, cluster_scores, relevance_matrix, within_and_across
from fedcluster_flwr.config import load_config
from fedcluster_flwr.experiment import experiment_data, make_client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import mean_std, run_or_reuse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "oneshot_fmnist_3tasks.yaml"
KS = (1, 2, 3, 5, 8, 10, 20, 30, 50)
TASKS = {"0": "clothes", "1": "shoes", "2": "bags"}
METHODS = ("oneshot_hfl", "random_clusters", "oracle_hfl")


# ---- clustering vs k --------------------------------------------------------------------------


def clustering_vs_k(seed: int, ks: tuple[int, ...]) -> dict[int, dict[str, float]]:
    config, _ = load_config(CONF, [("seed", seed)])
    options = config.strategy.options
    true = experiment_data(config)[1].true_clusters
    clients = [make_client(config, pid, config.partition.num_clients) for pid in range(config.partition.num_clients)]
    features = {protocol.FEATURES_KEY: options.features, protocol.FEATURE_DIM_KEY: 784,
                protocol.FEATURE_SEED_KEY: seed, protocol.PRETRAINED_WEIGHTS_KEY: ""}
    top = max(ks)
    summaries = []
    for client in clients:
        blocks = top_gram_eigenpairs(client, TaskInput(1, {}, features | {protocol.NUM_EIGENVECTORS_KEY: top})).blocks
        summaries.append((blocks[protocol.EIGENVECTORS][0], blocks[protocol.EIGENVALUES][0]))
    results = {}
    for k in ks:
        truncated = [[vectors[:k], values[:k]] for vectors, values in summaries]
        rows = np.stack([
            relevance_to_every_client(c, TaskInput(2, {protocol.EIGENVECTORS: truncated}, features))
            .blocks[protocol.RELEVANCE][0] for c in clients
        ])
        relevance = relevance_matrix(rows)
        labels = cluster_by_relevance(relevance, options.linkage, num_clusters=options.num_clusters).labels
        within, across = within_and_across(relevance, true)
        results[k] = cluster_scores(true, labels) | {"within": within, "across": across}
    rng = np.random.default_rng(seed)
    random_labels = rng.permutation(np.arange(len(true)) % options.num_clusters)
    results[0] = cluster_scores(true, random_labels)  # k = 0: random clustering
    return results


def plot_k_sweep(sweeps: list[dict[int, dict[str, float]]], ks: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("purity", "purity"), ("ari", "ARI")):
        values = np.array([[s[k][key] for k in ks] for s in sweeps])
        ax.errorbar(ks, values.mean(0), yerr=values.std(0), marker="o", lw=1.6, capsize=3, label=label)
    gap = np.array([[s[k]["within"] - s[k]["across"] for k in ks] for s in sweeps])
    ax.errorbar(ks, gap.mean(0), yerr=gap.std(0), marker="s", lw=1.6, capsize=3, label="R within − R across")
    random_purity = np.mean([s[0]["purity"] for s in sweeps])
    ax.axhline(random_purity, color="grey", ls="--", lw=1, label=f"random clusters' purity ({random_purity:.2f})")
    ax.set(xscale="log", xlabel="k (eigenvectors per client)", ylabel="mean ± std over seeds", ylim=(-0.05, 1.05),
           title="one-shot clustering vs k, Fashion-MNIST 3 tasks")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- training -----------------------------------------------------------------------------------


def train(method: str, shared: bool, seed: int, training_rounds: int, out: Path) -> dict:
    rounds = training_rounds + (2 if method == "oneshot_hfl" else 0)
    items: dict[str, object] = {"seed": seed, "rounds": rounds, "strategy.name": method}
    if not shared:
        items["strategy.shared_layers"] = []
    config, _ = load_config(CONF, list(items.items()))
    return run_or_reuse(config, out / "runs" / f"{method}_{'shared' if shared else 'independent'}_seed{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--training-rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fmnist_3tasks")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    sweeps = [clustering_vs_k(seed, KS) for seed in seeds]
    plot_k_sweep(sweeps, KS, args.out / "k_sweep.png")
    summaries = {(m, shared): [train(m, shared, seed, args.training_rounds, args.out) for seed in seeds]
                 for m in METHODS for shared in (True, False)}

    oneshot = summaries[("oneshot_hfl", True)]
    k5 = [s[5] for s in sweeps]
    lines = [
        "# One-shot HFL on Fashion-MNIST, 3 tasks (clothes 5 / shoes 3 / bags 2 users)\n",
        f"`python benchmarks/oneshot/run.py --seeds {args.seeds} --training-rounds {args.training_rounds}` "
        f"({(time.perf_counter() - started) / 60:.0f} min for the parts not reused); conf "
        f"`conf/oneshot_fmnist_3tasks.yaml`, Φ = identity (standardised pixels), mean ± std over seeds {args.seeds}.\n",
        "## Clustering (k = 5 eigenvectors) vs random clusters\n",
        "| clustering | purity | ARI | seeds with a perfect clustering | mean R within tasks | mean R across tasks |",
        "|---|---|---|---|---|---|",
        f"| one-shot (k = 5, in the Ray runs) | {mean_std([s['purity'] for s in oneshot], 2)} | {mean_std([s['ari'] for s in oneshot], 2)} | "
        f"{sum(s['ari'] == 1.0 for s in oneshot)}/{len(oneshot)} | {mean_std([s['relevance_within_true_clusters'] for s in oneshot])} | "
        f"{mean_std([s['relevance_across_true_clusters'] for s in oneshot])} |",
        f"| one-shot (k = 5, sweep) | {mean_std([r['purity'] for r in k5], 2)} | {mean_std([r['ari'] for r in k5], 2)} | "
        f"{sum(r['ari'] == 1.0 for r in k5)}/{len(k5)} | {mean_std([r['within'] for r in k5])} | {mean_std([r['across'] for r in k5])} |",
        f"| random | {mean_std([s[0]['purity'] for s in sweeps], 2)} | {mean_std([s[0]['ari'] for s in sweeps], 2)} | "
        f"{sum(s[0]['ari'] == 1.0 for s in sweeps)}/{len(sweeps)} | – | – |",
        "",
        f"## Test accuracy per task after {args.training_rounds} training rounds\n",
        "| clusters | GPS shares | " + " | ".join(TASKS.values()) + " | mean client |",
        "|---|---|" + "---|" * (len(TASKS) + 1),
    ]
    for (method, shared), runs in summaries.items():
        per_task = [mean_std([s["per_true_cluster_accuracy"].get(t) for s in runs]) for t in TASKS]
        lines.append(f"| {method} | {'fc (hidden layer)' if shared else 'nothing'} | " + " | ".join(per_task)
                     + f" | {mean_std([s['mean_client_accuracy'] for s in runs])} |")
    lines += [
        "",
        "## Clustering vs k (the paper's Fig. 4; `k_sweep.png`)\n",
        "| k | purity | ARI | R within | R across | gap |",
        "|---|---|---|---|---|---|",
    ]
    for k in KS:
        rows = [s[k] for s in sweeps]
        lines.append(f"| {k} | {mean_std([r['purity'] for r in rows], 2)} | {mean_std([r['ari'] for r in rows], 2)} | "
                     f"{mean_std([r['within'] for r in rows])} | {mean_std([r['across'] for r in rows])} | "
                     f"{mean_std([r['within'] - r['across'] for r in rows])} |")
    first = oneshot[0]
    n = 10
    lines += [
        "",
        "## Communication of the one-shot phase\n",
        f"Per client: {first['eigen_summary_floats']} floats up (k × d eigenvectors + k eigenvalues), "
        f"{n} × that down, then one relevance row of {n} floats up; one model upload is {first['model_bytes']:,} bytes. "
        f"Measured over both one-shot rounds, all clients: {first['oneshot_bytes_up']:,} bytes up, "
        f"{first['oneshot_bytes_down']:,} bytes down (serialized, as Flower sends them). "
        f"LPS↔GPS traffic over the run (shared hidden layer): {mean_std([s['bytes_gps'] for s in oneshot], 0)} bytes.",
    ]
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
