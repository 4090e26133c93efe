"""This project's side of the side-by-side check against the DAC reference code (issue #41): DAC and
random gossip, synchronous and sequential rounds, on a reduced copy of the paper's Table 2 setting,
evaluated as the reference evaluates, per true cluster and round by round; beside the reference's
own runs where their records are given.

    export FEDCLUSTER_DATA_DIR=/path/to/data OMP_NUM_THREADS=1 FLWR_TELEMETRY_ENABLED=0
    python benchmarks/dac/reference_check.py --out /tmp/refcheck                   # 2 methods x 2 orders x seeds 0-2
    python benchmarks/dac/reference_check.py --out /tmp/refcheck --reference /tmp/dacref-out   # + the reference's rows
    python benchmarks/dac/reference_check.py --out /tmp/refcheck --report-only --reference /tmp/dacref-out
    python benchmarks/dac/reference_check.py --out /tmp/same-init --set strategy.same_init=true   # a variant of ours

The setting (``conf/dac_fmnist_rot_unequal.yaml`` reduced): ``--clients`` clients (default 40) in
the reference's cluster shares 70/20/5/5 % (28/8/2/2) rotated 0/180/10/350°, ``--train`` training
(default 100, the reference's ``--n_data_train`` default) + 100 validation + 50 local test images
per client, ``cnn_zec_fmnist`` (the reference's ``CNNFashion``), batch 8, 3 epochs of Adam at lr
0.01, τ = 30, 5 neighbours, pretraining + ``--exchanges`` exchange rounds (default 12), the
in-process engine (sequential rounds need it).

Evaluated as the reference's ``main_fed.py`` does: every client's *best-validation* model (lowest
validation loss after any of its trainings so far: ``ClientUpdate.train``'s ``best_model``) on its
cluster's rotated copy of the official test set, here the first ``--final-test`` (default 2,000)
official test images held by no client of the run (the reference uses the whole 10,000); per
round, as the reference does not record, the first ``--round-test`` (200) of them for the best and
the current model. Beside it, this project's own metric: the best-validation model's accuracy on the
client's 50 local test images (``per_true_cluster_best_val_accuracy``).

The reference's records (``--reference``) are JSON lines written by ``reference_record.py``, which
runs a checkout of the reference code (not part of this project) and records: one row
per round ``{"round": r, "best": [...], "local": [...]}`` (accuracy in % of each client's
``best_model`` and ``local_model`` on its cluster's first 200 rotated test images, clients in the
reference's order, the first 70 % at 0°, the next 20 % at 180°, then 5 % at 10° and 5 % at 350°),
``r = -1`` after pretraining, and a last line ``{"final_full_test": [four cluster means in %],
"cluster_idx": [...], "n_sampled": [[...]], "seconds": s}``.
Files are named ``ref_<dac|random>_n<clients>_r<exchanges>_t<train>_s<seed>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.registry import strategy_class
from fedcluster_flwr.declarations.schema import ConfigError
from fedcluster_flwr.training import evaluate, set_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/tables.py
from tables import set_aside  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "dac_fmnist_rot_unequal.yaml"
OFFICIAL_TEST_START = 60_000  # the pool holds Fashion-MNIST's 60,000 training images, then its 10,000 test images
SHARES = (0.7, 0.2, 0.05, 0.05)  # the reference's cluster_idx: int(0.7 n), int(0.2 n), int(0.05 n), the rest
CLUSTERS = ("0°", "180°", "10°", "350°")
REFERENCE_NAMES = {"dac": "dac", "random_gossip": "random"}


def cluster_sizes(clients: int) -> list[int]:
    first = [int(share * clients) for share in SHARES[:3]]
    return first + [clients - sum(first)]


def experiment(method: str, order: str, seed: int, args: argparse.Namespace):
    overrides = {
        "seed": seed, "rounds": args.exchanges + 1, "strategy.name": method, "strategy.round_order": order,
        "simulation.engine": "inprocess", "partition.num_clients": args.clients,
        "partition.cluster_sizes": cluster_sizes(args.clients), "partition.samples_per_client": args.train + 150,
        "partition.val_fraction": 100 / (args.train + 150), "partition.test_fraction": 50 / (args.train + 150),
    }
    config, _ = load_config(CONF, list(overrides.items()) + [parse_override(item) for item in args.set])
    return config


def check_variant(args: argparse.Namespace) -> None:
    """``--out`` holds runs of one variant (``--set``): recorded in ``variant.json`` on first use, and
    a later invocation with other settings is refused rather than mixing its runs with these."""
    path = args.out / "variant.json"
    if not path.is_file() and args.set and (args.out / "runs").is_dir():
        raise SystemExit(f"error: --set: {args.out} holds runs of unrecorded settings; give a new --out")
    if path.is_file() and (before := json.loads(path.read_text())["set"]) != args.set:
        raise SystemExit(f"error: --set: {args.out} holds runs made with {before or 'no --set'}, not {args.set or 'none'}; "
                         "give a new --out")
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"set": args.set}) + "\n")


class ReferenceProtocol:
    """Each client's best-validation model, kept as the reference keeps ``best_model``, and both its
    best and its current model tested on its cluster's rotated official test images."""

    def __init__(self, config, args: argparse.Namespace, record: Path) -> None:
        pool, partition = Experiment(config).data()
        held = np.concatenate([*partition.train_indices, *partition.val_indices, *partition.test_indices])
        free = np.setdiff1d(np.arange(OFFICIAL_TEST_START, len(pool.labels)), held)[: args.final_test]
        self.true = partition.true_clusters
        first_of_cluster = {int(c): int(np.flatnonzero(self.true == c)[0]) for c in np.unique(self.true)}
        self.test = {c: pool.tensors(free, partition.transforms[pid]) for c, pid in first_of_cluster.items()}
        self.round_test = args.round_test
        self.build = Experiment(config).model_factory
        self.best_val: dict[int, float] = {}
        self.best_model: dict[int, list[np.ndarray]] = {}
        self.record = record
        self.strategy: Any = None

    def make_strategy(self, config):
        def make(setup):
            self.strategy = strategy_class(config.strategy.name)(config.strategy.options, setup)
            return self.strategy
        return make

    def accuracy(self, pid: int, weights: list[np.ndarray], count: int | None = None) -> float:
        model = self.build()
        set_weights(model, weights)
        x, y = self.test[int(self.true[pid])]
        return evaluate(model, x[:count], y[:count], torch.device("cpu"))[1]

    def on_round(self, row: dict[str, Any]) -> None:
        strategy = self.strategy
        for pid, (val_loss, _) in strategy.model_selection.best.items():
            if self.best_val.get(pid) != val_loss:  # a new lowest validation loss: this round's model
                self.best_val[pid] = val_loss
                self.best_model[pid] = [a.copy() for a in strategy.client_models[pid]]
        pids = sorted(self.best_model)
        entry = {"round": row["round"], "phase": row["phase"], "seconds": row["seconds"],
                 "best": [self.accuracy(p, self.best_model[p], self.round_test) for p in pids],
                 "current": [self.accuracy(p, strategy.client_models[p], self.round_test) for p in pids],
                 "own": row.get("per_true_cluster_best_val_accuracy", {})}
        with self.record.open("a") as out:
            out.write(json.dumps(entry) + "\n")

    def finish(self) -> dict[str, Any]:
        pids = sorted(self.best_model)
        final = {"final_best": [self.accuracy(p, self.best_model[p]) for p in pids],
                 "true_clusters": [int(self.true[p]) for p in pids],
                 "communication": self.strategy.communication.tolist()}
        with self.record.open("a") as out:
            out.write(json.dumps(final) + "\n")
        return final


def run(method: str, order: str, seed: int, args: argparse.Namespace) -> Path:
    run_dir = args.out / "runs" / f"{method}_{order}_seed{seed}"
    record = run_dir / "reference_check.jsonl"
    if finished(record):
        return record  # done before
    config = experiment(method, order, seed, args)
    if run_dir.exists():  # stopped before its last line: the protocol's best models are gone with it, so anew
        aside = set_aside(run_dir)
        print(f"{method} {order} seed {seed}: stopped before, set aside as {aside.name}; starting anew", flush=True)
    run_dir.mkdir(parents=True)
    protocol = ReferenceProtocol(config, args, record)
    started = time.perf_counter()
    run_in_process(config, run_dir, protocol.make_strategy(config), on_round=protocol.on_round)
    protocol.finish()
    print(f"{method} {order} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    return record


# ---- the report ----------------------------------------------------------------------------------


def cluster_means(values: list[float], true: np.ndarray) -> list[float]:
    values = np.asarray(values, dtype=float)
    return [float(values[true == c].mean()) for c in range(len(CLUSTERS))]


def finished(record: Path) -> bool:
    """A run of ours whose record has its last line (a run stopped early has only round rows)."""
    if not record.is_file():
        return False
    lines = record.read_text().splitlines()
    try:
        return bool(lines) and "true_clusters" in json.loads(lines[-1])
    except json.JSONDecodeError:  # a last line cut short by a stop
        return False


def ours(record: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    final = rows[-1]
    true = np.asarray(final["true_clusters"])
    rounds = rows[:-1]
    communication = np.asarray(final["communication"])
    own = communication[true == 1][:, true == 1].sum() / max(communication[true == 1].sum(), 1)
    return {
        "final": [100 * v for v in cluster_means(final["final_best"], true)],
        "own_metric": [100 * rounds[-1]["own"].get(str(c), float("nan")) for c in range(len(CLUSTERS))],
        "best_180": [100 * cluster_means(r["best"], true)[1] for r in rounds],
        "current_180": [100 * cluster_means(r["current"], true)[1] for r in rounds],
        "current_last": 100 * float(np.mean(rounds[-1]["current"])),
        "current_rounds": [100 * float(np.mean(r["current"])) for r in rounds],
        "dead": dead([100 * v for v in rounds[-1]["current"]]),
        "own_draws_180": float(own),
        "seconds": sum(r["seconds"] for r in rounds),
        "seed": int(record.parent.name.rsplit("seed", 1)[1]),
    }


def reference(record: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    final = next(r for r in rows if "final_full_test" in r)
    true = np.asarray(final["cluster_idx"])
    rounds = sorted((r for r in rows if "round" in r), key=lambda r: r["round"])
    sampled = np.asarray(final["n_sampled"])  # row i: how often client i sampled each client
    own = sampled[true == 1][:, true == 1].sum() / max(sampled[true == 1].sum(), 1)
    return {
        "final": final["final_full_test"],
        "best_180": [cluster_means(r["best"], true)[1] for r in rounds],
        "current_180": [cluster_means(r["local"], true)[1] for r in rounds],
        "current_last": float(np.mean(rounds[-1]["local"])),
        "current_rounds": [float(np.mean(r["local"])) for r in rounds],
        "dead": dead(rounds[-1]["local"]),
        "own_draws_180": float(own),
        "seconds": final["seconds"],
        "seed": int(record.stem.rsplit("_s", 1)[1]),
    }


# % on the round test: twice chance. A model that predicts one class scores that class's share of the
# first 200 test images (8-13.5 %); a dead run's clients read 6.5-15.5 %, a live run's mean is 40 % and up.
DEAD_AT = 20.0


def dead(current_percent: list[float]) -> bool:
    """A dead run: after the last exchange every client's current model is at most ``DEAD_AT`` %."""
    return bool(np.max(current_percent) <= DEAD_AT)


def mean_std(values: list[float]) -> str:
    """Mean ± sample std (ddof = 1; pages written before issue #53 printed the population std)."""
    values = [v for v in values if np.isfinite(v)]
    if not values:
        return "–"
    return f"{np.mean(values):.1f}" if len(values) == 1 else f"{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f}"


def report(args: argparse.Namespace, seeds: list[int]) -> str:
    rows: dict[str, list[dict[str, Any]]] = {}
    for method in args.methods:
        for order in args.orders:
            records = [args.out / "runs" / f"{method}_{order}_seed{s}" / "reference_check.jsonl" for s in seeds]
            rows[f"{method}, ours, {order}"] = [ours(r) for r in records if finished(r)]
        if args.reference:
            name = REFERENCE_NAMES[method]
            files = sorted(args.reference.glob(f"ref_{name}_n{args.clients}_r{args.exchanges}_t{args.train}_s*.jsonl"))
            rows[f"{method}, reference code"] = [reference(f) for f in files
                                                 if any("final_full_test" in line for line in f.read_text().splitlines())]
    variant = f"Ours with {', '.join(f'`{item}`' for item in args.set)}. " if args.set else ""
    lines = [
        f"{variant}{args.clients} clients ({'/'.join(map(str, cluster_sizes(args.clients)))} at 0/180/10/350°), {args.train} train + "
        f"100 validation images each, pretraining + {args.exchanges} exchanges. Test accuracy (%) of each client's "
        f"best-validation model on its cluster's rotated official test images (ours: {args.final_test} held by no "
        "client; the reference's own final test on the first 2,000), mean per cluster, mean ± sample std "
        "(ddof = 1) over runs; "
        "\"own metric\": ours on the clients' 50 local test images; own draws: the 180° clients' share of draws "
        "that went to the 180° cluster.\n",
        "| run | runs | " + " | ".join(CLUSTERS) + " | 180°, own metric | own draws (180°) | dead runs | s / run |",
        "|---|---|" + "---|" * (len(CLUSTERS) + 4),
    ]
    for name, results in rows.items():
        if not results:
            continue
        cells = [mean_std([r["final"][c] for r in results]) for c in range(len(CLUSTERS))]
        own_metric = mean_std([r["own_metric"][1] for r in results]) if "own_metric" in results[0] else "–"
        lines.append(f"| {name} | {len(results)} | " + " | ".join(cells) + f" | {own_metric} | "
                     f"{np.mean([r['own_draws_180'] for r in results]):.2f} | {sum(r['dead'] for r in results)} | "
                     f"{np.mean([r['seconds'] for r in results]):.0f} |")
    lines += ["", "The 180° cluster round by round (round 0: after pretraining), mean over runs: best-validation model / "
              "current model, on the first 200 rotated test images.\n",
              "| run | " + " | ".join(str(r) for r in range(args.exchanges + 1)) + " |",
              "|---|" + "---|" * (args.exchanges + 1)]
    for name, results in rows.items():
        if not results:
            continue
        length = min(len(r["best_180"]) for r in results)
        best = np.mean([r["best_180"][:length] for r in results], axis=0)
        current = np.mean([r["current_180"][:length] for r in results], axis=0)
        lines.append(f"| {name} | " + " | ".join(f"{b:.0f} / {c:.0f}" for b, c in zip(best, current)) + " |")
    lines += ["", "Every run: its seed, the table's accuracies, and every client's current model after the last exchange "
              "(mean over all clients, first 200 rotated test images; about 10 % is a model that predicts one class).\n",
              "| run | seed | " + " | ".join(CLUSTERS) + " | current models, last exchange |",
              "|---|---|" + "---|" * (len(CLUSTERS) + 1)]
    for name, results in rows.items():
        for r in sorted(results, key=lambda r: r["seed"]):
            lines.append(f"| {name} | {r['seed']} | " + " | ".join(f"{v:.1f}" for v in r["final"])
                         + f" | {r['current_last']:.1f} |")
    lines += ["", "Every run's current models round by round (round 0: after pretraining): accuracy (%) on the first "
              f"200 rotated test images, mean over all clients; dead: every client's at most {DEAD_AT:.0f} % after the "
              "last exchange.\n",
              "| run | seed | " + " | ".join(str(r) for r in range(args.exchanges + 1)) + " | dead |",
              "|---|---|" + "---|" * (args.exchanges + 2)]
    for name, results in rows.items():
        for r in sorted(results, key=lambda r: r["seed"]):
            lines.append(f"| {name} | {r['seed']} | " + " | ".join(f"{v:.0f}" for v in r["current_rounds"])
                         + f" | {'yes' if r['dead'] else 'no'} |")
    return "\n".join(lines) + "\n"


def made_by() -> str:
    """The page's first line: the command that wrote it, paths inside the project relative to it."""
    words = []
    for word in sys.argv[1:]:
        path = Path(word)
        if path.is_absolute() and path.resolve().is_relative_to(ROOT):
            word = str(path.resolve().relative_to(ROOT))
        words.append(shlex.quote(word))
    return f"Written by `python benchmarks/dac/reference_check.py {' '.join(words)}`.\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="run folders and the report (outside the repository)")
    parser.add_argument("--reference", type=Path, default=None, help="folder of the reference code's records")
    parser.add_argument("--methods", default="dac,random_gossip")
    parser.add_argument("--orders", default="synchronous,sequential")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--train", type=int, default=100)
    parser.add_argument("--exchanges", type=int, default=12)
    parser.add_argument("--final-test", type=int, default=2000)
    parser.add_argument("--round-test", type=int, default=200)
    parser.add_argument("--report-only", action="store_true", help="write the report from the runs there are")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of ours on top of the check's setting (a variant: give it its own --out)")
    args = parser.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.orders = [o for o in args.orders.split(",") if o]
    unknown = [m for m in args.methods if m not in REFERENCE_NAMES]
    if unknown:
        raise SystemExit(f"error: --methods: {unknown}; this check runs {', '.join(REFERENCE_NAMES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    experiment(args.methods[0], args.orders[0], seeds[0], args)  # a --set the config refuses fails here, before any run
    check_variant(args)
    if not args.report_only:
        for seed in seeds:
            for method in args.methods:
                for order in args.orders:
                    run(method, order, seed, args)
    text = made_by() + report(args, seeds)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:  # a --set the config refuses: the key and why, not a traceback
        raise SystemExit(f"error: {err}") from None
