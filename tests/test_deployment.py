"""A real deployment: SuperLink with TLS and SuperNode authentication, registered SuperNodes on
partitions and on an exported data folder, an unregistered one, `flwr run`, a SuperNode killed and
restarted; on 127.0.0.1, and across a private network of two namespaces (the SuperLink's "machine"
and the devices'), as on two machines. The commands are those of the docs' "Deployment on real
devices" (docs/how-to/deploy.md), the certificates come from `deploy/make_certificates.sh`; every process is started here
and stopped here, by session, and every namespace removed, even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
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
        """Stop every process, each even when stopping an earlier one raised; then raise the first error."""
        errors = []
        for name in list(self.started)[::-1]:
            try:
                self.stop(name)
            except Exception as err:  # noqa: BLE001 - the others must still be stopped
                errors.append(err)
        if errors:
            raise errors[0]


@contextlib.contextmanager
def simulation_superlink(tmp_path: Path) -> Iterator[tuple[Callable[..., subprocess.CompletedProcess], Path]]:
    """A SuperLink of the test's own with the simulation runtime (its own FLWR_HOME and port, the
    connection named ``e2e``): yields ``flwr(*args)``, which runs the flwr CLI against it, and the
    folder of the processes' logs; stops the SuperLink and what it started on exit."""
    home, logs = tmp_path / "flwr_home", tmp_path / "logs"
    home.mkdir(), logs.mkdir()
    env = dict(os.environ) | {"FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                              "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "e2e"\n\n[superlink.e2e]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    processes = Processes(logs, env)

    def flwr(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["flwr", *args], env=env, cwd=logs, capture_output=True, text=True, timeout=540)

    try:
        processes.start("superlink", ["flower-superlink", "--insecure", "--simulation", "--host", "127.0.0.1",
                                      "--port", str(port)])
        wait_for(lambda: flwr("ls", "e2e").returncode == 0, 60, "the SuperLink's port")
        yield flwr, logs
    finally:
        processes.stop_all()


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


MAKE_CERTIFICATES = ROOT / "deploy" / "make_certificates.sh"
REGISTER_SUPERNODES = ROOT / "deploy" / "register_supernodes.sh"


def make_certificates(certs: Path, env: dict[str, str], superlink_host: str) -> None:
    """docs: a private CA and a server certificate naming the address the devices dial."""
    run(["bash", str(MAKE_CERTIFICATES), str(certs), superlink_host], ROOT, env | {"FEDCLUSTER_CERT_DAYS": "1"})


CONNECT = "import socket, sys; sys.exit(socket.socket().connect_ex((sys.argv[1], int(sys.argv[2]))))"


class Loopback:
    """Every process on this machine, the SuperLink on 127.0.0.1 (flwr's default `--host`)."""

    listen_host = "127.0.0.1"  # the SuperLink's --host
    superlink_host = "127.0.0.1"  # what the devices and `flwr` dial, and the certificate names

    def on_server(self, cmd: Sequence[str]) -> list[str]:
        return list(cmd)

    def on_devices(self, cmd: Sequence[str]) -> list[str]:
        return list(cmd)

    def connects_from_devices(self, host: str, port: int) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((host, port)) == 0


class PrivateNetwork:
    """Two network namespaces made for one test, standing for two machines: the SuperLink's and the
    devices' (the SuperNodes and `flwr`), joined by a veth pair with addresses from 198.18.0.0/15
    (RFC 2544's range for network tests). Each namespace has its own loopback, so a SuperLink bound
    to 127.0.0.1 serves its namespace only, as on a real machine, and the devices have no route but
    the veth: no test traffic reaches this machine's own addresses or leaves it. Skips the test
    (with the reason) where namespaces cannot be made (not root, no `ip`, not permitted); on exit the
    namespaces are deleted, which deletes the veth pair too."""

    listen_host = "0.0.0.0"  # docs: every address of the SuperLink's machine, here its loopback and the veth
    superlink_host = "198.18.0.1"
    device_host = "198.18.0.2"

    def __init__(self) -> None:
        tag = f"fcd{os.getpid()}"  # one pair per test process: tests of other worktrees run beside it
        self.server, self.devices = f"{tag}s", f"{tag}d"
        self.created: list[str] = []

    def __enter__(self) -> PrivateNetwork:
        if os.geteuid() != 0:
            pytest.skip("needs root to create network namespaces (ip netns add)")
        self.ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
        if self.ip is None:
            pytest.skip("iproute2's `ip` is not installed (needed for ip netns add)")
        try:
            for namespace in (self.server, self.devices):
                self._ip_or_skip("netns", "add", namespace)
                self.created.append(namespace)
            self._ip_or_skip("link", "add", "veth0", "netns", self.server, "type", "veth",
                             "peer", "name", "veth0", "netns", self.devices)
            for namespace, host in ((self.server, self.superlink_host), (self.devices, self.device_host)):
                for args in (("addr", "add", f"{host}/30", "dev", "veth0"), ("link", "set", "veth0", "up"),
                             ("link", "set", "lo", "up")):  # the SuperLink and SuperNodes use 127.0.0.1 inside too
                    self._ip("-n", namespace, *args)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        while self.created:
            subprocess.run([self.ip, "netns", "del", self.created.pop()], capture_output=True, timeout=30)

    def namespaces(self) -> list[str]:
        listed = subprocess.run([self.ip, "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        return [line.split()[0] for line in listed.splitlines() if line.strip()]

    def _ip(self, *args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([self.ip, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"
        return done

    def _ip_or_skip(self, *args: str) -> None:
        done = subprocess.run([self.ip, *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:  # e.g. "Operation not permitted" in an unprivileged container
            pytest.skip(f"cannot make a private test network: ip {' '.join(args)}: {done.stderr.strip()}")

    def on_server(self, cmd: Sequence[str]) -> list[str]:
        return [self.ip, "netns", "exec", self.server, *cmd]

    def on_devices(self, cmd: Sequence[str]) -> list[str]:
        return [self.ip, "netns", "exec", self.devices, *cmd]

    def connects_from_server(self, host: str, port: int) -> bool:
        return self._connects(self.on_server, host, port)

    def connects_from_devices(self, host: str, port: int) -> bool:
        return self._connects(self.on_devices, host, port)

    @staticmethod
    def _connects(on, host: str, port: int) -> bool:
        return subprocess.run(on([sys.executable, "-c", CONNECT, host, str(port)]), capture_output=True,
                              timeout=30).returncode == 0


RUN_OVERRIDES = "strategy.rounds_before_clustering=1 strategy.client_fraction=1.0 simulation.round_timeout_s=60"
NUM_CLIENTS = 3


class Deployment:
    """The docs' deployment (docs/how-to/deploy.md), on 127.0.0.1 or on a :class:`PrivateNetwork`: certificates, device
    keys, the exported partitions, a SuperLink with TLS and SuperNode authentication, registered
    devices; every process it starts is stopped on exit (by session, SIGTERM then SIGKILL),
    whatever happened."""

    def __init__(self, tmp_path: Path, nodes: Sequence[str], network: Loopback | PrivateNetwork | None = None,
                 num_clients: int = NUM_CLIENTS) -> None:
        for tool in ("openssl", "ssh-keygen"):
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed (the docs' certificate and key commands use it)")
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
        self.network = network or Loopback()
        self.num_clients = num_clients
        make_certificates(self.certs, self.env, self.network.superlink_host)
        for node in nodes:  # docs: one key pair per device
            run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(self.keys / node)], self.keys, self.env)
        self.port = free_port()
        self.address = f"{self.network.superlink_host}:{self.port}"
        (self.flwr_home / "config.toml").write_text(  # docs: the connection flwr run uses
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.certs / "ca.crt"}"\n'
        )
        self.processes = Processes(self.logs, self.env)
        self.node_configs: dict[str, str] = {}

    def __enter__(self) -> Deployment:
        try:
            self.start_superlink("superlink", self.network.listen_host, self.port)
            wait_for(lambda: self.network.connects_from_devices(self.network.superlink_host, self.port), 60,
                     f"the SuperLink's port at {self.address}")
        except BaseException:
            self.processes.stop_all()
            raise
        return self

    def start_superlink(self, name: str, host: str, port: int) -> None:  # docs: the SuperLink's command
        certs = self.certs
        self.processes.start(name, self.network.on_server([
            "flower-superlink", "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile",
            str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth",
            "--host", host, "--port", str(port),
        ]))

    def __exit__(self, *exc: object) -> None:
        self.processes.stop_all()

    def register(self, node: str) -> None:  # docs: flwr supernode register
        wait_for(lambda: self._register(self.keys / f"{node}.pub"), 60, f"registering {node}", 1)

    def _register(self, public_key: Path) -> bool:
        done = subprocess.run(self.network.on_devices(["flwr", "supernode", "register", str(public_key), CONNECTION]),
                              env=self.env, cwd=self.logs, capture_output=True, text=True, timeout=60)
        with open(self.logs / "register.log", "a") as log:
            log.write(done.stdout + done.stderr)
        return done.returncode == 0

    def register_with_script(self, nodes: Sequence[str]) -> str:  # docs and compose: deploy/register_supernodes.sh
        return run(self.network.on_devices(["bash", str(REGISTER_SUPERNODES), CONNECTION,
                                            *(str(self.keys / f"{node}.pub") for node in nodes)]),
                   self.logs, self.env, timeout=120)

    def partition_node(self, pid: int) -> str:
        return f"partition-id={pid} num-partitions={self.num_clients}"

    def data_dir_node(self, pid: int) -> str:
        if not self.exported.exists():  # docs: fedcluster export-partitions, only for tests with data-dir devices
            run([sys.executable, "-m", "fedcluster_flwr.cli", "export-partitions", str(ROOT / "conf" / "default.yaml"),
                 str(self.exported), "--set", f"partition.num_clients={self.num_clients}"], ROOT, self.env, timeout=120)
        return f"data-dir='{self.exported / f'client_{pid}'}' client-id={pid} cluster-id={pid}"

    def start_supernode(self, node: str, node_config: str | None = None) -> None:
        self.node_configs[node] = node_config or self.node_configs[node]
        self.processes.start(node, self.network.on_devices([
            "flower-supernode", "--root-certificates", str(self.certs / "ca.crt"), "--superlink", self.address,
            "--auth-supernode-private-key", str(self.keys / node), "--port", str(free_port()),
            "--node-config", self.node_configs[node],
        ]))

    def flwr_run(self, rounds: int, out: Path) -> subprocess.Popen:  # docs: flwr run against the deployment
        return self.processes.start(f"flwr_run_{out.name}", self.network.on_devices([
            "flwr", "run", str(ROOT), CONNECTION, "--stream", "--run-config",
            f"partition.num_clients={self.num_clients} rounds={rounds} output_dir='{out}' set='{RUN_OVERRIDES}'",
        ]))

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


def test_supernodes_on_another_machine_reach_a_superlink_listening_on_all_addresses(tmp_path):
    """Two machines, as two network namespaces: the docs' SuperLink (`--host 0.0.0.0`, TLS with
    the certificate of `deploy/make_certificates.sh` for its network address, SuperNode
    authentication) in one; in the other two registered SuperNodes and an unregistered one dialling
    it at that address, and `flwr`. Also checks why `--host` is needed: a SuperLink on flwr's default
    127.0.0.1 cannot be reached from the devices' machine."""
    started = time.monotonic()
    with PrivateNetwork() as network:
        with Deployment(tmp_path, ["node0", "node1", "rogue"], network, num_clients=2) as deployment:
            # The devices' own loopback has no SuperLink: whatever reaches it crosses the veth pair.
            assert not network.connects_from_devices("127.0.0.1", deployment.port)
            registered = deployment.register_with_script(["node0", "node1"])
            assert registered.count("registered successfully") == 2, registered
            # compose's register service runs on every `docker compose up`: a key registered before is no error.
            assert "already registered" in deployment.register_with_script(["node0"])
            for pid in range(2):
                deployment.start_supernode(f"node{pid}", deployment.partition_node(pid))
            deployment.start_supernode("rogue", deployment.partition_node(0))  # never registered

            out = deployment.results / "run"
            summary, rows = deployment.finish(deployment.flwr_run(2, out), out)
            assert [row["round"] for row in rows] == [1, 2]
            assert all(row["fit_clients"] == [0, 1] and row["fit_failures"] == 0 for row in rows), rows
            assert set(rows[-1]["client_accuracy"]) == {"0", "1"}
            assert summary["finished"] and len(summary["assignment"]) == 2
            rogue, superlink = deployment.processes.log("rogue"), deployment.processes.log("superlink")
            assert REFUSED in rogue and "Receiving:" not in rogue, rogue[-3000:]
            assert REFUSED_BY_SUPERLINK in superlink
            # The SuperLink's access log names each caller: the SuperNodes came from the devices' address.
            activated = re.findall(rf'{re.escape(network.device_host)}:\d+ - "POST /v1/fleet/activate-node HTTP/1.1" 200',
                                   superlink)
            assert len(activated) == 2, superlink[-3000:]

            # Without `--host` (flwr's default 127.0.0.1) the same SuperLink serves its own machine only.
            deployment.processes.stop("superlink")
            local_port = free_port()
            deployment.start_superlink("superlink_on_127.0.0.1", "127.0.0.1", local_port)
            wait_for(lambda: network.connects_from_server("127.0.0.1", local_port), 60,
                     "the SuperLink on 127.0.0.1 to listen")
            assert not network.connects_from_devices(network.superlink_host, local_port)
    assert not {network.server, network.devices} & set(network.namespaces())  # both namespaces are gone
    print(f"two-machine test: {time.monotonic() - started:.0f} s; rounds: "
          f"{[(row['round'], row['phase'], row['fit_clients'], row['mean_client_accuracy']) for row in rows]}")


SIMULATE = """
import sys
from pathlib import Path
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process
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


def _finished_summary(results: Path) -> str | None:
    for file in results.glob("*/summary.json"):
        text = file.read_text()
        if json.loads(text).get("finished"):
            return text
    return None
