"""What ``fedcluster run`` would pay to reach Flower's Ray simulation the way Flower supports
(``flwr run``) instead of through the deprecated ``run_simulation`` (issue #52).

    python benchmarks/overhead/startup.py                  # 5 pairs, one round of the default job
    python benchmarks/overhead/startup.py --pairs 3 --rounds 2

Each pair times, one after the other, two ways to run the same one-round job (conf/default.yaml with
``strategy.name=fedavg``, 20 clients, Ray engine) from nothing to its results folder:

* ``fedcluster run``: its engine process calls ``run_simulation`` (Ray started and stopped for the run);
* the supported path, as ``fedcluster run`` would have to take it: start a SuperLink with the
  simulation runtime (its own ``FLWR_HOME`` and port, loopback only), ``flwr run`` this project on it
  (Flower builds the app's FAB, installs it, starts the simulation process, which starts Ray),
  stream its log to the end, stop the SuperLink and everything it started.

Both write the same results folder. The difference of the two wall times is the start-up the
supported path would add to every ``fedcluster run`` (and every resume). Prints the pairs and the
medians; ``--out FILE`` keeps them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower's telemetry off here and in every run started: nothing leaves the machine

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # flwr, flower-superlink of this environment
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
         "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}  # nothing leaves the machine; no per-run venv


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fedcluster_run(rounds: int, clients: int, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedcluster_flwr.cli", "run", str(ROOT / "conf" / "default.yaml"),
                    "--set", "strategy.name=fedavg", "--set", f"rounds={rounds}", "--set", f"partition.num_clients={clients}",
                    "--out", str(out),
                    "--no-progress"], cwd=ROOT, env=os.environ | QUIET, check=True, capture_output=True)
    return time.perf_counter() - started


def flwr_run(rounds: int, clients: int, out: Path, home: Path) -> float:
    """A SuperLink of its own, ``flwr run --stream`` on it, the SuperLink stopped: the wall time of all three."""
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = os.environ | QUIET | {"FLWR_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.perf_counter()
    superlink = subprocess.Popen([str(BIN / "flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1",
                                  "--port", str(port)], env=env, cwd=home, start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while subprocess.run([str(BIN / "flwr"), "ls", "bench"], env=env, cwd=home, capture_output=True).returncode:
            time.sleep(0.1)  # until its port answers
        run = subprocess.run([str(BIN / "flwr"), "run", str(ROOT), "bench", "--stream", "--federation-config",
                              f"num-supernodes={clients}", "--run-config",
                              f"strategy.name='fedavg' rounds={rounds} partition.num_clients={clients} output_dir='{out}'"],
                             env=env, cwd=home, capture_output=True, text=True)
        if run.returncode != 0 or not list(out.glob("*/summary.json")):
            raise RuntimeError(f"flwr run failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    finally:
        os.killpg(superlink.pid, signal.SIGKILL)  # the SuperLink and the simulation process it started
        superlink.wait()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the pairs and medians to this JSON file")
    args = parser.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="startup_") as folder:
        for k in range(args.pairs):
            here = Path(folder) / str(k)
            pair = {"fedcluster_run_s": fedcluster_run(args.rounds, args.clients, here / "fedcluster"),
                    "flwr_run_s": flwr_run(args.rounds, args.clients, here / "flwr", here / "flwr_home")}
            pair["load"] = os.getloadavg()[0]
            pairs.append(pair)
            print(json.dumps(pair), flush=True)
    medians = {key: statistics.median(p[key] for p in pairs) for key in ("fedcluster_run_s", "flwr_run_s")}
    medians["difference_s"] = statistics.median(p["flwr_run_s"] - p["fedcluster_run_s"] for p in pairs)
    medians["ratio"] = statistics.median(p["flwr_run_s"] / p["fedcluster_run_s"] for p in pairs)
    print(json.dumps(medians))
    if args.out is not None:
        args.out.write_text(json.dumps({"command": "python benchmarks/overhead/startup.py " + " ".join(sys.argv[1:]),
                                        "pairs": pairs, "medians": medians}, indent=1) + "\n")


if __name__ == "__main__":
    main()
