"""Scale-out: a run with ``simulation.ray_address`` joins an existing Ray cluster, here a head and a
second node started on this machine with ``ray start``; its clients run on both nodes, and its end
leaves the cluster running without the run's actors."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.run_process import backend_config
from fedcluster_flwr.runner import run_experiment

RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` CLI of this interpreter's environment
STARTED = "Ray runtime started."  # what `ray start` prints once its node is registered with the cluster


def tiny_config(*overrides: str):
    """FedAvg on digits, 4 clients, 3 rounds of one epoch: every round all 4 clients evaluate, more
    than one node's single actor can take at once."""
    base = ("rounds=3", "strategy.name=fedavg", "partition.num_clients=4", "partition.num_groups=2", "client.epochs=1")
    config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (*base, *overrides)])
    return config


def test_without_an_address_ray_starts_for_the_run_and_with_one_joins_the_cluster():
    local = backend_config(tiny_config(), verbose=False)
    assert local["init_args"]["address"] == "local"  # neither RAY_ADDRESS nor a `ray start` here redirects it
    joined = backend_config(tiny_config("simulation.ray_address=10.0.0.1:6379"), verbose=False)
    assert joined["init_args"]["address"] == "10.0.0.1:6379"
    # Ray refuses these when joining a cluster; Flower passes its own runtime_env.
    assert not {"num_cpus", "num_gpus", "resources", "object_store_memory", "runtime_env"} & set(joined["init_args"])
    assert joined["client_resources"] == local["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.0}


# ---- a two-node cluster on this machine ------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free right now (held open together so that none is given twice)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@dataclass
class RayNode:
    """One ``ray start --block`` and everything it started: a process group of its own, so that it
    ends with one ``killpg`` (``ray stop`` would stop every Ray on the machine)."""

    process: subprocess.Popen
    temp_dir: Path

    @classmethod
    def start(cls, *args: str) -> RayNode:
        # Short and per node: Ray's socket paths live under it (a Unix socket path has at most 107
        # bytes), and `ray start --head` writes its address there instead of /tmp/ray, where a plain
        # ray.init() of another run on this machine would find it.
        temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        log = open(temp_dir / "start.log", "wb")
        process = subprocess.Popen(
            [*RAY, "start", "--block", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats",
             "--object-store-memory=100000000", f"--temp-dir={temp_dir}", *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        return cls(process, temp_dir)

    def log(self) -> str:
        return (self.temp_dir / "start.log").read_text(errors="replace")

    def wait_started(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while STARTED not in self.log():
            assert self.process.poll() is None and time.monotonic() < deadline, f"ray start failed:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A head and a worker node of one CPU each on this machine; yields the head's address."""
    gcs_port, *node_ports = free_ports(5)
    address = f"127.0.0.1:{gcs_port}"
    nodes: list[RayNode] = []
    try:
        nodes.append(RayNode.start("--head", f"--port={gcs_port}", "--include-dashboard=false",
                                   f"--ray-client-server-port={node_ports[0]}", f"--dashboard-agent-listen-port={node_ports[1]}"))
        nodes[0].wait_started()
        nodes.append(RayNode.start(f"--address={address}", f"--dashboard-agent-listen-port={node_ports[2]}"))
        nodes[1].wait_started()
        yield address
    finally:
        for node in nodes:
            node.stop()


def gcs_state(address: str):
    """The cluster's GCS tables, read directly: Ray's state API (``ray.util.state``) is served by the
    dashboard, which needs ``ray[default]`` (flwr[simulation] installs plain ``ray``)."""
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    state = GlobalState()
    state._initialize_global_state(
        GcsClientOptions.create(address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
    )
    return state


def client_calls_per_node(state) -> Counter:
    """How many client messages (``ClientAppActor.run`` tasks, one per fit/evaluate/properties call)
    each node ran, from the task events the workers report to the GCS."""
    from ray.core.generated.gcs_pb2 import TaskEvents

    calls: Counter = Counter()
    for raw in state._connect_and_get_accessor().get_task_events():
        event = TaskEvents.FromString(raw)
        if event.task_info.name == "ClientAppActor.run" and event.state_updates.node_id:
            calls[event.state_updates.node_id.hex()] += 1
    return calls


@pytest.mark.slow
def test_a_run_with_ray_address_trains_clients_on_both_nodes_and_leaves_the_cluster_running(cluster, tmp_path):
    summary = run_experiment(tiny_config(f"simulation.ray_address={cluster}"), tmp_path / "run")
    assert summary["finished"] and summary["completed_rounds"] == 3

    state = gcs_state(cluster)
    nodes = {node["NodeID"]: node["Alive"] for node in state.node_table()}
    assert len(nodes) == 2 and all(nodes.values()), nodes  # the run ended; the cluster did not
    calls = client_calls_per_node(state)
    assert set(calls) == set(nodes), f"client calls per node {dict(calls)}, nodes {sorted(nodes)}"
    actors = state.actor_table(None).values()
    assert [a["State"] for a in actors if a["ActorClassName"] == "ClientAppActor"] == ["DEAD", "DEAD"]
