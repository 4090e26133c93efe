"""Round time of the shipped confs on the three engines, and the per-model measurement behind the
batched engine's CPU rule (benchmarks/engines/README.md).

    python benchmarks/engines/run.py models                  # stacked vs one client at a time, per model
    python benchmarks/engines/run.py rounds --confs default,dac_fmnist_rot4 --engines inprocess,batched \
        --rounds 2                                            # seconds per round from each run's rounds.jsonl
    python benchmarks/engines/run.py table results/all_confs.jsonl   # those rows as a markdown table
    python benchmarks/engines/run.py rounds --confs default --rounds 30 --vs ../before --repeat 3 --tag vs
                                                              # each run also from another commit's checkout, in turn
    python benchmarks/engines/run.py rounds --confs dac_fmnist_rot4 --engines batched,batched@2,ray --rounds 2
                                                              # batched@N: over N Ray actors on this machine

``models``: for every registered model on 28x28 (or 8x8 for the digits models) random inputs, K
clients x one epoch at the confs' batch sizes, timed alternately one client after another
(training.train) and stacked (engines.stacked.train_stacked) on one torch thread, as each of the
batched engine's CPU workers runs (one per core); the ratio is per pair. ``rounds``: each (conf, engine) is a fresh
``fedcluster run`` (the engine in its own process, as a user runs it); the table gives the median
seconds of the rounds after the first (round 1 holds start-up and, for DAC, pre-training) and the
whole run's wall time, the load before and after, and the CPU; each row is appended to
``results/<tag>.jsonl`` as its run ends, and a run that fails is a row with its error (``--confs all``:
every shipped conf, the CIFAR-10 ones included, which fail where CIFAR-10 is not on disk). With
``--vs DIR`` (a checkout of another commit) every run is made twice in turn, from this checkout and
from that one (``checkout``: this / vs), ``--repeat`` times: a speed claim of a change is their ratio,
measured side by side. Results go to benchmarks/engines/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower's telemetry off here and in every run started: nothing leaves the machine

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))

from fedcluster_flwr.engines.stacked import ClientBatchData, train_stacked  # noqa: E402
from fedcluster_flwr.models import MODELS, build_model  # noqa: E402
from fedcluster_flwr.numerics import cpu_identity  # noqa: E402
from fedcluster_flwr.training import TrainSettings, train  # noqa: E402

# model -> (input shape, batch size of the conf that uses it, optimizer)
MODEL_SETTINGS = {
    "cnn_briggs": ((1, 28, 28), 10, "sgd"),
    "cnn_zec_fmnist": ((1, 28, 28), 8, "adam"),
    "mlp_lin": ((1, 28, 28), 50, "sgd"),
    "cnn_lin": ((1, 28, 28), 50, "sgd"),
    "mlp_fmnist": ((1, 28, 28), 32, "sgd"),
    "mlp3": ((1, 28, 28), 10, "sgd"),
    "cnn_32_64_fc128": ((1, 28, 28), 10, "sgd"),
    "mlp_digits": ((1, 8, 8), 16, "sgd"),
    "cnn_digits": ((1, 8, 8), 16, "sgd"),
    "lenet_zec_cifar": ((3, 32, 32), 8, "adam"),
    "lenet_cifar": ((3, 32, 32), 32, "sgd"),
}


def time_models(clients: int, samples: int, repeat: int) -> list[dict]:
    torch.set_num_threads(1)  # as each of the batched engine's CPU workers runs
    rows = []
    for name in MODELS:
        if name not in MODEL_SETTINGS:
            continue
        shape, batch, optimizer = MODEL_SETTINGS[name]
        settings = TrainSettings(1, batch, 0.01, optimizer, 0.0, 0.0)
        data = [ClientBatchData(torch.randn(samples, *shape), torch.randint(0, 10, (samples,))) for _ in range(clients)]
        pairs = []
        for _ in range(repeat):
            models = [build_model(name, shape, 10) for _ in range(clients)]
            started = time.perf_counter()
            for k, (model, d) in enumerate(zip(models, data)):
                train(model, d.x, d.y, settings, torch.Generator().manual_seed(k), torch.device("cpu"))
            alone = time.perf_counter() - started
            started = time.perf_counter()
            train_stacked(models, data, settings, [torch.Generator().manual_seed(k) for k in range(clients)], torch.device("cpu"))
            pairs.append((alone, time.perf_counter() - started))
        steps = clients * -(-samples // batch)
        row = {
            "model": name, "batch": batch, "optimizer": optimizer, "clients": clients, "threads": torch.get_num_threads(),
            "alone_ms_per_client_step": 1e3 * statistics.median(a for a, _ in pairs) / steps,
            "stacked_ms_per_client_step": 1e3 * statistics.median(b for _, b in pairs) / steps,
            "stacked_over_alone": statistics.median(b / a for a, b in pairs),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def time_rounds(confs: list[str], engines: list[str], rounds: int, extra: list[str], log: Path,
                vs: Path | None = None, repeat: int = 1) -> list[dict]:
    """Each (conf, engine) as a fresh ``fedcluster run`` (with ``vs``: then the same from that checkout,
    in turn), ``repeat`` times; each row is appended to ``log`` as it ends, so a stopped sweep keeps
    what it measured. A run that fails is a row with its error, not the end."""
    rows = []
    checkouts = {"this": ROOT} | ({"vs": vs} if vs is not None else {})
    for conf in confs:
        for engine in engines:
            for repetition in range(repeat):
                for checkout, root in checkouts.items():
                    row = time_one_run(conf, engine, rounds, extra, root)
                    row |= {"checkout": checkout, "repetition": repetition} if vs is not None else {}
                    print(json.dumps(row), flush=True)
                    with log.open("a") as file:
                        file.write(json.dumps(row) + "\n")
                    rows.append(row)
    return rows


def time_one_run(conf: str, engine: str, rounds: int, extra: list[str], root: Path) -> dict:
    """One ``fedcluster run`` of the checkout at ``root`` (its package and its conf), timed from outside."""
    row: dict = {"conf": conf, "engine": engine, "rounds": rounds, "cpu": cpu_identity()[1], "load_before": os.getloadavg()[0]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        name, _, actors = engine.partition("@")  # batched@2: the batched engine over 2 Ray actors on this machine
        sharding = ["--set", f"simulation.batched_actors={actors}"] if actors else []
        command = [sys.executable, "-m", "fedcluster_flwr.cli", "run", str(root / "conf" / f"{conf}.yaml"),
                   "--out", str(out), "--set", f"simulation.engine={name}", "--set", f"rounds={rounds}", *sharding,
                   *[item for setting in extra for item in ("--set", setting)]]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env)
        row["wall_seconds"] = time.perf_counter() - started
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            row["error"] = lines[-1] if lines else f"exit code {done.returncode}"
        else:
            seconds = [json.loads(line)["seconds"] for line in (out / "rounds.jsonl").read_text().splitlines()]
            row |= {"round_seconds": seconds,
                    "median_after_first": statistics.median(seconds[1:]) if len(seconds) > 1 else None}
    row["load"] = os.getloadavg()[0]
    return row


def markdown_table(rows: list[dict]) -> str:
    """One line per run as ``rounds`` wrote them, and for each batched run its median round over that
    of the conf's in-process run before it (the pair it was timed with; the claim "batched is never
    slower than inprocess")."""
    lines = ["| conf | engine | first round s | median round s after the first | wall s | batched / inprocess | load before / after |",
             "|---|---|---:|---:|---:|---:|---:|"]
    last_inprocess: dict[str, float | None] = {}
    for row in rows:
        conf, engine = row["conf"], row["engine"]
        load = f"{row['load_before']:.1f} / {row['load']:.1f}"
        if engine == "inprocess":  # a failed one ends the pair too: no ratio against an older run
            last_inprocess[conf] = row.get("median_after_first")
        if "error" in row:
            lines.append(f"| {conf} | {engine} | failed: {row['error'][:70]} | | {row['wall_seconds']:.0f} | | {load} |")
            continue
        ratio = ""
        if engine == "batched" and last_inprocess.get(conf) and row["median_after_first"]:
            ratio = f"{row['median_after_first'] / last_inprocess[conf]:.2f}"
        lines.append(f"| {conf} | {engine} | {row['round_seconds'][0]:.2f} | {row['median_after_first']:.2f} | "
                     f"{row['wall_seconds']:.0f} | {ratio} | {load} |")
    return "\n".join(lines)


def vs_table(rows: list[dict]) -> str:
    """Rows of a ``--vs`` sweep: per (conf, engine), the median whole-run wall time and the median round
    after the first of each checkout, and this checkout's over the other's (medians of the ratios of
    the runs timed in turn, pair by pair)."""
    lines = ["| conf | engine | wall s: this / vs | ratio | round s after the first: this / vs | ratio | pairs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["conf"], r["engine"]) for r in rows}, key=lambda k: [r["conf"] for r in rows].index(k[0]))
    for conf, engine in keys:
        pairs: dict[int, dict[str, dict]] = {}
        for row in rows:
            if (row["conf"], row["engine"]) == (conf, engine) and "error" not in row:
                pairs.setdefault(row["repetition"], {})[row["checkout"]] = row
        whole = [p for p in pairs.values() if len(p) == 2]
        if not whole:
            continue

        def cell(key: str) -> str:
            this, other = (statistics.median(p[c][key] for p in whole) for c in ("this", "vs"))
            ratio = statistics.median(p["this"][key] / p["vs"][key] for p in whole)
            return f"{this:.2f} / {other:.2f} | {ratio:.3f}"

        lines.append(f"| {conf} | {engine} | {cell('wall_seconds')} | {cell('median_after_first')} | {len(whole)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    models = sub.add_parser("models")
    models.add_argument("--clients", type=int, default=20)
    models.add_argument("--samples", type=int, default=80)
    models.add_argument("--repeat", type=int, default=3)
    rounds = sub.add_parser("rounds")
    rounds.add_argument("--confs", default="default,lin_mnist_mlp,flhc_mnist_label_swap,dac_fmnist_rot4",
                        help="comma-separated conf names, or 'all' (every file in conf/)")
    rounds.add_argument("--engines", default="ray,inprocess,batched")
    rounds.add_argument("--rounds", type=int, default=3)
    rounds.add_argument("--set", action="append", default=[], help="an override for every run")
    rounds.add_argument("--tag", default="rounds")
    rounds.add_argument("--vs", type=Path, default=None, help="a checkout of another commit: every run also from it, in turn")
    rounds.add_argument("--repeat", type=int, default=1, help="times each (conf, engine) runs (with --vs: pairs)")
    table = sub.add_parser("table", help="print the rows of a rounds run (a results/<tag>.jsonl) as markdown")
    table.add_argument("jsonl", type=Path)
    args = parser.parse_args()
    if args.what == "table":
        rows = [json.loads(line) for line in args.jsonl.read_text().splitlines() if line.strip()]
        print(vs_table(rows) if any("checkout" in row for row in rows) else markdown_table(rows))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.what == "models":
        rows, name = time_models(args.clients, args.samples, args.repeat), "models"
    else:
        confs = sorted(p.stem for p in (ROOT / "conf").glob("*.yaml")) if args.confs == "all" else args.confs.split(",")
        rows = time_rounds(confs, args.engines.split(","), args.rounds, args.set, RESULTS / f"{args.tag}.jsonl",
                           args.vs.resolve() if args.vs else None, args.repeat)
        name = args.tag
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {RESULTS / f'{name}.json'}")


if __name__ == "__main__":
    main()
