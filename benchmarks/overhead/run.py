"""Overhead of a simulated round against the compute bound, on this machine's CPU (issues #23, #52).

    python benchmarks/overhead/run.py                    # 5 repetitions of a2 a1 b c d e, interleaved
    python benchmarks/overhead/run.py --repetitions 1 --set client.epochs=1   # a quick look
    python benchmarks/overhead/run.py --vs ../before     # b c d e also from a checkout of another commit
    python benchmarks/overhead/run.py --vs ../before --vs-variants b,d,e   # c only from this one

One round's work of Briggs et al.'s paper-scale setting (conf/flhc_mnist_label_swap.yaml with
``strategy.name=fedavg``: 100 clients of 600 MNIST training and 100 test samples, ``cnn_briggs``,
3 local epochs of SGD at batch 10, client fraction 0.2, so 20 clients train per round, and after
every round every client tests the global model on its own test split), timed five ways:

* a1, a2 -- the compute bound: a plain PyTorch loop doing exactly the round's SGD steps (the same
  model code, the same partition, the same batches per epoch), with the data already in memory;
  a1 in one process with one torch thread per core, a2 in one single-threaded process per core,
  each training its share of the clients at the same time. The bound is the better of the two.
  The same workers then time the round's evaluation (every client's test split through the
  global model), reported on its own as ``eval``.
* b -- our ``fedavg`` strategy on Flower's Ray engine, as ``fedcluster run`` runs it.
* c -- Flower's own ``FedAvg`` (``flwr.serverapp.strategy``, the Message API) with our ClientApp,
  through the same engine (:func:`fedcluster_flwr.run_process.simulate` with the ServerApp swapped):
  our ClientApp's ``train`` and ``evaluate`` tasks speak Flower's record names, so its stock FedAvg
  drives them.
* d -- our ``inprocess`` engine (its grid in one process, one torch thread).
* e -- our ``batched`` engine (its grid, the round's torch work executed together, one worker per core).

With ``--vs DIR`` (a checkout of another commit, e.g. the one before a change), b, c, d and e also
run from that checkout, with its own copy of this script as the worker (``b@vs`` ...), interleaved
with this checkout's: before/after side by side in one run.

Every variant runs in fresh processes. b, c and d run ``--rounds`` rounds; a round's time is the
wall time between the ends of consecutive rounds (so the first round, which carries Ray's and the
actors' start-up, client discovery and data loading, is left out), and the one-off start-up is
reported as ``start-up`` = end of round 1 - launch - one round. The variants run interleaved, one
repetition after another (a1 a2 b c d, a1 a2 b c d, ...), so that other load on the machine hits
them alike; the load average is recorded with every run. Writes ``<out>/overhead.json`` (every
repetition) and ``<out>/overhead.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower's telemetry off here and in every run started: nothing leaves the machine

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONF = ROOT / "conf" / "flhc_mnist_label_swap.yaml"  # Briggs et al.'s paper-scale setting
BASE_OVERRIDES = ("strategy.name=fedavg",)  # FedAvg on it: the round's work without clustering
VARIANTS = ("a2", "a1", "b", "c", "d", "e")  # a2 first: a1 is stopped at 3 x a2 + 60 s
BOUNDS = ("a1", "a2")
CORES = os.cpu_count() or 1


# ---- the experiment ------------------------------------------------------------------------------


def bench_config(overrides: list[str], rounds: int | None = None):
    from fedcluster_flwr.config.load import load_config, parse_override

    extra = [f"rounds={rounds}"] if rounds is not None else []
    config, _ = load_config(CONF, [parse_override(o) for o in (*BASE_OVERRIDES, *overrides, *extra)])
    return config


def clients_per_round(config) -> int:
    """How many clients train per round: FedAvg's rule, floor(fraction x clients), at least 1."""
    return max(1, int(config.strategy.options.client_fraction * config.partition.num_clients + 1e-9))


# ---- workers (each runs in a fresh process) ---------------------------------------------------------


def bound_worker(args: argparse.Namespace) -> dict[str, Any]:
    """A plain PyTorch loop over ``args.clients``' SGD steps, then the evaluation of ``args.eval_clients``.

    Prints ``ready`` once its data are in memory and starts when a line arrives on stdin, so that
    parallel workers start together."""
    import torch

    torch.set_num_threads(args.threads)
    from fedcluster_flwr.experiment import Experiment

    config = bench_config(args.set)
    settings = config.client
    clients = [int(p) for p in args.clients.split(",") if p]
    eval_clients = [int(p) for p in args.eval_clients.split(",") if p]
    data = {pid: Experiment(config).client_data(pid) for pid in sorted(set(clients) | set(eval_clients))}
    build = Experiment(config).model_factory
    global_state = dict(zip(build().state_dict(), (torch.from_numpy(a) for a in Experiment(config).weights())))
    print("ready", flush=True)
    sys.stdin.readline()

    model = build()
    started, cpu_started = time.time(), time.process_time()
    steps = 0
    for pid in clients:
        model.load_state_dict(global_state)  # every client starts from the round's global model
        model.train()
        optimizer = torch.optim.SGD(
            model.parameters(), lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay
        )
        x, y = data[pid].x_train, data[pid].y_train
        generator = torch.Generator().manual_seed(pid)
        for _ in range(settings.epochs):
            order = torch.randperm(len(y), generator=generator)
            for start in range(0, len(y), settings.batch_size):
                batch = order[start : start + settings.batch_size]
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
                steps += 1
    trained, cpu_trained = time.time(), time.process_time()
    model.load_state_dict(global_state)
    model.eval()
    with torch.no_grad():
        for pid in eval_clients:  # test loss and accuracy, as every client reports them
            logits = model(data[pid].x_test)
            torch.nn.functional.cross_entropy(logits, data[pid].y_test, reduction="sum").item()
            (logits.argmax(1) == data[pid].y_test).sum().item()
    return {"started": started, "trained": trained, "evaluated": time.time(), "steps": steps,
            "cpu_train_s": cpu_trained - cpu_started, "cpu_eval_s": time.process_time() - cpu_trained}


class _Stamps:
    """A RunProgress that notes when each round's row arrives."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, float, float]] = []  # (round, time, the row's own seconds)

    def start(self, *args: Any) -> None:
        pass

    def round_done(self, row: dict[str, Any]) -> None:
        self.rounds.append((row["round"], time.time(), row["seconds"]))

    def close(self) -> None:
        pass


def fedcluster_worker(args: argparse.Namespace) -> dict[str, Any]:
    """b: our fedavg through Flower's Ray engine, as ``fedcluster run`` runs it."""
    from fedcluster_flwr.runner import run_experiment

    config = bench_config(args.set, args.rounds)
    stamps = _Stamps()
    launched = time.time()
    run_experiment(config, Path(args.run_dir), progress=stamps)
    return {"launched": launched, "rounds": stamps.rounds}


def flower_fedavg_worker(args: argparse.Namespace) -> dict[str, Any]:
    """c: Flower's own FedAvg (Message API) with our ClientApp, through the same engine function as b."""
    from flwr.app import ArrayRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fedcluster_flwr import run_process
    from fedcluster_flwr.apps import server_app
    from fedcluster_flwr.experiment import Experiment

    config = bench_config(args.set, args.rounds)
    stamps: list[tuple[int, float, float]] = []
    num_clients = config.partition.num_clients

    class TimedFedAvg(FedAvg):
        """FedAvg that notes when each round ends (after its evaluation, as b's rows do)."""

        round_started = 0.0

        def configure_train(self, server_round, arrays, train_config, grid):
            self.round_started = time.perf_counter()
            return super().configure_train(server_round, arrays, train_config, grid)

        def aggregate_evaluate(self, server_round, replies):
            aggregated = super().aggregate_evaluate(server_round, replies)
            stamps.append((server_round, time.time(), time.perf_counter() - self.round_started))
            return aggregated

    strategy = TimedFedAvg(
        fraction_train=config.strategy.options.client_fraction,
        fraction_evaluate=1.0,  # FedAvg's default, and b's: every client tests the model every round
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=num_clients,
    )
    app = ServerApp()

    @app.main()
    def main(grid, context):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Experiment(config).model().state_dict()), num_rounds=args.rounds)

    server_app.ExperimentServerApp = lambda *a, **k: app  # what run_process.simulate serves
    launched = time.time()
    run_process.simulate(run_process.Job(config, Path(args.run_dir)), on_round=None)
    return {"launched": launched, "rounds": stamps}


def inprocess_worker(args: argparse.Namespace) -> dict[str, Any]:
    """d and e: the in-process engines (one torch thread per client, as they run), the engine the
    config's ``simulation.engine`` names."""
    from fedcluster_flwr.apps.server_app import run_in_process

    config = bench_config(args.set, args.rounds)
    stamps = _Stamps()
    launched = time.time()
    run_in_process(config, Path(args.run_dir), on_round=stamps.round_done)
    return {"launched": launched, "rounds": stamps.rounds}


WORKERS = {"bound": bound_worker, "b": fedcluster_worker, "c": flower_fedavg_worker, "d": inprocess_worker}
# The worker and the overrides of each variant (e is d on the batched engine).
VARIANT_WORKER = {"b": ("b", ()), "c": ("c", ()), "d": ("d", ("simulation.engine=inprocess",)),
                  "e": ("d", ("simulation.engine=batched",))}
VS = "@vs"  # the suffix of a variant run from the --vs checkout


# ---- the driver -------------------------------------------------------------------------------------


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


class Worker:
    """A worker in a process group of its own; :meth:`finish` ends the whole group (Ray included)."""

    def __init__(self, args: list[str], handshake: bool = False, root: Path = ROOT) -> None:
        """``handshake``: the worker says ``ready`` on stdout and waits for :meth:`go` (else its
        output goes to a log, shown if it fails); ``root``: the checkout whose package and copy of
        this script the worker runs."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        self.out = tempfile.NamedTemporaryFile(prefix="overhead_", suffix=".json", delete=False)
        self.out.close()
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, str(root / "benchmarks" / "overhead" / "run.py"), "--worker", *args, "--result", self.out.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE if handshake else self.log, stderr=self.log,
            text=True, start_new_session=True, cwd=root, env=env,
        )

    def wait_ready(self) -> None:
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            self.finish()
            raise RuntimeError(f"worker did not start: {line!r}")

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def finish(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The worker's result (None if it ran past ``timeout`` s or failed); its group ends either way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        exited = False
        while not exited and (deadline is None or time.monotonic() < deadline):
            # WNOWAIT: not reaped yet, so the group id cannot be reused before the group is killed
            exited = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            time.sleep(0 if exited else 0.2)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = self.process.wait()
        text = Path(self.out.name).read_text()
        os.unlink(self.out.name)
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        if not exited:
            return None
        if code != 0 or not text:
            raise RuntimeError(f"worker {self.process.args[3]} failed (exit {code}):\n{output[-3000:]}")
        return json.loads(text)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_kind(cmdline: str) -> str:
    """Which part of a simulation a process is: a client actor, a Ray daemon, or the driver."""
    if any(mark in cmdline for mark in ("ClientAppActor", "ray::IDLE", "default_worker.py")):
        return "actors"
    if "ray" in cmdline or "gcs_server" in cmdline:
        return "ray daemons"
    return "driver"


class CpuSampler(threading.Thread):
    """Samples, every second, the CPU time (user + system) of every process descended from
    ``roots`` (Ray's daemons and actors included), by kind: CPU time is what other load on the
    machine changes least, so it shows extra work where wall time is noisy. It samples during
    every variant, the bound's too, so that its own small cost falls on all alike."""

    def __init__(self, roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots = set(roots)
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.known: dict[int, tuple[str, float]] = {}  # every process seen, with its last CPU time
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((time.time(), self.snapshot()))
            self.stopped.wait(1.0)

    def snapshot(self) -> dict[int, tuple[str, float]]:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    text = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                fields = text[text.rindex(")") + 2 :].split()
                stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
        tree, grew = set(self.roots), True
        while grew:
            grew = False
            for pid, (parent, _) in stats.items():
                if parent in tree and pid not in tree:
                    tree.add(pid)
                    grew = True
        for pid in tree & stats.keys():
            if pid not in self.known:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                except OSError:
                    continue
                self.known[pid] = (process_kind(cmdline), 0.0)
            self.known[pid] = (self.known[pid][0], stats[pid][1])
        return dict(self.known)  # exited processes keep their last CPU time

    def stop(self) -> None:
        self.stopped.set()
        self.join()

    def cpu_at(self, when: float) -> dict[str, float]:
        """CPU seconds by kind at ``when``, interpolated between the samples around it."""
        totals = [(t, self._by_kind(snapshot)) for t, snapshot in self.samples]
        after = next((i for i, (t, _) in enumerate(totals) if t >= when), len(totals) - 1)
        (t0, a), (t1, b) = totals[max(after - 1, 0)], totals[after]
        share = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
        share = min(max(share, 0.0), 1.0)
        return {k: a.get(k, 0.0) + share * (b[k] - a.get(k, 0.0)) for k in b}

    @staticmethod
    def _by_kind(snapshot: dict[int, tuple[str, float]]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for kind, seconds in snapshot.values():
            totals[kind] = totals.get(kind, 0.0) + seconds
        return totals


def run_bound(processes: int, threads: int, clients: list[int], eval_clients: list[int], overrides: list[str],
              timeout: float | None) -> dict[str, Any]:
    """The bound with ``processes`` workers of ``threads`` torch threads, the clients dealt round-robin."""
    workers = [
        Worker(["bound", "--threads", str(threads), "--clients", ",".join(map(str, clients[k::processes])),
                "--eval-clients", ",".join(map(str, eval_clients[k::processes])), *_set_args(overrides)], handshake=True)
        for k in range(processes)
    ]
    for worker in workers:
        worker.wait_ready()
    before = load()
    sampler = CpuSampler([worker.process.pid for worker in workers])  # its cost falls on every variant alike
    sampler.start()
    for worker in workers:
        worker.go()
    try:
        results = [worker.finish(timeout) for worker in workers]
    finally:
        sampler.stop()
    if any(r is None for r in results):
        return {"train_s": None, "eval_s": None, "cpu_train_s": None, "cpu_eval_s": None,
                "timed_out_after_s": timeout, "load": before + load()}
    started = min(r["started"] for r in results)
    trained = max(r["trained"] for r in results)
    return {
        "train_s": trained - started,
        "cpu_train_s": sum(r["cpu_train_s"] for r in results),
        "cpu_eval_s": sum(r["cpu_eval_s"] for r in results),
        # each worker evaluates right after it trained; the evaluation's share is its own wall time
        "eval_s": max(r["evaluated"] - r["trained"] for r in results),
        "steps": sum(r["steps"] for r in results),
        "load": before + load(),
    }


def run_rounds(variant: str, rounds: int, overrides: list[str], vs: Path | None = None) -> dict[str, Any]:
    """b, c, d or e (``...@vs``: from the ``vs`` checkout) for ``rounds`` rounds: the time of each
    round after the first, and the start-up."""
    name, root = (variant[: -len(VS)], vs) if variant.endswith(VS) else (variant, ROOT)
    worker_name, extra = VARIANT_WORKER[name]
    with tempfile.TemporaryDirectory(prefix=f"overhead_{name}_") as tmp:
        before = load()
        worker = Worker([worker_name, "--rounds", str(rounds), "--run-dir", str(Path(tmp) / "run"),
                         *_set_args([*overrides, *extra])], root=root)
        sampler = CpuSampler([worker.process.pid])
        sampler.start()
        try:
            result = worker.finish()
        finally:
            sampler.stop()
    if len(result["rounds"]) != rounds:
        raise RuntimeError(f"variant {variant} recorded {len(result['rounds'])} of {rounds} rounds")
    ends = [t for _, t, _ in sorted(result["rounds"])]
    per_round = [b - a for a, b in zip(ends, ends[1:])]
    cpu = [sampler.cpu_at(t) for t in ends]
    cpu_per_round = [{k: b.get(k, 0.0) - a.get(k, 0.0) for k in b} for a, b in zip(cpu, cpu[1:])]
    return {
        "round_s": per_round,
        "round_median_s": statistics.median(per_round),
        "cpu_s": cpu_per_round,  # CPU seconds of each round after the first, by kind of process
        "cpu_median_s": statistics.median(sum(c.values()) for c in cpu_per_round),
        "inside_strategy_s": [s for _, _, s in sorted(result["rounds"])][1:],  # configure_fit .. end of evaluation
        "start_up_s": ends[0] - result["launched"] - statistics.median(per_round),
        "load": before + load(),
    }


def _set_args(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def estimate_minutes(args: argparse.Namespace, config) -> float:
    """Expected wall time from a few timed SGD steps in this process (one thread)."""
    import torch

    from fedcluster_flwr.experiment import Experiment

    torch.set_num_threads(1)
    data = Experiment(config).client_data(0)
    model = Experiment(config).model_factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.client.lr)
    batch = config.client.batch_size
    for warm in (True, False):
        started = time.perf_counter()
        for start in range(0, 20 * batch, batch):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(data.x_train[start : start + batch]),
                                              data.y_train[start : start + batch]).backward()
            optimizer.step()
    step = (time.perf_counter() - started) / 20
    per_client = config.client.epochs * -(-len(data.y_train) // batch) * step
    round_s = clients_per_round(config) * per_client * 1.15 / CORES  # + evaluation
    per_variant = {"a1": round_s * 1.5, "a2": round_s, "b": (args.rounds + 0.5) * round_s,
                   "c": (args.rounds + 0.5) * round_s, "d": args.inprocess_rounds * round_s * CORES,
                   "e": args.inprocess_rounds * round_s}
    return args.repetitions * sum(per_variant[v.removesuffix(VS)] for v in args.variants) / 60


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(reps: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Medians over repetitions, the bound (the better of a1 and a2) and the ratios."""
    medians: dict[str, Any] = {}
    for v in variants:
        runs = [rep[v] for rep in reps if v in rep]
        if v in BOUNDS:
            medians[v] = {key: median_or_none([r[key] for r in runs])
                          for key in ("train_s", "eval_s", "cpu_train_s", "cpu_eval_s")}
        else:
            kinds = sorted({k for r in runs for c in r["cpu_s"] for k in c})
            medians[v] = {"round_s": statistics.median(r["round_median_s"] for r in runs),
                          "cpu_s": statistics.median(r["cpu_median_s"] for r in runs),
                          "cpu_by_kind_s": {k: statistics.median(c.get(k, 0.0) for r in runs for c in r["cpu_s"])
                                            for k in kinds},
                          "start_up_s": statistics.median(r["start_up_s"] for r in runs)}
    summary: dict[str, Any] = {"medians": medians}
    bounds = {v: medians[v] for v in BOUNDS if v in medians and medians[v]["train_s"] is not None}
    if bounds:
        best = min(bounds, key=lambda v: bounds[v]["train_s"])
        bound = bounds[best]
        summary |= {"bound": best, "a_s": bound["train_s"], "eval_s": bound["eval_s"]}
        cpu_bound = bounds.get("a2", bound)  # one thread per process: the CPU time the steps need
        summary |= {"a_cpu_s": cpu_bound["cpu_train_s"], "eval_cpu_s": cpu_bound["cpu_eval_s"]}
        for v in ("b", "c", "d", "e"):
            if v in medians:
                summary[f"{v}/a"] = medians[v]["round_s"] / bound["train_s"]
                summary[f"{v}/(a+eval)"] = medians[v]["round_s"] / (bound["train_s"] + bound["eval_s"])
                summary[f"{v}/(a+eval) cpu"] = medians[v]["cpu_s"] / (cpu_bound["cpu_train_s"] + cpu_bound["cpu_eval_s"])
    if "b" in medians and "c" in medians:
        summary["b/c"] = medians["b"]["round_s"] / medians["c"]["round_s"]
        summary["b/c cpu"] = medians["b"]["cpu_s"] / medians["c"]["cpu_s"]
    for v in ("b", "c", "d", "e"):  # this checkout against the --vs one
        if v in medians and v + VS in medians:
            summary[f"{v}/{v}{VS}"] = medians[v]["round_s"] / medians[v + VS]["round_s"]
            summary[f"{v}/{v}{VS} cpu"] = medians[v]["cpu_s"] / medians[v + VS]["cpu_s"]
            summary[f"{v}/{v}{VS} start-up"] = medians[v]["start_up_s"] / medians[v + VS]["start_up_s"]
    return summary


def fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


WHAT = {
    "a1": f"plain PyTorch, 1 process x {CORES} threads",
    "a2": f"plain PyTorch, {CORES} processes x 1 thread",
    "b": "our fedavg, Flower's Ray engine (`fedcluster run`)",
    "c": "Flower's FedAvg + our ClientApp, same engine",
    "d": "our fedavg, our `inprocess` engine (1 process, 1 thread)",
    "e": f"our fedavg, our `batched` engine (1 process, {CORES} workers)",
}


def what(variant: str) -> str:
    return WHAT[variant] if not variant.endswith(VS) else f"{WHAT[variant[: -len(VS)]]}, from the --vs checkout"


def markdown(report: dict[str, Any]) -> str:
    s, reps, variants = report["summary"], report["repetitions"], report["variants"]
    m = s["medians"]
    lines = [
        f"# Overhead of a round: {report['setting']}",
        "",
        f"`{report['command']}` on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
        f"torch {report['machine']['torch']}, flwr {report['machine']['flwr']}, ray {report['machine']['ray']}; "
        f"{len(reps)} repetitions, variants interleaved ({' '.join(variants)}, {' '.join(variants)}, ...); "
        f"started {report['started']}, took {report['wall_minutes']:.0f} min.",
        "",
        "Medians over the repetitions. a: the round's SGD steps only; eval: the round's evaluation "
        "(every client's test split through the global model) in the same form; b, c and d include "
        "their evaluation. CPU s: user + system time of every process of the variant (Ray's too).",
        "",
        "| variant | what | wall s per round | CPU s per round | start-up s |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        if v in BOUNDS:
            mark = " (bound)" if s.get("bound") == v else ""
            lines.append(f"| {v}{mark} | {WHAT[v]} | {fmt(m[v]['train_s'])} + eval {fmt(m[v]['eval_s'])} | "
                         f"{fmt(m[v]['cpu_train_s'])} + eval {fmt(m[v]['cpu_eval_s'])} | – |")
        else:
            lines.append(f"| {v} | {what(v)} | {fmt(m[v]['round_s'])} | {fmt(m[v]['cpu_s'])} | {fmt(m[v]['start_up_s'], 1)} |")
    lines += ["", "| ratio | wall | CPU |", "|---|---|---|"]
    for v in ("b", "c", "d", "e"):
        if f"{v}/a" in s:
            lines.append(f"| {v}/a | {fmt(s[f'{v}/a'], 3)} | – |")
            lines.append(f"| {v}/(a+eval) | {fmt(s[f'{v}/(a+eval)'], 3)} | {fmt(s[f'{v}/(a+eval) cpu'], 3)} |")
    if "b/c" in s:
        lines.append(f"| b/c | {fmt(s['b/c'], 3)} | {fmt(s['b/c cpu'], 3)} |")
    for v in ("b", "c", "d", "e"):
        if f"{v}/{v}{VS}" in s:
            lines.append(f"| {v}/{v}{VS} | {fmt(s[f'{v}/{v}{VS}'], 3)} | {fmt(s[f'{v}/{v}{VS} cpu'], 3)} "
                         f"(start-up {fmt(s[f'{v}/{v}{VS} start-up'], 3)}) |")
    kinds = sorted({k for v in variants if v not in BOUNDS for k in m[v]["cpu_by_kind_s"]})
    if kinds:
        lines += ["", "CPU s per round by process: " + "; ".join(
            f"{v}: " + ", ".join(f"{k} {fmt(m[v]['cpu_by_kind_s'].get(k))}" for k in kinds)
            for v in variants if v not in BOUNDS)]
    lines += ["", "## Every repetition", "",
              "| rep | variant | wall s per round (each) | CPU s per round (each) | start-up s | eval s (CPU s) | "
              "load avg 1/5/15 min before; after |",
              "|---|---|---|---|---|---|---|"]
    for i, rep in enumerate(reps, 1):
        for v in variants:
            r = rep.get(v)
            if r is None:
                continue
            ld = f"{r['load'][:3]}; {r['load'][3:]}"
            if v in BOUNDS:
                took = fmt(r["train_s"]) if r["train_s"] is not None else f"stopped after {r['timed_out_after_s']:.0f}"
                lines.append(f"| {i} | {v} | {took} | {fmt(r.get('cpu_train_s'))} | – | "
                             f"{fmt(r['eval_s'])} ({fmt(r.get('cpu_eval_s'))}) | {ld} |")
            else:
                each = ", ".join(fmt(x) for x in r["round_s"])
                cpu = ", ".join(fmt(sum(c.values())) for c in r["cpu_s"])
                lines.append(f"| {i} | {v} | {each} | {cpu} | {fmt(r['start_up_s'], 1)} | – | {ld} |")
    return "\n".join(lines) + "\n"


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    import ray
    import torch

    from fedcluster_flwr.numerics import cpu_identity

    return {"cpu": cpu_identity()[1] or platform.processor(), "cores": CORES, "torch": torch.__version__,
            "flwr": version("flwr"), "ray": ray.__version__, "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of b and c (the first is start-up; default 3)")
    parser.add_argument("--inprocess-rounds", type=int, default=2, help="rounds of d (default 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--vs", type=Path, default=None,
                        help="a checkout of another commit: b, c, d and e also run from it (b@vs ...), interleaved")
    parser.add_argument("--vs-variants", default="b,c,d,e",
                        help="which of b, c, d, e run from the --vs checkout too (one its own worker cannot run is left out)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (all variants)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--clients", default="", help=argparse.SUPPRESS)
    parser.add_argument("--eval-clients", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args)
        Path(args.result).write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # Flower may leave non-daemon threads behind; the driver ends the process group

    args.variants = args.variants.split(",")
    if args.vs is not None:
        if not (args.vs / "benchmarks" / "overhead" / "run.py").is_file():
            parser.error(f"--vs {args.vs}: not a checkout of this project (no benchmarks/overhead/run.py)")
        args.vs = args.vs.resolve()
        paired = set(args.vs_variants.split(",")) & set(VARIANT_WORKER)
        args.variants = [w for v in args.variants for w in ((v, v + VS) if v in paired else (v,))]  # side by side
    unknown = {v.removesuffix(VS) for v in args.variants} - set(VARIANTS)
    if unknown or args.rounds < 2 or args.inprocess_rounds < 2:
        parser.error(f"variants are {', '.join(VARIANTS)}; --rounds and --inprocess-rounds must be >= 2")
    config = bench_config(args.set)
    clients = list(range(clients_per_round(config)))  # every client holds as many samples: which ones is immaterial
    eval_clients = list(range(config.partition.num_clients))
    command = "python benchmarks/overhead/run.py " + " ".join(sys.argv[1:])
    print(f"{command}: expected wall time ~{estimate_minutes(args, config):.0f} min on this machine now", flush=True)
    started, report_started = time.time(), time.strftime("%Y-%m-%d %H:%M")
    reps: list[dict[str, Any]] = []
    for rep in range(args.repetitions):
        runs: dict[str, Any] = {}
        for v in args.variants:
            if v == "a2":
                runs[v] = run_bound(CORES, 1, clients, eval_clients, args.set, None)
            elif v == "a1":  # under other load, threads that wait on each other can take many times longer
                cap = 3 * runs["a2"]["train_s"] + 60 if runs.get("a2", {}).get("train_s") else None
                runs[v] = run_bound(1, CORES, clients, eval_clients, args.set, cap)
            else:
                in_process = v.removesuffix(VS) in ("d", "e")
                runs[v] = run_rounds(v, args.inprocess_rounds if in_process else args.rounds, args.set, args.vs)
            r = runs[v]
            wall, cpu = (r["train_s"], r["cpu_train_s"]) if v in BOUNDS else (r["round_median_s"], r["cpu_median_s"])
            print(f"repetition {rep + 1}/{args.repetitions} {v}: {fmt(wall)} s, CPU {fmt(cpu)} s per round "
                  f"(load {r['load'][:3]})", flush=True)
        reps.append(runs)
        left = (time.time() - started) / (rep + 1) * (args.repetitions - rep - 1) / 60
        print(f"repetition {rep + 1} done; about {left:.0f} min left", flush=True)
    report = {
        "setting": f"{CONF.relative_to(ROOT)} with {' '.join(BASE_OVERRIDES + tuple(args.set))}: "
                   f"{len(clients)} clients x {config.client.epochs} epochs x 600 samples, {config.model.name}, "
                   f"batch {config.client.batch_size}; evaluation on all {len(eval_clients)} clients",
        "command": command, "machine": machine(), "started": report_started,
        "wall_minutes": (time.time() - started) / 60, "variants": args.variants,
        "rounds": args.rounds, "inprocess_rounds": args.inprocess_rounds,
        "repetitions": reps, "summary": summarize(reps, args.variants),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(report, indent=1))
    (args.out / "overhead.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
