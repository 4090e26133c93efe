"""The client directory: which Flower node is which partition, and who is online.

Flower names clients by node id; the experiment by partition id (which data, which true
cluster). The directory asks every node it has not met once for its partition (the query
``identify``, sent through the grid), keeps the mapping both ways, lets a restarted SuperNode take
its partition back, refuses a federation whose size does not match the experiment, and says which
partitions are online in a round (late joiners come online at their ``join_round``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import ERROR, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import log

from ... import protocol
from ...protocol import IDENTIFY, NUM_PARTITIONS, OWN_DATA, PARTITION_ID, TRAIN_EXAMPLES, TRUE_CLUSTER, is_int
from .messages import describe_error

UNKNOWN_CLUSTER = -1  # the true cluster of a device that did not say (no cluster-id in its node config)


class FederationError(RuntimeError):
    """The federation does not match the experiment (wrong number of SuperNodes, no client answers)."""


@dataclass(frozen=True)
class Federation:
    """How the run's Flower clients behave, as the runner knows it (not the algorithm's business)."""

    join_round: Mapping[int, int] = field(default_factory=dict)  # partition id -> first round it is online
    wait_for_clients_s: float = 60.0  # for the first clients to register
    timeout_s: float | None = None  # of an identify query


class ClientDirectory:
    """Partition ids of Flower nodes, learnt once per node; see the module docstring."""

    def __init__(self, num_clients: int, federation: Federation | None = None) -> None:
        federation = federation or Federation()
        self.num_clients = num_clients
        self.join_round = federation.join_round
        self.wait_for_clients_s = federation.wait_for_clients_s
        self.timeout_s = federation.timeout_s
        self._pid_of_node: dict[int, int] = {}
        self._node_of_pid: dict[int, int] = {}  # the connected ones
        self._discovered_in = 0
        self._device_facts: dict[int, tuple[int, int | None]] = {}  # pid -> (true cluster, train examples)
        self.online: list[int] = []  # partition ids online in the latest round asked about

    @property
    def connected(self) -> list[int]:
        """Partition ids of every registered client, online or not yet, in order."""
        return sorted(self._node_of_pid)

    def node(self, pid: int) -> int:
        """The node id of partition ``pid``."""
        return self._node_of_pid[pid]

    def pid_of(self, node_id: int) -> int | None:
        return self._pid_of_node.get(node_id)

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

    def online_clients(self, server_round: int, grid: Any) -> list[int]:
        """Partition ids of registered clients that are online in ``server_round``."""
        if self._discovered_in != server_round:
            self._discover(server_round, grid)
            self._discovered_in = server_round
        self.online = [pid for pid in sorted(self._node_of_pid) if self.join_round.get(pid, 1) <= server_round]
        return self.online

    def _discover(self, server_round: int, grid: Any) -> None:
        """Learn the partition id of every node the grid has that is not known yet.

        A SuperNode that restarts registers under a new node id; it takes its partition back once
        its old node id has left the federation.
        """
        first = not self._pid_of_node
        nodes = sorted(grid.get_node_ids())
        if first:  # under simulation the nodes may appear a moment after the ServerApp starts
            deadline = time.monotonic() + self.wait_for_clients_s
            while len(nodes) < self.num_clients and time.monotonic() < deadline:
                time.sleep(0.5)
                nodes = sorted(grid.get_node_ids())
        unknown = [node for node in nodes if node not in self._pid_of_node]
        errors: list[str] = []
        if unknown:
            answers = self._ask_partitions(grid, unknown, server_round, errors)
            for node in unknown:
                pid, facts = answers.get(node, (None, None))
                if pid is None:
                    continue
                holder = next((n for n, p in self._pid_of_node.items() if p == pid), None)
                if holder is not None and holder in nodes:
                    log(WARNING, "node %s reports partition id %s, already taken; ignored", node, pid)
                    continue
                self._pid_of_node.pop(holder, None)
                self._pid_of_node[node] = pid
                if facts is None:
                    self._device_facts.pop(pid, None)
                else:
                    self._device_facts[pid] = facts
        present = set(nodes)
        self._node_of_pid = {pid: node for node, pid in self._pid_of_node.items() if node in present}
        if first and not self._node_of_pid:
            message = "no client answered; the first error was: " + (errors[0] if errors else "none connected")
            log(ERROR, "fedcluster: %s", message)
            raise FederationError(message)
        if first and len(self._node_of_pid) < self.num_clients:
            log(WARNING, "%d of %d clients are connected; the others join when they connect",
                len(self._node_of_pid), self.num_clients)

    def _ask_partitions(
        self, grid: Any, nodes: list[int], server_round: int, errors: list[str]
    ) -> dict[int, tuple[int | None, tuple[int, int | None] | None]]:
        """Each node's partition id and, for a device on its own data, (true cluster, train examples)."""
        content = RecordDict({protocol.CONFIG: ConfigRecord({protocol.ROUND_KEY: server_round})})
        messages = [Message(content, node, IDENTIFY.message_type, group_id=str(server_round)) for node in nodes]
        answers: dict[int, tuple[int | None, tuple[int, int | None] | None]] = {}
        for reply in grid.send_and_receive(messages, timeout=self.timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error():
                errors.append(describe_error(reply))
                log(WARNING, "node %s did not tell its partition: %s", node, describe_error(reply))
                continue
            try:
                answers[node] = self._read_identity(node, dict(reply.content.metric_records[protocol.METRICS]))
            except (KeyError, ValueError, TypeError) as err:
                log(WARNING, "node %s sent an unreadable identity (%s); ignored", node, err)
        missing = [node for node in nodes if node not in answers]
        if missing and not errors:
            errors.append(f"{len(missing)} node(s) did not answer within the round timeout "
                          f"(simulation.round_timeout_s: {self.timeout_s} s)")
        return answers

    def _read_identity(self, node: int, metrics: Mapping[str, Any]) -> tuple[int | None, tuple[int, int | None] | None]:
        pid, num = metrics.get(PARTITION_ID), metrics.get(NUM_PARTITIONS)
        if not (is_int(pid) and is_int(num)):
            log(WARNING, "node %s reports partition id %r of %r; ignored", node, pid, num)
            return None, None
        if num != self.num_clients:
            n = self.num_clients
            message = (
                f"the federation has num-partitions={num}, but partition.num_clients is {n}. "
                f"Give the simulation one SuperNode per client: flwr run . --federation-config "
                f"'num-supernodes={n}' (or once: flwr federation simulation-config --num-supernodes {n}), "
                f"or set partition.num_clients={num}."
            )
            log(ERROR, "fedcluster: %s", message)
            raise FederationError(message)
        if not 0 <= pid < self.num_clients:
            log(WARNING, "node %s reports partition id %s; ignored", node, pid)
            return None, None
        if metrics.get(OWN_DATA) != 1:
            return pid, None
        cluster, examples = metrics.get(TRUE_CLUSTER), metrics.get(TRAIN_EXAMPLES)
        if not (is_int(cluster) and cluster >= 0):
            log(WARNING, "client %s (own data) gave no cluster-id: purity, ARI and NMI against the true "
                "clusters are unavailable", pid)
        return pid, (
            int(cluster) if is_int(cluster) and cluster >= 0 else UNKNOWN_CLUSTER,
            int(examples) if is_int(examples) and examples > 0 else None,
        )
