"""One-shot data-similarity clustering + hierarchical training (Ali & Arafa) against random and
oracle clusters, with and without shared layers, over seeds; the relevance rule of the paper (eq. 3
with the client's own eigenvalue) against Amiri et al.'s; and the clustering vs k (their Fig. 4).

    python benchmarks/oneshot/run.py                     # Fashion-MNIST 3 tasks, seeds 0-5
    python benchmarks/oneshot/run.py --seeds 0,1,2,3,4,5,6,7,8,9 --training-rounds 28
    python benchmarks/oneshot/run.py --training-rounds 28 --engine batched   # a GPU machine without Ray

Needs Fashion-MNIST under $FEDCLUSTER_DATA_DIR. Everything on conf/oneshot_fmnist_3tasks.yaml, each
seed its own partition and initial model:

* clustering vs k (no training, in process), for both relevance rules: every client's Gram
  eigenvectors (and eigenvalues) and relevance rows computed by the client's own task handlers,
  then R and the HAC clustering for k = 1..50, beside random clustering into the same number of
  clusters;
* the one-shot phase through Flower's Ray engine under both rules (``strategy.relevance``): R, the
  clusters and the bytes the clients sent (the paper's users send no eigenvalues);
* training through Flower's Ray engine (``--engine``: another, named on the page): oneshot_hfl (the paper's rule), random_clusters and
  oracle_hfl, each with the conf's shared layers and with none (independent LPS models), for the
  same number of training rounds (oneshot_hfl runs two more: its one-shot phase); per task the
  accuracy curves' mean and spread over the seeds (the paper's Figs. 2-3: "lower variance" with its
  clustering than with random clusters).

Writes ``<out>/results.md``, ``<out>/k_sweep.png``, ``<out>/curves.png`` and the run directories
under ``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from fedcluster_flwr.client import TaskInput
from fedcluster_flwr.clustering import cluster_scores
from fedcluster_flwr.algorithms.oneshot.math import RELEVANCE_RULES, cluster_by_relevance, relevance_matrix, within_and_across
from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.results.run_files import read_rounds
from fedcluster_flwr.algorithms.oneshot.strategy import feature_config
from fedcluster_flwr.algorithms.oneshot.tasks import (
    EIGEN_FLOOR_KEY,
    EIGENVALUES,
    EIGENVECTORS,
    NUM_EIGENVECTORS_KEY,
    RELEVANCE,
    relevance_to_every_client,
    top_gram_eigenpairs,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import ENGINES, mean_std, run_or_reuse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "oneshot_fmnist_3tasks.yaml"
KS = (1, 2, 3, 5, 8, 10, 20, 30, 50)
TASKS = {"0": "clothes", "1": "shoes", "2": "bags"}
METHODS = ("oneshot_hfl", "random_clusters", "oracle_hfl")
RANDOM = 0  # key of the random clustering in a sweep's results


# ---- clustering vs k --------------------------------------------------------------------------


def clustering_vs_k(seed: int, ks: tuple[int, ...]) -> dict[str, dict[int, dict[str, float]]]:
    """Per relevance rule and k: purity, ARI, NMI and mean R within/across the true tasks; and
    under ``RANDOM``, the scores of a random clustering into as many clusters."""
    config, _ = load_config(CONF, [("seed", seed)])
    options = config.strategy.options
    true = Experiment(config).data()[1].true_clusters
    clients = [Experiment(config).client(pid, config.partition.num_clients) for pid in range(config.partition.num_clients)]
    top = feature_config(options, 784, seed, share_eigenvalues=True) | {NUM_EIGENVECTORS_KEY: max(ks)}
    summaries = []
    for client in clients:
        blocks = top_gram_eigenpairs(client, TaskInput(1, {}, top)).blocks
        summaries.append((blocks[EIGENVECTORS][0], blocks[EIGENVALUES][0]))
    results: dict[str, dict[int, dict[str, float]]] = {}
    for rule in RELEVANCE_RULES:
        share = rule == "amiri"
        # the relevance instruction as the strategy sends it (strategy.feature_config, the conf's eigen_floor)
        config_k = feature_config(options, 784, seed, share_eigenvalues=share) | {EIGEN_FLOOR_KEY: options.eigen_floor}
        results[rule] = {}
        for k in ks:
            truncated = [[vectors[:k], values[:k]] if share else [vectors[:k]] for vectors, values in summaries]
            rows = np.stack([
                relevance_to_every_client(c, TaskInput(2, {EIGENVECTORS: truncated}, config_k))
                .blocks[RELEVANCE][0] for c in clients
            ])
            relevance = relevance_matrix(rows)
            labels = cluster_by_relevance(relevance, options.linkage, num_clusters=options.num_clusters).labels
            within, across = within_and_across(relevance, true)
            results[rule][k] = cluster_scores(true, labels) | {"within": within, "across": across}
    rng = np.random.default_rng(seed)
    random_labels = rng.permutation(np.arange(len(true)) % options.num_clusters)
    results["random"] = {RANDOM: cluster_scores(true, random_labels)}
    return results


def plot_k_sweep(sweeps: list[dict], ks: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"paper": "-", "amiri": "--"}
    for rule in RELEVANCE_RULES:
        ari = np.array([[s[rule][k]["ari"] for k in ks] for s in sweeps])
        ax.errorbar(ks, ari.mean(0), yerr=ari.std(0), marker="o", ls=styles[rule], lw=1.4, capsize=3,
                    color="tab:blue", label=f"ARI ({rule})")
        for key, colour, label in (("within", "tab:green", "R within"), ("across", "tab:red", "R across")):
            values = np.array([[s[rule][k][key] for k in ks] for s in sweeps])
            ax.errorbar(ks, values.mean(0), yerr=values.std(0), marker="s", ls=styles[rule], lw=1.4, capsize=3,
                        color=colour, label=f"{label} ({rule})")
    random_ari = np.mean([s["random"][RANDOM]["ari"] for s in sweeps])
    ax.axhline(random_ari, color="grey", ls=":", lw=1, label=f"random clusters' ARI ({random_ari:.2f})")
    ax.set(xscale="log", xlabel="k (eigenvectors per client)", ylabel="mean ± std over seeds", ylim=(-0.1, 1.05),
           title="one-shot clustering vs k, Fashion-MNIST 3 tasks: the paper's rule (—) vs Amiri's (--)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- Ray runs ------------------------------------------------------------------------------------


def oneshot_bytes(summary: dict, direction: str) -> int:
    """Traffic of the one-shot clustering rounds (``gram_eigen`` and ``relevance``), ``up`` or
    ``down``; runs recorded before summary.json had ``bytes_by_phase`` carry it as ``oneshot_bytes_*``."""
    if "bytes_by_phase" not in summary:
        return summary[f"oneshot_bytes_{direction}"]
    phases = summary["bytes_by_phase"]
    return sum(phases.get(phase, {}).get(f"bytes_{direction}", 0) for phase in ("gram_eigen", "relevance"))


def run_dir(out: Path, method: str, shared: bool, seed: int, relevance: str | None = None) -> Path:
    rule = f"_{relevance}" if relevance else ""
    return out / "runs" / f"{method}{rule}_{'shared' if shared else 'independent'}_seed{seed}"


def train(method: str, shared: bool, seed: int, training_rounds: int, out: Path, relevance: str | None = None,
          engine: str | None = None) -> dict:
    rounds = training_rounds + (2 if method == "oneshot_hfl" else 0)
    items: dict[str, object] = {"seed": seed, "rounds": rounds, "strategy.name": method}
    if relevance is not None:
        items["strategy.relevance"] = relevance
    if not shared:
        items["strategy.shared_layers"] = []
    config, _ = load_config(CONF, list(items.items()))
    return run_or_reuse(config, run_dir(out, method, shared, seed, relevance), engine)


def task_curves(out: Path, method: str, seeds: list[int], training_rounds: int) -> dict[str, np.ndarray]:
    """Per task: seeds × training rounds of mean test accuracy (the GPS shares the conf's layers)."""
    offset = 2 if method == "oneshot_hfl" else 0  # the one-shot phase's two rounds
    curves: dict[str, list[list[float]]] = {t: [] for t in TASKS}
    for seed in seeds:
        rows = [r for r in read_rounds(run_dir(out, method, True, seed)) if r["round"] > offset]
        assert len(rows) == training_rounds, (method, seed, len(rows))
        for task in TASKS:
            curves[task].append([r["per_true_cluster_accuracy"][task] for r in rows])
    return {task: np.asarray(values) for task, values in curves.items()}


def plot_curves(curves: dict[str, dict[str, np.ndarray]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(11, 3.6), sharex=True)
    colours = {"oneshot_hfl": "tab:blue", "random_clusters": "tab:orange", "oracle_hfl": "tab:green"}
    for ax, (task, name) in zip(axes, TASKS.items()):
        for method, per_task in curves.items():
            values = per_task[task]
            rounds = np.arange(1, values.shape[1] + 1)
            mean, std = values.mean(0), values.std(0)
            ax.plot(rounds, mean, color=colours[method], lw=1.6, label=f"{method} (mean ± std, {len(values)} seeds)")
            ax.fill_between(rounds, mean - std, mean + std, color=colours[method], alpha=0.2)
        ax.set(title=f"{name} (task {task})", xlabel="training round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the report ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4,5")
    parser.add_argument("--training-rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "fmnist_3tasks")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="how the training runs execute (default: the conf's, Ray); a GPU machine without Ray: batched")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    sweeps = [clustering_vs_k(seed, KS) for seed in seeds]
    plot_k_sweep(sweeps, KS, args.out / "k_sweep.png")
    # the one-shot phase alone (and one LPS round) under Amiri's rule; the paper's is in the training runs
    amiri = [train("oneshot_hfl", True, seed, 1, args.out, relevance="amiri", engine=args.engine) for seed in seeds]
    summaries = {(m, shared): [train(m, shared, seed, args.training_rounds, args.out, engine=args.engine) for seed in seeds]
                 for m in METHODS for shared in (True, False)}
    oneshot = {"paper": summaries[("oneshot_hfl", True)], "amiri": amiri}
    curves = {m: task_curves(args.out, m, seeds, args.training_rounds) for m in METHODS}
    plot_curves(curves, args.out / "curves.png")

    n = len(seeds)
    lines = [
        "# One-shot HFL on Fashion-MNIST, 3 tasks (clothes 5 / shoes 3 / bags 2 users)\n",
        f"`python benchmarks/oneshot/run.py --seeds {args.seeds} --training-rounds {args.training_rounds}` "
        f"({(time.perf_counter() - started) / 60:.0f} min for the parts not reused); conf "
        f"`conf/oneshot_fmnist_3tasks.yaml`, Φ = identity (standardised pixels), mean ± std over seeds {args.seeds}.\n",
        "## Clustering (k = 5 eigenvectors): the paper's relevance rule vs Amiri et al.'s vs random clusters\n",
        "`paper`: eq. 3 compares ‖G_i v_k^(j)‖ with client i's own k-th eigenvalue; `amiri`: with client j's. "
        f"From the one-shot rounds of the {'Ray' if (args.engine or 'ray') == 'ray' else args.engine} runs; bytes are "
        "the one-shot phase's, all clients, serialized as Flower sends them.\n",
        "| clustering | purity | ARI | seeds with a perfect clustering | mean R within tasks | mean R across tasks | bytes up | bytes down |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rule, runs in oneshot.items():
        lines.append(
            f"| one-shot, `{rule}` | {mean_std([s['purity'] for s in runs], 2)} | {mean_std([s['ari'] for s in runs], 2)} | "
            f"{sum(s['ari'] == 1.0 for s in runs)}/{n} | {mean_std([s['relevance_within_true_clusters'] for s in runs])} | "
            f"{mean_std([s['relevance_across_true_clusters'] for s in runs])} | {oneshot_bytes(runs[0], 'up'):,} | "
            f"{oneshot_bytes(runs[0], 'down'):,} |")
    lines += [
        f"| random | {mean_std([s['random'][RANDOM]['purity'] for s in sweeps], 2)} | "
        f"{mean_std([s['random'][RANDOM]['ari'] for s in sweeps], 2)} | "
        f"{sum(s['random'][RANDOM]['ari'] == 1.0 for s in sweeps)}/{n} | – | – | – | – |",
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
        f"## Spread over the {n} seeds (the paper's Figs. 2-3; `curves.png`)\n",
        "Standard deviation across seeds of each task's accuracy (GPS sharing the hidden layer): at the last "
        "round, and its mean over all training rounds. Each seed draws its own partition and initial model "
        "(and, for random clusters, its own clusters).\n",
        "| task | std, last round: one-shot | random | oracle | std, mean over rounds: one-shot | random | oracle |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, name in TASKS.items():
        last = [f"{curves[m][task][:, -1].std():.4f}" for m in METHODS]
        over_rounds = [f"{curves[m][task].std(axis=0).mean():.4f}" for m in METHODS]
        lines.append(f"| {name} | " + " | ".join(last) + " | " + " | ".join(over_rounds) + " |")
    lines += [
        "",
        "## Clustering vs k (the paper's Fig. 4; `k_sweep.png`), both relevance rules\n",
        "| k | ARI paper | R within paper | R across paper | gap paper | ARI amiri | R within amiri | R across amiri | gap amiri |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in KS:
        cells = []
        for rule in RELEVANCE_RULES:
            rows = [s[rule][k] for s in sweeps]
            cells += [mean_std([r["ari"] for r in rows], 2), mean_std([r["within"] for r in rows]),
                      mean_std([r["across"] for r in rows]), mean_std([r["within"] - r["across"] for r in rows])]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    first = oneshot["paper"][0]
    clients = 10
    lines += [
        "",
        "## Communication of the one-shot phase\n",
        f"Per client, the paper's rule: {first['eigen_summary_floats']} floats up (k × d eigenvectors; Amiri's adds the "
        f"k eigenvalues: {amiri[0]['eigen_summary_floats']}), {clients} × that down, then one relevance row of {clients} "
        f"floats up; one model upload is {first['model_bytes']:,} bytes. LPS↔GPS traffic over the run (shared hidden "
        f"layer): {mean_std([s['bytes_gps'] for s in oneshot['paper']], 0)} bytes.",
    ]
    text = "\n".join(lines) + "\n"
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
