"""Nothing leaves the machine unasked: a deployment (SuperLink, SuperNodes, `flwr run`) and `flwr run`
on Flower's simulation runtime, with every connection their processes attempt recorded, open none
to another machine; but for one thing no setting turns off, Ray's probe of the cloud metadata
addresses (:data:`RAY_CLOUD_PROBE`), which the simulation runtime's Ray makes when it starts.

Two recorders, because a process may reach out in two ways. Every Python process started (Flower's
programs, the ServerApp and ClientApp processes, Ray's workers) imports a ``sitecustomize`` that
installs an audit hook (PEP 578) writing each name lookup, TCP connect and UDP send whose
destination is not this machine to a log, and one line when it starts (so the log also proves which
programs it watched). And ``http_proxy``/``https_proxy`` point at a local recording proxy that
answers nothing: an HTTP client honouring them (Flower's update check and Ray's usage statistics use
``requests``) never resolves the remote name itself, and the proxy keeps the request line. The
processes run with the environment the docs give (``FLWR_TELEMETRY_ENABLED=0``,
``FLWR_DISABLE_UPDATE_CHECK=1``, ``RAY_USAGE_STATS_ENABLED=0``); a control without the second shows
that the recorders see Flower's update check when it happens. (The third stops Ray's usage report
to usage-stats.ray.io, which Ray sends a minute after it starts unless told not to.)
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT
from test_deployment import BIN, Deployment, simulation_superlink

pytestmark = pytest.mark.slow

AUDIT = '''"""Installed by tests/test_offline.py: records where this process tries to reach another machine."""
import ipaddress, json, os, socket, sys

_LOG = os.environ.get("FEDCLUSTER_TEST_AUDIT_LOG")
_HERE = set(os.environ.get("FEDCLUSTER_TEST_AUDIT_HERE", "").split(","))


def _record(kind, detail):
    with open(_LOG, "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "program": os.path.basename(sys.argv[0] if sys.argv else ""),
                              "kind": kind, "detail": detail}) + "\\n")


def _elsewhere(host):
    host = (host.decode() if isinstance(host, bytes) else str(host)).strip("[]").split("%")[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name
        return host not in _HERE
    return not (address.is_loopback or address.is_unspecified or str(address) in _HERE)


def _hook(event, args):
    if event == "socket.getaddrinfo" and args[0] and _elsewhere(args[0]):
        _record("lookup", f"{args[0]}:{args[1]}")
    elif event == "socket.connect" and isinstance(args[1], tuple) and _elsewhere(args[1][0]):
        if args[0].type == socket.SOCK_STREAM:  # a UDP connect sends nothing (Ray finds its own address so)
            _record("connect", f"{args[1][0]}:{args[1][1]}")
    elif event == "socket.sendto" and isinstance(args[-1], tuple) and _elsewhere(args[-1][0]):
        _record("send", f"{args[-1][0]}:{args[-1][1]}")


if _LOG:
    _record("start", " ".join(sys.argv[1:3]))
    sys.addaudithook(_hook)
'''


class RecordingProxy(socketserver.ThreadingTCPServer):
    """An HTTP(S) proxy on 127.0.0.1 that forwards nothing: it keeps the first line of every request
    (``CONNECT api.example.org:443 HTTP/1.1``) and closes the connection."""

    daemon_threads = True

    def __init__(self) -> None:
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _FirstLine)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FirstLine(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(5)
        with contextlib.suppress(OSError):
            self.server.requests.append(self.rfile.readline(4096).decode(errors="replace").strip())


def this_machine() -> set[str]:
    """What names this machine: its host names and its interfaces' addresses (Linux's kernel tables:
    the IPv4 routes of type LOCAL, every IPv6 address)."""
    found = {socket.gethostname(), socket.getfqdn(), "localhost"}
    routes = Path("/proc/net/fib_trie").read_text().splitlines()
    found |= {previous.split()[-1] for previous, line in zip(routes, routes[1:]) if "/32 host LOCAL" in line}
    inet6 = Path("/proc/net/if_inet6")
    if inet6.exists():
        found |= {str(ipaddress.IPv6Address(int(line.split()[0], 16))) for line in inet6.read_text().splitlines()}
    return found


@contextlib.contextmanager
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, RecordingProxy]]:
    """This test's environment, which the processes it starts inherit: the audit hook on their path,
    the proxies at the recorder (this machine's own addresses excepted), the docs' three variables set."""
    hook, log = tmp_path / "audit", tmp_path / "audit.jsonl"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(AUDIT)
    proxy = RecordingProxy()
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    here = ",".join(sorted(this_machine()))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FEDCLUSTER_TEST_AUDIT_LOG", str(log))
    monkeypatch.setenv("FEDCLUSTER_TEST_AUDIT_HERE", here)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, here + ",127.0.0.1")
    for name, value in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
        monkeypatch.setenv(name, value)
    try:
        yield log, proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


def entries(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# Ray 2.55 starts its dashboard process even without the dashboard (include_dashboard=False: with
# its usage-statistics module alone), and that module asks the cloud metadata addresses which cloud
# it runs on before it reads RAY_USAGE_STATS_ENABLED (ray/dashboard/modules/usage_stats/
# usage_stats_head.py, run): three GETs without a payload, at Ray's start, which no setting turns
# off. Named here, request by request, so that anything else fails the test.
RAY_CLOUD_PROBE = (
    "GET http://169.254.169.254/metadata/instance?api-version=2021-12-13 HTTP/1.1",
    "GET http://metadata.google.internal/computeMetadata/v1 HTTP/1.1",
    "GET http://169.254.169.254/latest/meta-data/ HTTP/1.1",
)


def assert_nothing_left(log: Path, proxy: RecordingProxy, watched: set[str], known: tuple[str, ...] = ()) -> None:
    """No process reached out (but the ``known`` requests), and the hook ran in each ``watched`` program."""
    found = entries(log)
    programs = {entry["program"] for entry in found if entry["kind"] == "start"}
    assert watched <= programs, f"the audit hook did not run in {sorted(watched - programs)}; it ran in {sorted(programs)}"
    reached = [entry for entry in found if entry["kind"] != "start"]
    assert not reached, f"connections to other machines: {reached}"
    unknown = [request for request in proxy.requests if request not in known]
    assert not unknown, f"requests through the proxy: {unknown}"


def control_sees_the_update_check(flwr_args: list[str], env: dict[str, str], cwd: Path, proxy: RecordingProxy) -> None:
    """Without FLWR_DISABLE_UPDATE_CHECK, the same `flwr` command asks Flower's server, through the proxy."""
    unset = {k: v for k, v in env.items() if k != "FLWR_DISABLE_UPDATE_CHECK"}
    subprocess.run(["flwr", *flwr_args], env=unset, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert any("flower.ai" in line for line in proxy.requests), proxy.requests


def test_a_deployment_and_flwr_run_against_it_reach_no_other_machine(tmp_path, monkeypatch):
    with recorded(tmp_path, monkeypatch) as (log, proxy):
        with Deployment(tmp_path, ["node0", "node1"], num_clients=2) as deployment:
            for pid in range(2):
                deployment.register(f"node{pid}")
                deployment.start_supernode(f"node{pid}", deployment.partition_node(pid))
            out = deployment.results / "run"
            summary, rows = deployment.finish(deployment.flwr_run(2, out), out)
            assert summary["finished"] and [row["round"] for row in rows] == [1, 2]
            assert_nothing_left(log, proxy, {"flower-superlink", "flower-supernode", "flower-superexec", "flwr",
                                             "flwr-serverapp", "flwr-clientapp"})
            control_sees_the_update_check(["supernode", "list", "deploy"], deployment.env, deployment.logs, proxy)
    print(f"offline deployment: seconds per round {[row['seconds'] for row in rows]}")


def test_flwr_run_on_the_simulation_runtime_reaches_no_other_machine_but_for_rays_cloud_probe(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with recorded(tmp_path, monkeypatch) as (log, proxy):
        with simulation_superlink(tmp_path) as (flwr, logs):
            run = flwr("run", str(ROOT), "e2e", "--stream", "--federation-config", "num-supernodes=2", "--run-config",
                       f"rounds=1 partition.num_clients=2 strategy.name='fedavg' output_dir='{out}'")
            (logs / "run.out").write_text(run.stdout + run.stderr)
            assert "fedcluster: round 1: mean client accuracy" in run.stdout, run.stdout + run.stderr
            assert_nothing_left(log, proxy, {"flower-superlink", "flower-superexec", "flwr", "flwr-simulation",
                                             "dashboard.py", "default_worker.py"}, known=RAY_CLOUD_PROBE)
            proxy.requests.clear()  # the control's request is the one to see
            home = {"FLWR_HOME": str(tmp_path / "flwr_home"), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
            control_sees_the_update_check(["ls", "e2e"], dict(os.environ) | home, logs, proxy)
