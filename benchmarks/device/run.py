"""One command for a GPU machine's few minutes (issues #39, #53): is the batched engine right on this
card, how fast is a full-scale DAC round, then as much of the paper tables' queued work as the time allows.

    python benchmarks/device/run.py --out "$OUT" --budget 500          # on the GPU machine
    python benchmarks/device/run.py --device cpu --tiny --out /tmp/dry  # the CPU dry run (slow test tier)

On a lent machine (no flwr there; ../shared/gpu/README.md): here ``bash benchmarks/device/bundle.sh
mnist`` (FL+HC's grid, the queue's first step with work left; ``fmnist`` for the step after it and
the timing step: see 3) writes ``.gpu/`` within the 64 MiB the working tree and carried paths may
take: the wheels, one dataset, no Ray; the device command,
with ``.gpu`` carried and a timeout above the budget plus about 40 s of setup (600 s for 500), is
``bash .gpu/setup.sh && . TMP/gpu-env.sh && python3 benchmarks/device/run.py --out "$OUT" --budget
500``. Back here: ``tar xzf results.tar.gz`` in the checkout, then ``python benchmarks/dac/table.py
--render`` and ``python benchmarks/flhc/sweep.py conf/flhc_mnist_pathological.yaml --render``, and
commit the copies with the pages. If the budget stopped a run, its folder came back too:
``cat resume.tar.gz.* | tar xzf - -C ~/fedcluster-tables`` puts it where the table command resumes it.

1. **Agreement** (``agreement.json``): a small digits case of DAC and of FL+HC on ``inprocess``, on
   ``batched`` and (where Ray is installed) on ``batched`` in one Ray actor holding the GPU, on the
   device, with ``simulation.deterministic`` off and on: the same decisions (DAC's neighbour draws,
   FL+HC's clusters), no failed fit, accuracies within the engines' tolerance.
2. **Timing** (``timing.json``): a full-scale DAC round (``conf/dac_fmnist_rot4.yaml``, 2 rounds:
   start-up + pretraining, then one exchange) on ``inprocess`` and ``batched``, side by side on the
   same card; the ratio is the claim.
3. **The tables** (``queue``, in this order, each on ``batched``, one step after the other until the
   budget ends): DAC Table 2's runs at 500 images not yet committed (seeds 1-2); DAC's low-data
   setting (``rot_unequal_low``) not yet committed (both are: neither has a step now); Briggs et
   al.'s Table IV grid (``benchmarks/flhc/sweep.py`` on ``conf/flhc_mnist_pathological.yaml``: l1,
   l2, cosine with complete linkage at K = 25, 75, 10, 50 and every client alone, then FedAvg), GPU
   work (about 75 hours of one CPU core); last DAC's 4 x 25 setting (``rot4``, Table 1's
   Fashion-MNIST) not yet committed, which the CPU tables run too (1.3-1.5 h a run there). Ali &
   Arafa at the conf's full length (28 training rounds, 6 seeds: what ``benchmarks/oneshot``'s page
   calls full scale, the paper giving no rounds or sizes) is not queued: it ran on the CPU in 58
   minutes (issue #41, ``benchmarks/oneshot/results/fmnist_3tasks_full/``). A step whose dataset the
   bundle did not carry is reported "not started", so the bundle picks the work: ``mnist`` the grid,
   ``fmnist`` ``rot4``. A table stops at its last checkpoint when the budget ends (SIGTERM).

What comes back: ``$OUT`` returns at most 8 files, two folders deep, so the run folders (checkpoints)
stay in ``--work`` and every finished run's small files are packed, as soon as the run ends, into
``$OUT/results.tar.gz`` under their repository paths (``benchmarks/dac/results/full/<run>/...``; FL+HC's
base, probe and thresholds too), rewritten whole each time (a new file, then renamed: a machine
taken back early leaves the last complete archive). ``tar xzf results.tar.gz`` in the checkout puts
them in place; then each table's ``--render`` rewrites its page. The runs the budget stopped (DAC's
and the sweep's; checkpoints included, with the sweep's shared rounds) come back as
``$OUT/resume.tar.gz.00``, ``.01``, ... (15 MiB parts, within the room the other files leave; a run
that does not fit is named in ``tables.json``): a lease's last run is resumed, not lost (a full-scale
DAC run's folder is about 23 MB). What is already committed is not run
again: the DAC steps skip runs with a finished copy in ``benchmarks/dac/results/full/``, the sweep
starts from a copy of its committed folder. ``--tiny`` shrinks every step (the
CPU dry run that keeps this script from rotting). Step 2 and each table read their dataset under
``$FEDCLUSTER_DATA_DIR`` (Fashion-MNIST; the grid MNIST); one the bundle did not carry is reported
as not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FEDCLUSTER_SYNC_DEBUG", "warn")  # a host sync inside the stacked step loop is logged on a GPU

from fedcluster_flwr.config.load import load_config, parse_override  # noqa: E402
from fedcluster_flwr.apps.server_app import run_in_process  # noqa: E402
from tables import SMALL_FILES, StaleCopyError, kept_copy  # noqa: E402

ENGINES = {"inprocess": ("simulation.engine=inprocess",), "batched": ("simulation.engine=batched",),
           "batched_actor": ("simulation.engine=batched", "simulation.batched_actors=1")}
ACCURACY_TOLERANCE = 1e-3  # on a GPU the two engines' kernels differ more than on a CPU
TINY_DAC = ("partition.num_clients=20", "partition.cluster_sizes=[5,5,5,5]", "partition.samples_per_client=60",
            "model.name=mlp_fmnist")
# The dry run's table runs: the tables' own commands at sizes a CPU finishes in seconds (never their runs).
TINY_TABLE = ("--rounds", "2", "--max-runs", "1", "--set", "model.name=mlp_fmnist", "--set", "partition.samples_per_client=14")
TINY_SWEEP = ("rounds=4", "strategy.rounds_before_clustering=2", "partition.num_clients=8", "partition.num_groups=2",
              "strategy.client_fraction=0.5")
DAC_RESULTS = ROOT / "benchmarks" / "dac" / "results" / "full"
FLHC_CONF = "flhc_mnist_pathological"
STOP_GRACE_S = 60  # a table stopped with SIGTERM writes its checkpoint first; after this it is killed


def configured(conf: str, *overrides: str):
    config, _ = load_config(ROOT / "conf" / conf, [parse_override(o) for o in overrides])
    return config


def agreement(device: str, work: Path) -> dict:
    cases = {"dac": ("strategy.name=dac", "rounds=4"),
             "flhc": ("strategy.name=flhc", "rounds=5", "strategy.rounds_before_clustering=2")}
    # the batched engine in one Ray actor holding the GPU (issue #57: one actor per GPU), where Ray is installed
    engines = ["inprocess", "batched", *(["batched_actor"] if importlib.util.find_spec("ray") else [])]
    report: dict = {} if "batched_actor" in engines else {"batched_actor": "not run: ray is not installed here"}
    for deterministic in (False, True):
        for case, overrides in cases.items():
            common = (*overrides, f"client.device={device}", f"simulation.deterministic={str(deterministic).lower()}")
            runs = {engine: run_in_process(configured("default.yaml", *common, *ENGINES[engine]),
                                           work / "agreement_runs" / f"{case}_{deterministic}_{engine}")
                    for engine in engines}
            rows = {e: s.observer.recorder.rows for e, s in runs.items()}
            gap = max(abs(a - b) for other in engines[1:] for ra, rb in zip(rows["inprocess"], rows[other])
                      for a, b in zip(ra["client_accuracy"].values(), rb["client_accuracy"].values()))
            decisions = all(np.array_equal(runs["inprocess"].communication, runs[other].communication) if case == "dac"
                            else list(runs["inprocess"].assignment) == list(runs[other].assignment)
                            for other in engines[1:])
            failures = sum(r["fit_failures"] for rs in rows.values() for r in rs)
            report[f"{case}, deterministic={deterministic}"] = {
                "engines": list(engines), "same_decisions": bool(decisions), "fit_failures": int(failures),
                "max_accuracy_gap": float(gap), "ok": bool(decisions and failures == 0 and gap <= ACCURACY_TOLERANCE)}
    return report


def carried(dataset_folder: str) -> bool:
    """Whether ``$FEDCLUSTER_DATA_DIR`` holds this dataset's folder (a bundle carries one dataset)."""
    return (Path(os.environ.get("FEDCLUSTER_DATA_DIR", ".")) / dataset_folder).is_dir()


def timing(device: str, tiny: bool, work: Path) -> dict:
    if not carried("FashionMNIST"):
        return {"not run": "no FashionMNIST under FEDCLUSTER_DATA_DIR (the bundle carried another dataset)"}
    report = {}
    for engine in ("batched", "inprocess"):
        config = configured("dac_fmnist_rot4.yaml", "rounds=2", f"client.device={device}", f"simulation.engine={engine}",
                            *(TINY_DAC if tiny else ()))
        started = time.perf_counter()
        run_in_process(config, work / "timing_runs" / engine)
        rows = [json.loads(line) for line in (work / "timing_runs" / engine / "rounds.jsonl").read_text().splitlines()]
        report[engine] = {"first_round_s": rows[0]["seconds"], "exchange_round_s": rows[1]["seconds"],
                          "wall_s": time.perf_counter() - started}
    report["batched_over_inprocess"] = report["batched"]["exchange_round_s"] / report["inprocess"]["exchange_round_s"]
    return report


@dataclass
class Step:
    """One queued table: its command, the folder it writes finished runs' small files to (``results``),
    and where they go in the repository (``dest``), its run folders directly under ``results``.
    ``shared``: folders packed finished or not (the sweep's base and probe); ``files``: top-level
    files packed (the sweep's thresholds)."""

    name: str
    command: list[str]
    results: Path
    dest: str
    shared: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    seed_from: Path | None = None  # a committed folder copied into ``results`` first: its runs are not redone
    runs_dir: Path | None = None  # its run folders (checkpoints): a run stopped by the budget comes back from here
    runs_home: str = ""  # where its table command keeps them here, under ``~/fedcluster-tables`` (its default)
    needs: str = ""  # the dataset folder under $FEDCLUSTER_DATA_DIR it reads (a bundle carries one)


def not_committed(setting: str) -> list[str]:
    """DAC's runs of ``setting`` (the table's own configs) with no finished copy in the repository."""
    spec = importlib.util.spec_from_file_location("dac_table", ROOT / "benchmarks" / "dac" / "table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    names = []
    for run in table.table_runs():
        if run.labels["setting"] != setting:
            continue
        try:
            if kept_copy(run, DAC_RESULTS) is not None:
                continue
        except StaleCopyError as stale:  # a copy made with another config: run it again, the session compares
            print(f"{run.name}: {stale}", flush=True)
        names.append(run.name)
    return names


def queue(tiny: bool, work: Path) -> list[Step]:
    """The table work, in the order issue #53 gives it, less Ali & Arafa's runs, done on the CPU (see the
    module docstring)."""
    python = sys.executable

    def dac_step(name: str, setting: str) -> list[Step]:
        only = not_committed(setting)
        if not only:
            return []
        command = [python, str(ROOT / "benchmarks" / "dac" / "table.py"), "--engine", "batched", "--workers", "1",
                   "--runs-dir", str(work / "dac_runs"), "--results-dir", str(work / name), "--only", ",".join(only),
                   *(TINY_TABLE if tiny else ())]
        return [Step(name, command, work / name, "benchmarks/dac/results/full", runs_dir=work / "dac_runs",
                     runs_home="dac", needs="FashionMNIST")]

    steps = dac_step("dac_table2", "rot_unequal") + dac_step("dac_low", "rot_unequal_low")
    sweep_conf = "default.yaml" if tiny else f"{FLHC_CONF}.yaml"
    committed = ROOT / "benchmarks" / "flhc" / "results" / "full" / Path(sweep_conf).stem
    sweep = [python, str(ROOT / "benchmarks" / "flhc" / "sweep.py"), str(ROOT / "conf" / sweep_conf), "--engine", "batched",
             "--workers", "1", "--runs-dir", str(work / "flhc_runs"), "--results-dir", str(work / "flhc"),
             "--set", "simulation.deterministic=true"]  # a GPU base repeats bit for bit: later leases keep its branches
    if tiny:
        sweep += ["--methods", "l1/complete", "--clusters", "2", "--baselines", ""]
        sweep += [arg for item in TINY_SWEEP for arg in ("--set", item)]
    else:
        sweep += ["--methods", "l1/complete", "l2/complete", "cosine/complete", "--clusters", "25,75,10,50,100"]
    steps.append(Step("flhc_grid", sweep, work / "flhc", f"benchmarks/flhc/results/full/{Path(sweep_conf).stem}",
                      shared=("base", "probe"), files=("thresholds.json",),
                      seed_from=committed if committed.is_dir() and not tiny else None,
                      runs_dir=work / "flhc_runs", runs_home=f"flhc_sweep_{Path(sweep_conf).stem}",
                      needs="" if tiny else "MNIST"))
    return steps + dac_step("dac_rot4", "rot4")  # the CPU tables' work too: last here


def finished(folder: Path) -> bool:
    try:
        return json.loads((folder / "summary.json").read_text()).get("finished") is True
    except (OSError, ValueError):
        return False


def pack(steps: list[Step], out: Path, since: float) -> list[str]:
    """Write ``out/results.tar.gz`` with what the steps made since ``since`` (a copy seeded from the
    repository keeps its old times and is left out); return the run folders packed."""
    members: dict[str, Path] = {}
    for step in steps:
        if not step.results.is_dir():
            continue
        for name in step.files:
            path = step.results / name
            if path.is_file() and path.stat().st_mtime >= since:
                members[f"{step.dest}/{name}"] = path
        for folder in sorted(p for p in step.results.glob("*") if p.is_dir()):
            if not (finished(folder) or folder.name in step.shared):
                continue
            for name in SMALL_FILES:
                path = folder / name
                if path.is_file() and path.stat().st_mtime >= since:
                    members[f"{step.dest}/{folder.name}/{name}"] = path
    partial = out / "results.tar.gz.partial"  # not a name that comes back, nor one tar would read
    with tarfile.open(partial, "w:gz") as archive:
        for arcname, path in sorted(members.items()):
            archive.add(path, arcname=arcname)
    os.replace(partial, out / "results.tar.gz")
    return sorted({arcname.rsplit("/", 1)[0] for arcname in members})


def run_step(step: Step, deadline: float, steps: list[Step], out: Path, since: float) -> int:
    """Run one queued table until it ends or the deadline, packing every few seconds."""
    if step.seed_from is not None and step.seed_from.is_dir():
        shutil.copytree(step.seed_from, step.results, dirs_exist_ok=True)  # copy2: their times stay old
    print(f"{step.name}: {' '.join(step.command[1:])}", flush=True)
    process = subprocess.Popen(step.command, cwd=ROOT)
    while process.poll() is None and time.time() < deadline:
        time.sleep(5)
        pack(steps, out, since)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # a table stops at its last checkpoint
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


# What a lease gives back (the device's limits): at most 8 files, 16 MiB each, 64 MiB together.
BACK_FILES, BACK_BYTES, PART_BYTES = 8, 64 * 2**20, 15 * 2**20
RESUME = "resume.tar.gz"  # comes back as RESUME.00, RESUME.01, ...; see the module docstring
NOT_PACKED = {".claimed"}  # a claim names a process of the lent machine, nothing here


def stopped_runs(steps: list[Step]) -> dict[str, Path]:
    """The run folders the budget stopped (a checkpoint, not finished), each under the path its table
    command keeps it at here (``<runs_home>/<run>``), in the queue's order."""
    stopped: dict[str, Path] = {}
    for step in steps:
        if step.runs_dir is None or not step.runs_dir.is_dir():
            continue
        checkpointed = [f for f in sorted(step.runs_dir.iterdir()) if f.is_dir() and (f / "checkpoint").is_dir()]
        # a sweep's shared rounds (base, probe) stop short of the end by design: they are no stopped run,
        # but go with a stopped branch, as what it resumes beside
        shared = [f for f in checkpointed if f.name in step.shared]
        unfinished = [f for f in checkpointed if f not in shared and not finished(f)]
        if not unfinished:
            continue
        for folder in shared + unfinished:
            stopped.setdefault(f"{step.runs_home}/{folder.name}", folder)
    return stopped


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in NOT_PACKED)


def pack_stopped(steps: list[Step], out: Path, work: Path, reserve_files: int = 1) -> dict:
    """Pack the runs the budget stopped, checkpoints included, into ``out/RESUME.NN`` parts within
    what is left of the files that come back (``reserve_files`` more are still to be written), so a
    lease's unfinished run is resumed elsewhere rather than run again. Runs that do not fit in that
    room (their raw size, an upper bound of the archive's) are named, not packed."""
    taken = [p for p in out.iterdir() if p.is_file()]
    room = min(BACK_BYTES - sum(p.stat().st_size for p in taken) - 2**20,  # 1 MiB for the reports still to come
               (BACK_FILES - len(taken) - reserve_files) * PART_BYTES)
    packed, left = [], []
    archive = work / RESUME
    with tarfile.open(archive, "w:gz") as tar:
        for arcname, folder in stopped_runs(steps).items():
            size = folder_bytes(folder)
            if size > room:
                left.append(arcname)
                continue
            room -= size
            tar.add(folder, arcname=arcname, filter=lambda member: None if Path(member.name).name in NOT_PACKED else member)
            packed.append(arcname)
    parts = []
    if packed:
        with archive.open("rb") as whole:
            while chunk := whole.read(PART_BYTES):
                part = out / f"{RESUME}.{len(parts):02d}"
                part.write_bytes(chunk)
                parts.append(part.name)
    archive.unlink()
    return {"packed": packed, "parts": parts, "no room": left}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small sizes everywhere (the CPU dry run)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all three steps")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device_out")))
    parser.add_argument("--work", type=Path, default=None,
                        help="run folders (checkpoints: never under --out); default a new temporary folder")
    args = parser.parse_args()
    started, since = time.perf_counter(), time.time()
    deadline = since + args.budget - STOP_GRACE_S  # leaves a stopped table time to checkpoint and the archive to close
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="fedcluster-device-"))
    (args.out / "agreement.json").write_text(json.dumps(agreed := agreement(args.device, work), indent=1))
    print(json.dumps(agreed, indent=1), flush=True)
    (args.out / "timing.json").write_text(json.dumps(timed := timing(args.device, args.tiny, work), indent=1))
    print(json.dumps(timed, indent=1), flush=True)
    steps = queue(args.tiny, work)
    report = {}
    for step in steps:
        if time.time() >= deadline:
            report[step.name] = "not started: budget spent"
        elif step.needs and not carried(step.needs):
            report[step.name] = f"not started: no {step.needs} under FEDCLUSTER_DATA_DIR (a bundle carries one dataset)"
        else:
            report[step.name] = f"exited {run_step(step, deadline, steps, args.out, since)}"
    report["packed"] = pack(steps, args.out, since)
    report["stopped runs"] = pack_stopped(steps, args.out, work)
    (args.out / "tables.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), f"\n{time.perf_counter() - started:.0f} s in all", flush=True)
    return 0 if agreement_ok(agreed) else 1


def agreement_ok(report: dict) -> bool:
    """Every engine case agreed; an entry that is a note (a case not run: no Ray there) is not a case."""
    return all(case["ok"] for case in report.values() if isinstance(case, dict))


if __name__ == "__main__":
    raise SystemExit(main())
