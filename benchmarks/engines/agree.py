"""Do the engines agree? One small case of every family (the behaviour fixture's settings:
tests/trajectories.py) run to the end with ``fedcluster``'s runner on ray, inprocess and batched.

    python benchmarks/engines/agree.py [--cases flhc,dac]

Ray and inprocess must agree bit for bit (the same float operations in the same order); batched
must make the same decisions (clients, clusters, failures, bytes) with every client's accuracy
within 1e-4, its stacked arithmetic being allowed to round differently. Prints one line per case
and exits 1 if any case disagrees. A test covers batched vs inprocess in the fast tier
(tests/test_engines.py) and the default conf on ray vs inprocess in the slow tier
(tests/test_simulation.py); this checks every family on all three, Ray's start-up included (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower's telemetry off here and in every run started: nothing leaves the machine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from trajectories import CASE_STRATEGY, SETTINGS, STRATEGY_OVERRIDES  # noqa: E402

from fedcluster_flwr.config.load import load_config, parse_override  # noqa: E402
from fedcluster_flwr.runner import run_experiment  # noqa: E402

DECISIONS = ("fit_clients", "num_clusters", "fit_failures", "rejected_updates", "bytes_up")
ENGINES = ("ray", "inprocess", "batched")
CASES = ("fedavg", "flhc", "ifca", "gradloss_one_step", "oneshot_hfl", "pacfl", "dac", "pens", "cfl")
ACCURACY_GAP = 1e-4


def rows_on(case: str, engine: str) -> list[dict]:
    overrides = (*SETTINGS, f"strategy.name={CASE_STRATEGY.get(case, case)}", *STRATEGY_OVERRIDES[case],
                 f"simulation.engine={engine}")
    config, _ = load_config(ROOT / "conf" / "default.yaml", [parse_override(o) for o in overrides])
    run_dir = Path(tempfile.mkdtemp()) / "run"
    run_experiment(config, run_dir)
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(STRATEGY_OVERRIDES)}")
    args = parser.parse_args()
    agree = True
    for case in args.cases.split(","):
        rows = {engine: rows_on(case, engine) for engine in ENGINES}
        strip = [[{k: v for k, v in row.items() if k != "seconds"} for row in rows[e]] for e in ("ray", "inprocess")]
        bit_for_bit = strip[0] == strip[1]
        decisions = all({k: a[k] for k in DECISIONS} == {k: b[k] for k in DECISIONS}
                        for a, b in zip(rows["inprocess"], rows["batched"], strict=True))
        gap = max(abs(a["client_accuracy"][p] - b["client_accuracy"][p])
                  for a, b in zip(rows["inprocess"], rows["batched"]) for p in a["client_accuracy"])
        agree &= bit_for_bit and decisions and gap <= ACCURACY_GAP
        print(f"{case}: ray == inprocess bit for bit: {bit_for_bit}; batched vs inprocess: decisions equal "
              f"{decisions}, largest client-accuracy gap {gap:.2g}", flush=True)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
