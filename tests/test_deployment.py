"""A real deployment on 127.0.0.1: SuperLink with TLS and SuperNode authentication, registered
SuperNodes on partitions and on an exported data folder, an unregistered one, `flwr run`, a
SuperNode killed and restarted. The commands are those of the README's "Deployment on real
devices"; every process is started here and stopped here, by process group, even on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent  # the venv's bin: flower-superlink spawns flower-superexec from PATH
REFUSED = "Failed to activate SuperNode"  # what an unregistered SuperNode logs before it exits (flwr 1.41)
REFUSED_BY_SUPERLINK = "No SuperNode found with the given public key"  # and the SuperLink
CONNECTION = "deploy"  # the SuperLink connection in $FLWR_HOME/config.toml


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd: Sequence[str], cwd: Path, env: dict[str, str], timeout: float = 60) -> str:
    done = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def sessions_processes(sid: int) -> list[int]:
    """Pids of every live process of session ``sid`` (a daemon that left the process group too)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the name: state, ppid, pgrp, session, ...
            pids.append(int(stat.parent.name))
    return pids


class Processes:
    """Processes this test started, each leading its own session; :meth:`stop` ends a session
    (SIGTERM, then SIGKILL after a timeout), :meth:`stop_all` every one left."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs, self.env = logs, env
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: Sequence[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        process = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                   cwd=self.logs, start_new_session=True)
        log.close()
        self.started[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str, timeout: float = 10.0) -> None:
        process = self.started.pop(name)
        sid = process.pid  # start_new_session: the leader's pid is the session and group id
        for sig in (signal.SIGTERM, signal.SIGKILL):
            members = sessions_processes(sid)
            for pid in members:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and sessions_processes(sid):
                if process.poll() is None:
                    time.sleep(0.2)
                else:
                    time.sleep(0.1)
            process.poll()
            if not sessions_processes(sid):
                break
        process.wait(timeout=timeout)

    def stop_all(self) -> None:
        for name in list(self.started)[::-1]:
            self.stop(name)


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def rounds_of(results: Path) -> list[dict]:
    files = list(results.glob("*/rounds.jsonl"))
    if not files:
        return []
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def make_certificates(certs: Path, env: dict[str, str]) -> None:
    """README: a self-signed CA and a server certificate for 127.0.0.1/localhost."""
    certs.mkdir()
    (certs / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for cmd in (
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=fedcluster-ca -keyout ca.key -out ca.crt",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr",
        "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 "
        "-extfile server.ext -out server.pem",
    ):
        run(cmd.split(), certs, env)


RUN_OVERRIDES = "strategy.rounds_before_clustering=1 strategy.client_fraction=1.0 simulation.round_timeout_s=60"
NUM_CLIENTS = 3


class Deployment:
    """The README's deployment on 127.0.0.1: certificates, device keys, the exported partitions,
    a SuperLink with TLS and SuperNode authentication, registered devices; every process it
    starts is stopped on exit (by session, SIGTERM then SIGKILL), whatever happened."""

    def __init__(self, tmp_path: Path, nodes: Sequence[str]) -> None:
        for tool in ("openssl", "ssh-keygen"):
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed (the README's certificate and key commands use it)")
        for tool in ("flower-superlink", "flower-supernode", "flwr"):
            assert (BIN / tool).exists(), f"{tool} is not in {BIN}"
        self.flwr_home = tmp_path / "flwr_home"
        self.certs, self.keys, self.logs = tmp_path / "certs", tmp_path / "keys", tmp_path / "logs"
        self.exported, self.results = tmp_path / "exported", tmp_path / "results"
        for folder in (self.flwr_home, self.keys, self.logs):
            folder.mkdir()
        self.env = dict(os.environ) | {
            "FLWR_HOME": str(self.flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
        }
        make_certificates(self.certs, self.env)
        for node in nodes:  # README: one key pair per device
            run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(self.keys / node)], self.keys, self.env)
        run([sys.executable, "-m", "fedcluster_flwr.cli", "export-partitions", str(ROOT / "conf" / "default.yaml"),
             str(self.exported), "--set", f"partition.num_clients={NUM_CLIENTS}"], ROOT, self.env, timeout=120)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        (self.flwr_home / "config.toml").write_text(  # README: the connection flwr run uses
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.certs / "ca.crt"}"\n'
        )
        self.processes = Processes(self.logs, self.env)
        self.node_configs: dict[str, str] = {}

    def __enter__(self) -> Deployment:
        try:
            certs = self.certs
            self.processes.start("superlink", [
                "flower-superlink", "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile",
                str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth",
                "--port", str(self.port),
            ])
            wait_for(lambda: _accepts(self.port), 60, "the SuperLink's port")
        except BaseException:
            self.processes.stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.processes.stop_all()

    def register(self, node: str) -> None:  # README: flwr supernode register
        wait_for(lambda: _register(self.keys / f"{node}.pub", self.env, self.logs), 60, f"registering {node}", 1)

    def partition_node(self, pid: int) -> str:
        return f"partition-id={pid} num-partitions={NUM_CLIENTS}"

    def data_dir_node(self, pid: int) -> str:
        return f"data-dir='{self.exported / f'client_{pid}'}' client-id={pid} cluster-id={pid}"

    def start_supernode(self, node: str, node_config: str | None = None) -> None:
        self.node_configs[node] = node_config or self.node_configs[node]
        self.processes.start(node, [
            "flower-supernode", "--root-certificates", str(self.certs / "ca.crt"), "--superlink", self.address,
            "--auth-supernode-private-key", str(self.keys / node), "--port", str(free_port()),
            "--node-config", self.node_configs[node],
        ])

    def flwr_run(self, rounds: int, out: Path) -> subprocess.Popen:  # README: flwr run against the deployment
        return self.processes.start(f"flwr_run_{out.name}", [
            "flwr", "run", str(ROOT), CONNECTION, "--stream", "--run-config",
            f"partition.num_clients={NUM_CLIENTS} rounds={rounds} output_dir='{out}' set='{RUN_OVERRIDES}'",
        ])

    def finish(self, run: subprocess.Popen, out: Path, timeout: float = 300) -> tuple[dict, list[dict]]:
        assert run.wait(timeout=timeout) == 0, self.processes.log(f"flwr_run_{out.name}")
        summary = json.loads(wait_for(lambda: _finished_summary(out), 30, "summary.json with finished: true"))
        return summary, rounds_of(out)


def test_tls_authenticated_deployment_trains_registered_nodes_refuses_others_and_takes_a_node_back(tmp_path):
    started = time.monotonic()
    with Deployment(tmp_path, ["node0", "node1", "node2", "rogue"]) as deployment:
        for node in ("node0", "node1", "node2"):
            deployment.register(node)
        deployment.start_supernode("node0", deployment.partition_node(0))
        deployment.start_supernode("node1", deployment.partition_node(1))
        deployment.start_supernode("node2", deployment.data_dir_node(2))
        deployment.start_supernode("rogue", deployment.partition_node(0))  # never registered

        # One FL+HC run (clustering in round 2) of 4 rounds: the three registered nodes train in
        # round 1; node1 is killed as round 2 starts, restarted, and trains again in round 3 or 4.
        out = deployment.results / "run"
        flwr = deployment.flwr_run(4, out)
        wait_for(lambda: len(rounds_of(out)) >= 1, 240, "round 1")
        deployment.processes.stop("node1")
        deployment.start_supernode("node1")
        summary, rows = deployment.finish(flwr, out)
        assert [row["round"] for row in rows] == [1, 2, 3, 4]
        assert rows[0]["fit_clients"] == [0, 1, 2] and rows[0]["fit_failures"] == 0
        assert set(rows[0]["client_accuracy"]) == {"0", "1", "2"}  # all three evaluated their model
        assert summary["true_clusters"] == [0, 1, 2]  # the data-dir node reported its cluster-id
        assert any(1 in row["fit_clients"] and row["fit_failures"] == 0 for row in rows[2:]), rows
        assert set(rows[-1]["client_accuracy"]) == {"0", "1", "2"}
        restarted = deployment.processes.log("node1").split("Starting Flower SuperNode")[-1]
        assert "Receiving: train message" in restarted  # the new process did the training

        rogue, superlink = deployment.processes.log("rogue"), deployment.processes.log("superlink")
        assert REFUSED in rogue and "Receiving:" not in rogue, rogue[-3000:]
        assert REFUSED_BY_SUPERLINK in superlink
        print(f"deployment test: {time.monotonic() - started:.0f} s; rounds: "
              f"{[(row['round'], row['phase'], row['fit_clients'], row['fit_failures']) for row in rows]}; refused: "
              f"{next(line for line in rogue.splitlines() if REFUSED in line).strip()}")


SIMULATE = """
import sys
from pathlib import Path
from fedcluster_flwr.config import load_config, parse_override
from fedcluster_flwr.inprocess import run_in_process
overrides = [parse_override(item) for item in sys.argv[2].split()]
config, _ = load_config(sys.argv[1], overrides)
run_in_process(config, Path(sys.argv[3]))
"""


def test_devices_on_exported_partitions_replay_the_simulation(tmp_path):
    """Three data-dir SuperNodes on `export-partitions` output against the simulation of the same
    config and seed (the in-process driver, which gives the Ray engine's rounds bit for bit):
    replies are processed in client-id order whatever order they arrive in, so every round's
    per-client accuracies, the losses and the clustering are equal bit for bit."""
    rounds = 3
    started = time.monotonic()
    with Deployment(tmp_path, ["device0", "device1", "device2"]) as deployment:
        for pid in range(NUM_CLIENTS):
            deployment.register(f"device{pid}")
            deployment.start_supernode(f"device{pid}", deployment.data_dir_node(pid))
        out = deployment.results / "replay"
        summary, rows = deployment.finish(deployment.flwr_run(rounds, out), out)
    simulated = tmp_path / "simulated"
    overrides = f"partition.num_clients={NUM_CLIENTS} rounds={rounds} {RUN_OVERRIDES}"
    run([sys.executable, "-c", SIMULATE, str(ROOT / "conf" / "default.yaml"), overrides, str(simulated)],
        ROOT, deployment.env, timeout=300)
    expected_summary = json.loads((simulated / "summary.json").read_text())
    expected_rows = rounds_of_dir(simulated)
    assert summary["assignment"] == expected_summary["assignment"]
    assert summary["true_clusters"] == expected_summary["true_clusters"]
    for got, expected in zip(rows, expected_rows, strict=True):
        for key in ("phase", "fit_clients", "client_accuracy", "mean_test_loss", "mean_train_loss", "num_clusters",
                    "bytes_up", "bytes_down"):
            assert got[key] == expected[key], (got["round"], key, got[key], expected[key])
    print(f"replay test: {time.monotonic() - started:.0f} s; accuracy per round "
          f"{[row['mean_client_accuracy'] for row in rows]}, assignment {summary['assignment']}")


def rounds_of_dir(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _register(public_key: Path, env: dict[str, str], logs: Path) -> bool:
    done = subprocess.run(["flwr", "supernode", "register", str(public_key), CONNECTION], env=env, cwd=logs,
                          capture_output=True, text=True, timeout=60)
    with open(logs / "register.log", "a") as log:
        log.write(done.stdout + done.stderr)
    return done.returncode == 0


def _finished_summary(results: Path) -> str | None:
    for file in results.glob("*/summary.json"):
        text = file.read_text()
        if json.loads(text).get("finished"):
            return text
    return None
