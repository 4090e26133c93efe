"""The client directory: which Flower client is which partition, and who is online.

Flower names clients by node id; the experiment by partition id (which data, which true
cluster). The directory asks every newly registered client once for its partition
(``get_properties``), keeps the mapping both ways, lets a restarted SuperNode take its
partition back, refuses a federation whose size does not match the experiment, and says
which partitions are online in a round (late joiners come online at their ``join_round``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from logging import ERROR, WARNING

from flwr.common import GetPropertiesIns, log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

import numpy as np

from ...protocol import DATA_SOURCE, DATA_SOURCE_FOLDER, NUM_PARTITIONS, PARTITION_ID, TRAIN_EXAMPLES, TRUE_CLUSTER, is_int

UNKNOWN_CLUSTER = -1  # the true cluster of a device that did not say (no cluster-id in its node config)


class FederationError(RuntimeError):
    """The federation does not match the experiment (wrong number of SuperNodes, no client answers)."""


@dataclass(frozen=True)
class Federation:
    """How the run's Flower clients behave, as the runner knows it (not the algorithm's business)."""

    join_round: Mapping[int, int] = field(default_factory=dict)  # partition id -> first round it is online
    wait_for_clients_s: float = 60.0  # for the first clients to register
    timeout_s: float | None = None  # of a get_properties call


class ClientDirectory:
    """Partition ids of Flower clients, learnt once per client; see the module docstring."""

    def __init__(self, num_clients: int, federation: Federation | None = None) -> None:
        federation = federation or Federation()
        self.num_clients = num_clients
        self.join_round = federation.join_round
        self.wait_for_clients_s = federation.wait_for_clients_s
        self.timeout_s = federation.timeout_s
        self._pid_of_cid: dict[str, int] = {}
        self._proxies: dict[int, ClientProxy] = {}
        self._discovered_in = 0
        self._device_facts: dict[int, tuple[int, int | None]] = {}  # pid -> (true cluster, train examples)
        self.online: list[int] = []  # partition ids online in the latest round asked about

    @property
    def connected(self) -> list[int]:
        """Partition ids of every registered client, online or not yet, in order."""
        return sorted(self._proxies)

    def proxy(self, pid: int) -> ClientProxy:
        return self._proxies[pid]

    def pid_of(self, proxy: ClientProxy) -> int | None:
        return self._pid_of_cid.get(proxy.cid)

    def true_clusters(self, experiment: np.ndarray) -> np.ndarray:
        """The experiment's true cluster ids, with what devices on their own data reported instead
        (``UNKNOWN_CLUSTER`` where a device did not say)."""
        if not self._device_facts:
            return experiment
        true = experiment.copy()
        for pid, (cluster, _) in self._device_facts.items():
            true[pid] = cluster
        return true

    def train_sizes(self, experiment: Sequence[int] | None) -> Sequence[int] | None:
        """The partition's training-set sizes, with each device's own where it reported one."""
        if experiment is None or not self._device_facts:
            return experiment
        sizes = list(experiment)
        for pid, (_, examples) in self._device_facts.items():
            if examples is not None:
                sizes[pid] = examples
        return sizes

    def online_clients(self, server_round: int, client_manager: ClientManager) -> list[int]:
        """Partition ids of registered clients that are online in ``server_round``."""
        if self._discovered_in != server_round:
            self._discover(server_round, client_manager)
            self._discovered_in = server_round
        self.online = [pid for pid in sorted(self._proxies) if self.join_round.get(pid, 1) <= server_round]
        return self.online

    def _discover(self, server_round: int, client_manager: ClientManager) -> None:
        """Learn the partition id of every newly registered Flower client.

        A SuperNode that restarts registers under a new node id; it takes its
        partition back once its old node id has left the federation.
        """
        first = not self._pid_of_cid
        if first:
            deadline = time.monotonic() + self.wait_for_clients_s
            while len(client_manager.all()) < self.num_clients and time.monotonic() < deadline:
                time.sleep(0.5)
        proxies = client_manager.all()
        unknown = [p for cid, p in proxies.items() if cid not in self._pid_of_cid]
        errors: list[str] = []
        if unknown:
            with ThreadPoolExecutor(max_workers=min(32, len(unknown))) as pool:
                try:
                    answers = list(pool.map(lambda p: self._ask_partition(p, server_round, errors), unknown))
                except FederationError as err:  # every client may find it: said once, here
                    log(ERROR, "fedcluster: %s", err)
                    raise
            for proxy, (pid, facts) in zip(unknown, answers):
                if pid is None:
                    continue
                holder = next((cid for cid, p in self._pid_of_cid.items() if p == pid), None)
                if holder is not None and holder in proxies:
                    log(WARNING, "client %s reports partition id %s, already taken; ignored", proxy.cid, pid)
                    continue
                self._pid_of_cid.pop(holder, None)
                self._pid_of_cid[proxy.cid] = pid
                if facts is None:
                    self._device_facts.pop(pid, None)
                else:
                    self._device_facts[pid] = facts
        self._proxies = {pid: proxies[cid] for cid, pid in self._pid_of_cid.items() if cid in proxies}
        if first and not self._proxies:
            message = "no client answered; the first error was: " + (errors[0] if errors else "none connected")
            log(ERROR, "fedcluster: %s", message)
            raise FederationError(message)
        if first and len(self._proxies) < self.num_clients:
            log(WARNING, "%d of %d clients are connected; the others join when they connect",
                len(self._proxies), self.num_clients)

    def _ask_partition(
        self, proxy: ClientProxy, server_round: int, errors: list[str]
    ) -> tuple[int | None, tuple[int, int | None] | None]:
        """The client's partition id and, for a device on its own data, (true cluster, train examples)."""
        try:
            res = proxy.get_properties(GetPropertiesIns({}), timeout=self.timeout_s, group_id=server_round)
            pid, num = res.properties.get(PARTITION_ID), res.properties.get(NUM_PARTITIONS)
        except Exception as err:  # noqa: BLE001 - an unreachable client is retried next round
            errors.append(f"{type(err).__name__}: {err}")
            log(WARNING, "client %s did not answer get_properties: %s", proxy.cid, err)
            return None, None
        if not (is_int(pid) and is_int(num)):
            log(WARNING, "client %s reports partition id %r of %r; ignored", proxy.cid, pid, num)
            return None, None
        if num != self.num_clients:
            n = self.num_clients
            message = (
                f"the federation has num-partitions={num}, but partition.num_clients is {n}. "
                f"Give the simulation one SuperNode per client: flwr run . --federation-config "
                f"'num-supernodes={n}' (or once: flwr federation simulation-config --num-supernodes {n}), "
                f"or set partition.num_clients={num}."
            )
            raise FederationError(message)
        if not 0 <= pid < self.num_clients:
            log(WARNING, "client %s reports partition id %s; ignored", proxy.cid, pid)
            return None, None
        if res.properties.get(DATA_SOURCE) != DATA_SOURCE_FOLDER:
            return pid, None
        cluster, examples = res.properties.get(TRUE_CLUSTER), res.properties.get(TRAIN_EXAMPLES)
        if not (is_int(cluster) and cluster >= 0):
            log(WARNING, "client %s (own data) gave no cluster-id: purity, ARI and NMI against the true "
                "clusters are unavailable", pid)
        return pid, (
            int(cluster) if is_int(cluster) and cluster >= 0 else UNKNOWN_CLUSTER,
            int(examples) if is_int(examples) and examples > 0 else None,
        )
