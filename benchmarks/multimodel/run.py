"""IFCA vs gradloss (Lin et al.) on class subsets, oracle and FedAvg beside them, over seeds.

    python benchmarks/multimodel/run.py --paper                         # Lin et al.'s setting (conf/lin_*)
    python benchmarks/multimodel/run.py --paper --methods gradloss-0-sum,gradloss-0.2-sum,gradloss-0.2-mean \
        --seeds 0,1,2,3,4 --rounds 20                                   # the first 20 iterations; resumable
    python benchmarks/multimodel/run.py --paper --conf lin_fmnist_mlp.yaml --seeds 0,1,2
    python benchmarks/multimodel/run.py --scale reduced                 # the practical setting, ≈ 30 min
    python benchmarks/multimodel/run.py --scale full --conf multimodel_fmnist_cnn.yaml
    python benchmarks/multimodel/run.py --methods gradloss-0.2-mean,gradloss-0.5-mean --seeds 0,1,2

``--paper`` runs the paper's algorithm (``conf/lin_*.yaml``: all 80 devices every iteration, one
gradient step on the selection mini-batch, one device forced into each cluster) for λ ∈ {0, 0.1,
0.2, 0.5} (λ = 0 is IFCA in the same mode) with the summed and the mean loss; with the mean loss
``client.lr`` is multiplied by ``selection_batch``, so the step w − lr·∇L is the same and only the
weight of L against λ·S changes. It runs in-process (``--engine inprocess``: the Ray engine's rounds
bit for bit, without its per-round cost; ``--engine ray`` for a check).

``--paper`` is a resumable table (``benchmarks/tables.py``): one run per (conf, method, seed), in
seed order (seed 0's methods first, so the seeds done are comparable), in run folders outside the
work tree (``--runs-dir``, default ``$FEDCLUSTER_TABLES_DIR/lin`` or ``~/fedcluster-tables/lin``),
checkpointed every iteration: Ctrl-C stops at the last checkpoint, and the same command again skips
the finished runs and resumes the stopped one. ``--rounds N`` asks for the first N iterations: a run
finished at fewer is extended from its checkpoint to N (the same iterations as a run started with N),
one finished at more is read up to N. Each finished run's summary, rounds, config and machine record
are copied into ``results/full/<run>/`` and the page ``results/full/results.md`` (with
``purity.png``) is rewritten from those copies after every run (``--render`` only rewrites it).
The input scaling is not a choice here: every dataset is standardised with its mean and std
(``data/datasets.py``); no config key selects x/255. The practical setting
(``conf/multimodel_*.yaml``: a quarter of the devices per round, each training its model for an
epoch) runs through Ray.

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

from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.results.files import atomic_write
from fedcluster_flwr.results.run_files import read_rounds, read_summary
from fedcluster_flwr.runner import Interrupted, continue_run, plan_continuation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py, tables.py
from common import ENGINES, mean_std, run_or_reuse, value_at  # noqa: E402
from tables import (  # noqa: E402
    StaleCopyError, TableRun, advance, default_runs_root, engine_label, execution_overrides, listed_state, record_attempt,
    recorded_attempts, run_state,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_METHODS = "ifca,gradloss-0.1,gradloss-0.2,gradloss-0.5,gradloss-0.2-mean,oracle,fedavg"
PAPER_METHODS = ",".join(
    [f"gradloss-{lam}-sum" for lam in ("0", "0.1", "0.2", "0.5")] + [f"gradloss-{lam}-mean" for lam in ("0.1", "0.2", "0.5")]
)
PURITY_TARGET = 0.9
ACCURACY_TARGET = 0.8
PURITY_ROUNDS = (1, 5, 10, 20)
PAPER_PURITY_ROUNDS = (5, 10, 20, 50, 100)
TABLE_RESULTS = Path(__file__).resolve().parent / "results" / "full"
PAPER_CLAIM = (
    "Lin et al. (Figs. 4-5): with λ = 0.2, up to 99 % fewer iterations than IFCA to purity 0.9 on MNIST "
    "(98 % Fashion-MNIST, 97 % EMNIST, 21 % CIFAR-10) and about 14 % fewer to accuracy 0.8"
)

# Overrides per scale; "full" is the conf file as it is.
SCALES: dict[str, dict[str, object]] = {
    "full": {},
    "reduced": {"rounds": 25, "partition.samples_per_client": 200},  # 160 train + 40 test per client
}
PAPER_SCALES: dict[str, dict[str, object]] = {
    "full": {},
    "reduced": {"rounds": 25, "partition.cluster_samples": [4375, 3625, 2750, 2750]},  # a quarter of the data
}


def method_overrides(method: str, paper: bool = False, base_lr: float = 0.0, batch: int = 0) -> dict[str, object]:
    """``ifca[-reseed]``, ``gradloss-<lambda>[-mean|-sum][-reseed]``, ``oracle`` or ``fedavg``.

    With ``paper`` (one gradient step per iteration), ``-mean`` also scales ``client.lr`` from the
    conf's per-sample ``base_lr`` by the mini-batch ``batch``: the step stays the same.
    """
    name, *options = method.split("-")
    items: dict[str, object] = {"strategy.name": name}
    for option in options:
        if option == "reseed" and name in ("ifca", "gradloss"):
            items["strategy.cluster_guard"] = "reseed_empty"
        elif option in ("mean", "sum") and name == "gradloss":
            items["strategy.loss_reduction"] = option
            if paper and option == "mean":
                items["client.lr"] = base_lr * batch
        elif name == "gradloss" and option.replace(".", "", 1).isdigit():
            items["strategy.lambda"] = float(option)
        else:
            raise SystemExit(f"error: {method}: unknown option {option!r} (see --help)")
    if name == "gradloss" and "strategy.lambda" not in items:
        raise SystemExit(f"error: {method}: give gradloss's lambda, e.g. gradloss-0.2")
    return items


def label(method: str) -> str:
    return f"{method} (IFCA)" if method.startswith("gradloss-0-") else method


def first_round(rows: list[dict], key: str, target: float) -> int | None:
    return next((r["round"] for r in rows if r.get(key) is not None and r[key] >= target), None)


def run_one(conf: Path, scale: str, method: str, seed: int, out: Path, engine: str) -> list[dict]:
    """One run of the practical setting (reused if it finished in ``out/runs`` before)."""
    items = SCALES[scale] | method_overrides(method) | {"seed": seed}
    config, _ = load_config(conf, list(items.items()))
    run_dir = out / "runs" / f"{method}_seed{seed}"
    run_or_reuse(config, run_dir, engine)
    return read_rounds(run_dir)


def relative_change(value: float | None, reference: float | None) -> str:
    if value is None or reference is None or reference == 0:
        return "–"
    return f"{100 * (value - reference) / reference:+.0f} %"


def table(results: dict[str, list[list[dict]]], rounds: int, purity_rounds: tuple[int, ...],
          seeds: dict[str, list[int]] | None = None) -> str:
    """Mean ± std over each method's runs; with ``seeds``, a column naming the seeds each one has."""
    shown = [r for r in purity_rounds if r <= rounds]
    columns = (["method"] + (["seeds"] if seeds else []) + [f"rounds to purity ≥ {PURITY_TARGET}"]
               + [f"purity r{r}" for r in shown]
               + [f"rounds to mean acc. ≥ {ACCURACY_TARGET}", "final mean acc.", "final purity", "s per run"])
    header = "| " + " | ".join(columns) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for method, runs in results.items():
        cells = [",".join(map(str, seeds[method]))] if seeds else []
        cells.append(mean_std([first_round(rows, "purity", PURITY_TARGET) for rows in runs], 1))
        cells += [mean_std([value_at(rows, "purity", r) for rows in runs], 2) for r in shown]
        cells.append(mean_std([first_round(rows, "mean_client_accuracy", ACCURACY_TARGET) for rows in runs], 1))
        cells.append(mean_std([rows[-1]["mean_client_accuracy"] for rows in runs]))
        cells.append(mean_std([rows[-1]["purity"] for rows in runs], 2))
        cells.append(mean_std([sum(r["seconds"] for r in rows) for rows in runs], 0))
        lines.append(f"| {label(method)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed_comparison(results: dict[str, list[list[dict]]], seeds: list[int], reference: str) -> str:
    """Iterations to purity 0.9 and to accuracy 0.8 per seed, and each method's change against
    ``reference`` (IFCA) on the same seed: the paper's "−99 %" is such a change."""
    lines = [
        "| method | seed | rounds to purity ≥ 0.9 | vs IFCA | rounds to acc. ≥ 0.8 | vs IFCA |",
        "|---|---|---|---|---|---|",
    ]
    for method, runs in results.items():
        for seed, rows, base in zip(seeds, runs, results[reference]):
            purity, base_purity = first_round(rows, "purity", PURITY_TARGET), first_round(base, "purity", PURITY_TARGET)
            acc = first_round(rows, "mean_client_accuracy", ACCURACY_TARGET)
            not_within = f"not in {rows[-1]['round']}"
            base_acc = first_round(base, "mean_client_accuracy", ACCURACY_TARGET)
            lines.append(
                f"| {label(method)} | {seed} | {purity or not_within} | {relative_change(purity, base_purity)} | "
                f"{acc or not_within} | {relative_change(acc, base_acc)} |"
            )
    return "\n".join(lines)


def plot_purity(results: dict[str, list[list[dict]]], path: Path, title: str, note: str = "") -> None:
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
        ax.plot(rounds, mean, lw=1.8, label=label(method))
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.15)
    ax.axhline(PURITY_TARGET, color="grey", ls="--", lw=1)
    ax.set(xlabel="round (iteration)", ylabel="purity (mean ± std over seeds)", ylim=(0, 1.02), title=title)
    if note:
        ax.text(0.01, 0.02, note, transform=ax.transAxes, fontsize=7, wrap=True, va="bottom")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paper_runs(conf: Path, scale: str, methods: list[str], seeds: list[int], rounds: int | None) -> list[TableRun]:
    """The table's runs, seed-major: every method of seed 0, then of seed 1, ..."""
    base, _ = load_config(conf, [])
    runs = []
    for seed in seeds:
        for method in methods:
            overrides = method_overrides(method, True, base.client.lr, base.strategy.options.selection_batch or 0)
            items = PAPER_SCALES[scale] | overrides | {"seed": seed} | ({"rounds": rounds} if rounds else {})
            config, _ = load_config(conf, list(items.items()))
            scaled = "" if scale == "full" else f"_{scale}"
            runs.append(TableRun(f"{conf.stem}{scaled}_{method}_seed{seed}", config,
                                 {"conf": conf.stem, "method": method, "seed": seed}))
    return runs


def extend_if_short(run_dir: Path, rounds: int, engine: str) -> None:
    """A run that finished before ``rounds`` continues from its checkpoint up to ``rounds``."""
    if run_state(run_dir) != "finished" or read_summary(run_dir)["completed_rounds"] >= rounds:
        return
    started = time.perf_counter()
    print(f"{run_dir.name}: extending to {rounds} iterations on {engine}", flush=True)
    done = read_summary(run_dir)["completed_rounds"]
    try:
        continue_run(plan_continuation(run_dir, overrides=execution_overrides(engine, None), rounds=rounds))
    finally:  # the attempt's time and machine beside the earlier ones, as tables.advance records them
        record_attempt(run_dir, engine, time.perf_counter() - started, done)
    print(f"{run_dir.name}: extended ({time.perf_counter() - started:.0f} s)", flush=True)


def finished_rows(results_dir: Path, name: str, rounds: int) -> list[dict] | None:
    """The first ``rounds`` rows of the run ``name``'s copy in ``results_dir``, if it has them all."""
    folder = results_dir / name
    if not (folder / "summary.json").is_file() or not read_summary(folder).get("finished"):
        return None
    rows = [row for row in read_rounds(folder) if row["round"] <= rounds]
    return rows if len(rows) == rounds else None


def wall_and_engine(folder: Path) -> tuple[float, str]:
    """Seconds over every attempt of a run, and the engines and devices that ran it."""
    attempts = recorded_attempts(folder)
    if not attempts:
        return float(read_summary(folder).get("wall_seconds") or 0.0), "–"
    return sum(a["seconds"] for a in attempts), ", ".join(sorted({engine_label(a) for a in attempts}))


SCALING_WORDS = {"standardized": "standardised (mean/std, dataset.scaling standardized)",
                 "unit": "x/255 in [0, 1] (dataset.scaling unit)"}


def render_paper_table(results_dir: Path, runs: list[TableRun], rounds: int, command: str) -> str:
    """``results.md`` and ``purity.png`` in ``results_dir`` from the finished runs' copies there."""
    methods = list(dict.fromkeys(run.labels["method"] for run in runs))
    conf = runs[0].labels["conf"]
    done: dict[str, dict[int, list[dict]]] = {m: {} for m in methods}
    walls: dict[str, list[tuple[float, str]]] = {m: [] for m in methods}
    for run in runs:
        rows = finished_rows(results_dir, run.name, rounds)
        if rows is not None:
            done[run.labels["method"]][run.labels["seed"]] = rows
            walls[run.labels["method"]].append(wall_and_engine(results_dir / run.name))
    results = {m: list(by_seed.values()) for m, by_seed in done.items() if by_seed}
    seeds_asked = sorted({run.labels["seed"] for run in runs})
    text = (
        f"# {conf}, the paper's algorithm, first {rounds} iterations: seeds done per method below\n\n"
        f"Written by `{command}` from the finished runs' copies in this folder (the command resumes: "
        f"run it again to continue). Seeds asked: {','.join(map(str, seeds_asked))}. Every device every "
        f"iteration, one gradient step, one device forced into each cluster; inputs "
        f"{SCALING_WORDS[runs[0].config.dataset.scaling]}. Purity over all clients; a cell `(k/n)` averages "
        f"the k of n seeds that reached the target within {rounds} iterations; `final` is iteration {rounds}.\n\n"
    )
    if not results:
        atomic_write(results_dir / "results.md", text + "No run has finished yet.\n")
        return text
    text += table(results, rounds, PAPER_PURITY_ROUNDS, {m: list(done[m]) for m in results})
    text += "\n\nWall time and engine per run (every attempt of a run added up; `s per run` above is the "
    text += "iterations' own time):\n\n"
    text += "| method | seconds per run (by seed) | engine |\n|---|---|---|\n"
    for method in results:
        seconds = ", ".join(f"{seed}: {wall:.0f}" for seed, (wall, _) in zip(done[method], walls[method]))
        text += f"| {label(method)} | {seconds} | {', '.join(sorted({e for _, e in walls[method]}))} |\n"
    reference = next((m for m in results if m.startswith("gradloss-0-")), None)
    if reference is not None:
        common_seeds = [s for s in done[reference] if all(s in done[m] for m in results)]
        if common_seeds:
            text += f"\nPer seed, against IFCA (λ = 0) on the same seed. {PAPER_CLAIM}.\n\n"
            text += per_seed_comparison({m: [done[m][s] for s in common_seeds] for m in results},
                                        common_seeds, reference) + "\n"
    atomic_write(results_dir / "results.md", text)  # another table command may render too
    plot_purity(results, results_dir / "purity.png", f"{conf} (paper's algorithm, {rounds} it.)", PAPER_CLAIM)
    return text


def paper_table(args: argparse.Namespace, conf: Path, scale: str, methods: list[str], seeds: list[int],
                engine: str) -> int:
    """``--paper``: advance the table (skip finished runs, resume a stopped one, start the next)."""
    runs = paper_runs(conf, scale, methods, seeds, args.rounds)
    rounds = runs[0].config.rounds
    runs_root = args.runs_dir or default_runs_root() / "lin"
    results_dir = args.out or TABLE_RESULTS
    results_dir.mkdir(parents=True, exist_ok=True)
    command = (f"python benchmarks/multimodel/run.py --paper --conf {conf.name} --methods {','.join(methods)} "
               f"--seeds {','.join(map(str, seeds))}" + (f" --rounds {args.rounds}" if args.rounds else ""))
    render = lambda: render_paper_table(results_dir, runs, rounds, command)  # noqa: E731
    if args.render:
        print(render())
        return 0
    try:
        if args.list:
            for run in runs:
                print(f"{listed_state(run, runs_root, results_dir):12s} {run.name}")
            return 0
        for run in runs:  # one at a time, so a short run is extended in its turn
            extend_if_short(runs_root / run.name, rounds, engine)
            advance([run], runs_root=runs_root, results_dir=results_dir, engine=engine, render=render)
    except Interrupted as stop:
        print(f"stopped: {stop}; run the same command again to continue", file=sys.stderr)
        return stop.exit_code
    except StaleCopyError as stale:
        print(f"error: {stale}", file=sys.stderr)
        return 2
    print(render())
    print(f"runs in {runs_root}, page in {results_dir / 'results.md'}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true", help="Lin et al.'s setting (conf/lin_*.yaml), λ and loss sweep")
    parser.add_argument("--scale", choices=sorted(SCALES), default=None, help="default: full with --paper, else reduced")
    parser.add_argument("--conf", default=None, help="a file in conf/ (default: lin_mnist_mlp.yaml with --paper, "
                                                     "else multimodel_mnist_mlp.yaml)")
    parser.add_argument("--methods", default=None)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="default: inprocess with --paper, else ray")
    parser.add_argument("--out", type=Path, default=None,
                        help="with --paper: where finished runs' small files and the page go (default results/full)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="with --paper: the first N iterations (default: the conf's); runs finished at fewer "
                             "are extended")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="with --paper: the run folders (default $FEDCLUSTER_TABLES_DIR/lin or ~/fedcluster-tables/lin)")
    parser.add_argument("--list", action="store_true", help="with --paper: every run and its state")
    parser.add_argument("--render", action="store_true", help="with --paper: only rewrite the page")
    args = parser.parse_args()
    if (args.rounds is not None or args.runs_dir or args.list or args.render) and not args.paper:
        parser.error("--rounds, --runs-dir, --list and --render belong to --paper")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    scale = args.scale or ("full" if args.paper else "reduced")
    conf_name = args.conf or ("lin_mnist_mlp.yaml" if args.paper else "multimodel_mnist_mlp.yaml")
    methods_arg = args.methods or (PAPER_METHODS if args.paper else DEFAULT_METHODS)
    engine = args.engine or ("inprocess" if args.paper else "ray")
    conf = ROOT / "conf" / conf_name
    if not conf.is_file():
        parser.error(f"--conf: no file {conf}")
    methods = [m.strip() for m in methods_arg.split(",") if m.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers expected, got {args.seeds!r}")
    for method in methods:
        method_overrides(method)  # reject a malformed method before hours of runs
    if args.paper:
        raise SystemExit(paper_table(args, conf, scale, methods, seeds, engine))
    out = args.out or Path(__file__).resolve().parent / "results" / f"{scale}_{conf.stem}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {m: [run_one(conf, scale, m, seed, out, engine) for seed in seeds] for m in methods}
    rounds = len(next(iter(results.values()))[0])
    command = (f"python benchmarks/multimodel/run.py --scale {scale} --conf {conf_name} "
               f"--methods {methods_arg} --seeds {args.seeds} --engine {engine}")
    what = "the practical setting: sampled devices train their model for epochs"
    text = (
        f"# {conf.stem}, {scale}: seeds {args.seeds}, {rounds} rounds ({what})\n\n"
        f"`{command}` ({(time.perf_counter() - started) / 60:.0f} min for the runs not reused; engine {engine}).\n"
        f"Overrides of the conf file: {SCALES[scale] or 'none'}. Purity over all clients with an identity; "
        f"a cell `(k/n)` averages the k seeds that reached the target.\n\n"
        f"{table(results, rounds, PURITY_ROUNDS)}\n"
    )
    reference = next((m for m in methods if m.startswith("gradloss-0-")), None)
    if reference is not None:
        text += f"\nPer seed, against IFCA (λ = 0) on the same seed. {PAPER_CLAIM}.\n\n"
        text += per_seed_comparison(results, seeds, reference) + "\n"
    (out / "results.md").write_text(text)
    plot_purity(results, out / "purity.png", f"{conf.stem} ({scale})")
    print(text)


if __name__ == "__main__":
    main()
