"""One command for a GPU machine's few minutes (issue #39): is the batched engine right on this card,
how fast is a full-scale DAC round, then as much of the DAC table as the time allows.

    python benchmarks/device/run.py --out "$OUT" --budget 540          # on the GPU machine (see its README)
    python benchmarks/device/run.py --device cpu --tiny --out /tmp/dry  # the CPU dry run (slow test tier)

1. **Agreement** (``agreement.json``): a small digits case of DAC and of FL+HC on ``inprocess`` and on
   ``batched`` on the device, with ``simulation.deterministic`` off and on: the same decisions (DAC's
   neighbour draws, FL+HC's clusters), no failed fit, accuracies within the engines' tolerance.
2. **Timing** (``timing.json``): a full-scale DAC round (``conf/dac_fmnist_rot4.yaml``, 2 rounds:
   start-up + pretraining, then one exchange) on ``inprocess`` and ``batched``, side by side on the
   same card; the ratio is the claim.
3. **The table** (``dac_full/``): ``benchmarks/dac/table.py`` on ``batched`` until the budget ends
   (stopped with SIGTERM at its last checkpoint); every finished run's small files land in
   ``$OUT/dac_full/`` as it ends, with the page.

Each step writes its file as soon as it is done, so a machine taken back early still returns what
finished. ``--tiny`` shrinks every step (the CPU dry run that keeps this script from rotting).
Needs Fashion-MNIST under ``$FEDCLUSTER_DATA_DIR`` for steps 2-3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FEDCLUSTER_SYNC_DEBUG", "warn")  # a host sync inside the stacked step loop is logged on a GPU

from fedcluster_flwr.config import load_config, parse_override  # noqa: E402
from fedcluster_flwr.apps.server_app import run_in_process  # noqa: E402

ACCURACY_TOLERANCE = 1e-3  # on a GPU the two engines' kernels differ more than on a CPU
TINY_DAC = ("partition.num_clients=20", "partition.cluster_sizes=[5,5,5,5]", "partition.samples_per_client=60",
            "model.name=mlp_fmnist")


def configured(conf: str, *overrides: str):
    config, _ = load_config(ROOT / "conf" / conf, [parse_override(o) for o in overrides])
    return config


def agreement(device: str, out: Path) -> dict:
    cases = {"dac": ("strategy.name=dac", "rounds=4"),
             "flhc": ("strategy.name=flhc", "rounds=5", "strategy.rounds_before_clustering=2")}
    report = {}
    for deterministic in (False, True):
        for case, overrides in cases.items():
            common = (*overrides, f"client.device={device}", f"simulation.deterministic={str(deterministic).lower()}")
            runs = {engine: run_in_process(configured("default.yaml", *common, f"simulation.engine={engine}"),
                                           out / "agreement_runs" / f"{case}_{deterministic}_{engine}")
                    for engine in ("inprocess", "batched")}
            rows = {e: s.observer.recorder.rows for e, s in runs.items()}
            gap = max(abs(a - b) for ra, rb in zip(rows["inprocess"], rows["batched"])
                      for a, b in zip(ra["client_accuracy"].values(), rb["client_accuracy"].values()))
            decisions = (np.array_equal(runs["inprocess"].communication, runs["batched"].communication) if case == "dac"
                         else list(runs["inprocess"].assignment) == list(runs["batched"].assignment))
            failures = sum(r["fit_failures"] for rs in rows.values() for r in rs)
            report[f"{case}, deterministic={deterministic}"] = {
                "same_decisions": bool(decisions), "fit_failures": int(failures), "max_accuracy_gap": float(gap),
                "ok": bool(decisions and failures == 0 and gap <= ACCURACY_TOLERANCE)}
    return report


def timing(device: str, tiny: bool, out: Path) -> dict:
    report = {}
    for engine in ("batched", "inprocess"):
        config = configured("dac_fmnist_rot4.yaml", "rounds=2", f"client.device={device}", f"simulation.engine={engine}",
                            *(TINY_DAC if tiny else ()))
        started = time.perf_counter()
        run_in_process(config, out / "timing_runs" / engine)
        rows = [json.loads(line) for line in (out / "timing_runs" / engine / "rounds.jsonl").read_text().splitlines()]
        report[engine] = {"first_round_s": rows[0]["seconds"], "exchange_round_s": rows[1]["seconds"],
                          "wall_s": time.perf_counter() - started}
    report["batched_over_inprocess"] = report["batched"]["exchange_round_s"] / report["inprocess"]["exchange_round_s"]
    return report


def table(device: str, tiny: bool, out: Path, seconds: float) -> int:
    command = [sys.executable, str(ROOT / "benchmarks" / "dac" / "table.py"), "--engine", "batched", "--workers", "1",
               "--runs-dir", str(out / "dac_runs"), "--results-dir", str(out / "dac_full"), "--set", f"client.device={device}"]
    if tiny:
        command += ["--rounds", "2", "--only", "rot_unequal_dac_seed0", "--set", "model.name=mlp_fmnist",
                    "--set", "partition.samples_per_client=14"]
    process = subprocess.Popen(command, cwd=ROOT)
    try:
        return process.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the table stops at its last checkpoint
        return process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small sizes everywhere (the CPU dry run)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all three steps")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device_out")))
    args = parser.parse_args()
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agreement.json").write_text(json.dumps(agreed := agreement(args.device, args.out), indent=1))
    print(json.dumps(agreed, indent=1), flush=True)
    (args.out / "timing.json").write_text(json.dumps(timed := timing(args.device, args.tiny, args.out), indent=1))
    print(json.dumps(timed, indent=1), flush=True)
    code = table(args.device, args.tiny, args.out, args.budget - (time.perf_counter() - started))
    print(f"table command exited {code}; {time.perf_counter() - started:.0f} s in all", flush=True)
    return 0 if all(case["ok"] for case in agreed.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
