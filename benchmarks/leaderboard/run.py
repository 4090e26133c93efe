"""One leaderboard: every registered strategy on five kinds of shift, same partitions, same seeds.

    python benchmarks/leaderboard/run.py --scale reduced                 # every method x shift x seeds 0-2
    python benchmarks/leaderboard/run.py --scale reduced --methods cfl,pacfl --shifts rotation
    python benchmarks/leaderboard/run.py --verify rotation/flhc/0        # one cell through Ray vs in-process
    python benchmarks/leaderboard/run.py --table-only                    # rebuild the table from finished cells
    python benchmarks/leaderboard/run.py --scale full --engine ray       # 100 clients (use a GPU)

Fashion-MNIST (needs it under $FEDCLUSTER_DATA_DIR), the same client training for every method and
every shift (``CLIENT``), and five shifts, each the setting of the paper that studied it:

=================  ==========================================================  ==================
shift              clients' true clusters                                       paper
=================  ==========================================================  ==================
``label_swap``     4 groups; group g swaps the label pair (2g, 2g+1)            Briggs, Sattler
                   (concept shift: same images, other labels)
``rotation``       4 groups; images rotated by 0/90/180/270° (covariate shift)  Zec (DAC)
``class_subsets``  4 groups, each 8 of the 10 classes                           Lin et al.
``label_groups``   Ali & Arafa's 3 tasks: clothes / shoes / bags, sizes 10/6/4,  Ali & Arafa
                   10 % of each client's samples from the other tasks
``pathological``   2 labels per client (McMahan's shards); a true cluster is a  Briggs, McMahan
                   label set, so almost every client is its own
=================  ==========================================================  ==================

Every cell of one (shift, seed) has the same partition and the same initial model (both follow
``seed``). Each method runs with its paper's defaults (``METHODS``), with two settings shared by all
and not tuned per shift: every client trains every round (``client_fraction: 1``, where a method
has it), and a method that takes a number of clusters is given 4 (the true number for label swap,
rotation and class subsets; a mis-specification for label groups (3) and pathological (one label
set per client), as it would be for a user who does not know the structure). Clustering methods
that cluster by a threshold instead (CFL's eps) use their defaults.

Output (``--out``, default ``results/<scale>``): one run directory per cell under
``runs/<shift>/<method>_seed<k>/`` (a finished cell is reused: the script resumes where it stopped;
not committed), ``cells.jsonl`` (each finished cell's numbers, one line a cell: what the table is
computed from, committed), ``leaderboard.md`` (mean client accuracy after the last round and ARI of
the final clustering against the true clusters, mean ± sample std over seeds; a personal-model
method's global model; the time per cell) and ``accuracy.png`` / ``ari.png`` (methods x shifts heat
maps). ``cells.jsonl`` gains or replaces the line of every cell finished in ``runs/`` and keeps the
others, so ``--table-only`` on a clean checkout renders the committed table from it. Cells run
in-process by default (one process, one torch thread: the Ray engine's rounds bit for bit, without
its per-round cost); ``--verify`` checks that claim on one cell.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedcluster_flwr.config.load import build_config
from fedcluster_flwr.registry import strategies
from fedcluster_flwr.results.run_files import read_rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import ENGINES, finished_summary, mean_std, run_or_reuse

NUM_CLUSTERS = 4  # given to every method that takes a number of clusters (see the module docstring)

# The five shifts (the ``partition`` section without num_clients / samples).
SHIFTS: dict[str, dict[str, Any]] = {
    "label_swap": {"name": "label_swap", "num_groups": 4},
    "rotation": {"name": "rotation", "angles": [0, 90, 180, 270]},
    "class_subsets": {"name": "class_subsets"},  # Lin et al.'s four subsets of 8 classes
    "label_groups": {
        "name": "label_groups",
        "groups": [[0, 1, 2, 3, 4, 6], [5, 7, 9], [8]],  # clothes / shoes / bags (Ali & Arafa)
        "cluster_shares": [0.5, 0.3, 0.2],  # their 5 / 3 / 2 users, scaled to num_clients
        "minority_fraction": 0.1,
    },
    "pathological": {"name": "pathological", "labels_per_client": 2},
}

# Each method's strategy section: the paper's defaults, plus the two shared settings.
ALL_CLIENTS = {"client_fraction": 1.0}
HFL_LAYERS = {"shared_layers": ["fc"], "lps_rounds": 1}  # Ali & Arafa: the GPS averages the hidden layer
METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg", **ALL_CLIENTS},
    "local": {"name": "local"},
    "oracle": {"name": "oracle", **ALL_CLIENTS},
    "fedprox": {"name": "fedprox", **ALL_CLIENTS},  # μ = 0.01 (ours, from Li et al.'s grid)
    "ditto": {"name": "ditto", **ALL_CLIENTS},  # λ = 0.1 (ours, from Li et al.'s grid); scored by the personal models
    # Briggs et al.: 10 rounds of FedAvg, then HAC of the updates; cosine/average was their best
    # label-swap setting; the cut is given as a number of clusters (no threshold carries across shifts).
    "flhc": {"name": "flhc", **ALL_CLIENTS, "rounds_before_clustering": 10, "distance": "cosine",
             "linkage": "average", "num_clusters": NUM_CLUSTERS},
    "ifca": {"name": "ifca", **ALL_CLIENTS, "num_clusters": NUM_CLUSTERS},
    "gradloss": {"name": "gradloss", **ALL_CLIENTS, "num_clusters": NUM_CLUSTERS},  # λ = 0.2
    # the absolute ε calibrated on digits and no split guard, with which the table was run (before relative
    # thresholds and gamma_max 0.6 became the defaults)
    "cfl": {"name": "cfl", "thresholds": "absolute", "gamma_max": 0.0},
    "oneshot_hfl": {"name": "oneshot_hfl", **ALL_CLIENTS, "num_clusters": NUM_CLUSTERS, "linkage": "average",
                    "num_eigenvectors": 5, **HFL_LAYERS},
    "pacfl": {"name": "pacfl", **ALL_CLIENTS, "num_clusters": NUM_CLUSTERS},
    "random_clusters": {"name": "random_clusters", **ALL_CLIENTS, "num_clusters": NUM_CLUSTERS, **HFL_LAYERS},
    "dac": {"name": "dac", **ALL_CLIENTS},  # τ = 30, 5 neighbours, the reference code's pretraining round
    "pens": {"name": "pens", **ALL_CLIENTS},
    "random_gossip": {"name": "random_gossip", **ALL_CLIENTS},
}
# Methods whose clustering is fixed by construction: their ARI says nothing and is not shown.
NO_CLUSTERING = ("fedavg", "fedprox", "ditto", "local", "oracle")

SCALES: dict[str, dict[str, Any]] = {
    # about an hour on 2 CPU cores for all 15 methods x 5 shifts x 3 seeds.
    "reduced": {"num_clients": 20, "samples_per_client": 500, "rounds": 30, "model": "mlp_fmnist"},
    # Briggs et al.'s scale: 100 clients x 600 samples, 50 rounds, a CNN (a GPU's job).
    "full": {"num_clients": 100, "samples_per_client": 600, "rounds": 50, "model": "cnn_32_64_fc128"},
}
CLIENT = {"epochs": 1, "batch_size": 16, "lr": 0.05, "optimizer": "sgd"}


def cell_config(scale: str, shift: str, method: str, seed: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The raw config of one cell (a mapping ``build_config`` takes)."""
    setting = SCALES[scale]
    partition = dict(SHIFTS[shift])
    if shares := partition.pop("cluster_shares", None):
        sizes = [round(share * setting["num_clients"]) for share in shares]
        sizes[0] += setting["num_clients"] - sum(sizes)
        partition["cluster_sizes"] = sizes
    partition |= {"num_clients": setting["num_clients"], "samples_per_client": setting["samples_per_client"],
                  "test_fraction": 0.2}
    raw = {
        "seed": seed,
        "rounds": setting["rounds"],
        "target_accuracy": 0.8,
        "dataset": {"name": "fashion_mnist"},
        "partition": partition,
        "model": {"name": setting["model"]},
        "client": dict(CLIENT),
        "strategy": dict(METHODS[method]),
    }
    for key, value in (extra or {}).items():  # dotted overrides, e.g. simulation.num_gpus_per_client
        section, _, leaf = key.rpartition(".")
        (raw.setdefault(section, {}) if section else raw)[leaf] = value
    return raw


def run_dir_of(out: Path, shift: str, method: str, seed: int) -> Path:
    return out / "runs" / shift / f"{method}_seed{seed}"


def run_cell(out: Path, scale: str, shift: str, method: str, seed: int, engine: str,
             extra: dict[str, Any]) -> dict[str, Any]:
    config, _ = build_config(cell_config(scale, shift, method, seed, extra))
    return run_or_reuse(config, run_dir_of(out, shift, method, seed), engine)


def verify(out: Path, scale: str, cell: str, extra: dict[str, Any]) -> None:
    """Run ``shift/method/seed`` in-process and through Ray; their rounds must agree."""
    shift, method, seed = cell.split("/")
    config, _ = build_config(cell_config(scale, shift, method, int(seed), extra))
    dirs = {engine: out / "verify" / engine / f"{shift}_{method}_seed{seed}" for engine in ("inprocess", "ray")}
    for engine, run_dir in dirs.items():
        run_or_reuse(config, run_dir, engine)
    rows = {engine: [{k: v for k, v in r.items() if k != "seconds"} for r in read_rounds(d)] for engine, d in dirs.items()}
    same = rows["inprocess"] == rows["ray"]
    print(f"{cell}: in-process and Ray rounds {'identical' if same else 'DIFFER'} "
          f"({len(rows['ray'])} rounds; final accuracy {rows['inprocess'][-1].get('mean_client_accuracy')} "
          f"vs {rows['ray'][-1].get('mean_client_accuracy')})")
    if not same:
        raise SystemExit(1)


def heat_map(values: np.ndarray, methods: list[str], shifts: list[str], title: str, path: Path, colour_label: str) -> None:
    """``values`` (methods x shifts) as a heat map, each cell labelled. The colours span the values'
    own range (a fixed 0-1 scale left accuracies of 0.67-0.97 in a few shades), which the colour
    bar's label (``colour_label`` and the range) says; a missing cell is white, marked "–"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(shifts) + 2.5, 0.45 * len(methods) + 1.5))
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    high = high if high > low else low + 1e-9  # one value everywhere: a valid scale all the same
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", vmin=low, vmax=high, aspect="auto")
    ax.set_xticks(range(len(shifts)), shifts, rotation=20, ha="right")
    ax.set_yticks(range(len(methods)), methods)
    for (i, j), value in np.ndenumerate(values):
        text = "–" if np.isnan(value) else f"{value:.2f}"
        bright = np.isnan(value) or value > low + 0.6 * (high - low)  # a missing cell is white
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color="black" if bright else "white")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.04, label=f"{colour_label} (colours span the data: {low:.2f} to {high:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# What cells.jsonl keeps of a finished cell's summary: what the tables show, and what lets a reader
# check them (each client's accuracy, the clustering, failures, which code made it).
CELL_KEYS = ("mean_client_accuracy", "mean_global_model_accuracy", "ari", "nmi", "purity", "num_clusters",
             "per_true_cluster_accuracy", "client_accuracy", "assignment", "fit_failures", "wall_seconds", "software")


def cell_row(run_dir: Path, shift: str, method: str, seed: int) -> dict[str, Any] | None:
    """The line of ``cells.jsonl`` for the cell run in ``run_dir``; None if it has not finished. ``seconds``
    is the rounds' own time (``rounds.jsonl``), without start-up."""
    summary = finished_summary(run_dir)
    if summary is None:
        return None
    row: dict[str, Any] = {"shift": shift, "method": method, "seed": seed}
    row |= {key: summary[key] for key in CELL_KEYS if key in summary}
    row["cpu_model"] = summary.get("numeric_platform", {}).get("cpu_model")
    row["seconds"] = sum(r["seconds"] for r in read_rounds(run_dir))
    return row


def collect_cells(out: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Every finished cell, by (shift, method, seed): the lines of ``out/cells.jsonl``, joined or replaced
    by the cells finished under ``out/runs``; written back (a new file, then renamed), so a cell's
    numbers outlive its run directory and a rerun of a cell replaces its line."""
    cells_file = out / "cells.jsonl"
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    if cells_file.is_file():
        for number, line in enumerate(cells_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                cells[(row["shift"], row["method"], int(row["seed"]))] = row
            except (ValueError, KeyError, TypeError) as err:
                raise SystemExit(f"error: {cells_file}, line {number}: not a cell's line ({err}); "
                                 "restore it from git or delete the line") from err
    for summary_file in sorted((out / "runs").glob("*/*_seed*/summary.json")):
        run_dir = summary_file.parent
        method, _, seed = run_dir.name.rpartition("_seed")
        if seed.isdigit() and (row := cell_row(run_dir, run_dir.parent.name, method, int(seed))) is not None:
            cells[(row["shift"], row["method"], row["seed"])] = row
    if cells:
        partial = cells_file.with_name(cells_file.name + ".partial")
        partial.write_text("".join(json.dumps(cells[key], sort_keys=True) + "\n" for key in sorted(cells)))
        partial.replace(cells_file)
    return cells


def report(out: Path, scale: str, methods: list[str], shifts: list[str], seeds: list[int], command: str) -> str:
    """leaderboard.md and the heat maps from the finished cells (:func:`collect_cells`; a missing cell is
    shown as such). Mean ± the sample std over the seeds (ddof 1), as a paper reports its seeds' spread."""
    cells = collect_cells(out)

    def values(key: str, shift: str, method: str) -> list[Any]:
        return [cells[(shift, method, k)].get(key) if (shift, method, k) in cells else None for k in seeds]

    def table(key: str, rows: list[str], skip: tuple[str, ...] = ()) -> list[str]:
        lines = ["| method | " + " | ".join(shifts) + " |", "|---|" + "---|" * len(shifts)]
        for m in rows:
            entries = ["–" if m in skip else mean_std(values(key, s, m), ddof=1) for s in shifts]
            lines.append(f"| {m} | " + " | ".join(entries) + " |")
        return lines

    def means(key: str, skip: tuple[str, ...] = ()) -> np.ndarray:
        grid = np.full((len(methods), len(shifts)), np.nan)
        for i, m in enumerate(methods):
            for j, s in enumerate(shifts):
                present = [v for v in values(key, s, m) if v is not None]
                if present and m not in skip:
                    grid[i, j] = np.mean(present)
        return grid

    shown = [cells[(s, m, k)] for s in shifts for m in methods for k in seeds if (s, m, k) in cells]
    total = len(shifts) * len(methods) * len(seeds)
    made_by = sorted({(row.get("software", {}).get("code", "unrecorded"), row.get("cpu_model") or "unrecorded")
                      for row in shown})
    minutes = sum(row["seconds"] for row in shown) / 60
    personal = [m for m in methods if any(v is not None for s in shifts for v in values("mean_global_model_accuracy", s, m))]
    setting = SCALES[scale]
    lines = [
        (f"# Leaderboard, {scale} scale: Fashion-MNIST, {setting['num_clients']} clients x {setting['samples_per_client']} "
        f"samples (80 % train), {setting['model']}, {setting['rounds']} rounds, seeds {','.join(map(str, seeds))}\n"),
        f"`{command}` ({len(shown)}/{total} cells finished; their rounds took {minutes:.0f} min in all). Client training "
        f"for every method: {CLIENT}. Methods that take a number of clusters are given {NUM_CLUSTERS}; every client "
        "trains every round. Same partition and initial model per (shift, seed). Mean ± sample std over seeds. "
        "Made by code " + "; ".join(f"{code} on {cpu}" for code, cpu in made_by) + " (each cell's line in "
        "`cells.jsonl`).\n",
        "## Mean client accuracy after the last round\n",
        *table("mean_client_accuracy", methods),
    ]
    if personal:
        lines += [
            "\n## The global model of the methods that keep personal models\n",
            ("(their row above scores each client's personal model; here the one global model the server "
            "sends, on the same clients' test data, after the last round)\n"),
            *table("mean_global_model_accuracy", personal),
        ]
    lines += [
        "\n## ARI of the final clustering against the true clusters\n",
        ("(`–`: the method's clusters are fixed by construction: one for fedavg, fedprox and ditto, one per client "
        "for local, the true ones for oracle. For gossip methods (dac, pens, random_gossip), the clustering of their "
        "similarity matrix.)\n"),
        *table("ari", methods, NO_CLUSTERING),
        "\n## Time per cell (s, mean over seeds, the rounds' own time)\n",
        "| method | " + " | ".join(shifts) + " |",
        "|---|" + "---|" * len(shifts),
    ]
    for m in methods:
        times = {s: [v for v in values("seconds", s, m) if v is not None] for s in shifts}
        lines.append(f"| {m} | " + " | ".join(f"{np.mean(times[s]):.1f}" if times[s] else "–" for s in shifts) + " |")
    heat_map(means("mean_client_accuracy"), methods, shifts, "mean client accuracy", out / "accuracy.png",
             "mean client accuracy, mean over seeds")
    heat_map(means("ari", NO_CLUSTERING), methods, shifts, "ARI against the true clusters", out / "ari.png",
             "ARI, mean over seeds")
    text = "\n".join(lines) + "\n"
    (out / "leaderboard.md").write_text(text)
    return text


def names(text: str, known: dict[str, Any], flag: str) -> list[str]:
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    if unknown := [item for item in chosen if item not in known]:
        raise SystemExit(f"error: {flag}: unknown {', '.join(unknown)}; available: {', '.join(known)}")
    return chosen


def main() -> None:
    from fedcluster_flwr.config.load import parse_override

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="reduced")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--shifts", default=",".join(SHIFTS), help=f"of {', '.join(SHIFTS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engine", choices=ENGINES, default="inprocess")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further override for every cell, e.g. simulation.num_gpus_per_client=0.0625")
    parser.add_argument("--verify", metavar="SHIFT/METHOD/SEED", help="run one cell in-process and through Ray; compare")
    parser.add_argument("--table-only", action="store_true", help="only rebuild the table from finished cells")
    args = parser.parse_args()
    extra = dict(parse_override(item) for item in args.set)
    out = args.out or Path(__file__).resolve().parent / "results" / args.scale
    out.mkdir(parents=True, exist_ok=True)
    if args.verify:
        verify(out, args.scale, args.verify, extra)
        return
    methods = names(args.methods, METHODS, "--methods")
    if missing := [m for m in methods if METHODS[m]["name"] not in strategies()]:
        raise SystemExit(f"error: --methods: {', '.join(missing)} not registered in this version")
    shifts = names(args.shifts, SHIFTS, "--shifts")
    seeds = [int(s) for s in args.seeds.split(",")]
    command = (f"python benchmarks/leaderboard/run.py --scale {args.scale} --methods {','.join(methods)} "
               f"--shifts {','.join(shifts)} --seeds {args.seeds}" + "".join(f" --set {item}" for item in args.set))
    if not args.table_only:
        for seed in seeds:  # seed-major: a partial run still covers every cell once
            for shift in shifts:
                for method in methods:
                    run_cell(out, args.scale, shift, method, seed, args.engine, extra)
    print(report(out, args.scale, methods, shifts, seeds, command))


if __name__ == "__main__":
    main()
