"""The batched engine over Ray actors (``simulation.engine: batched`` with ``simulation.batched_actors``
or ``simulation.ray_address``): a round's client work spread over shards of clients, each shard a
batched grid in an actor of its own, on a node (or GPU) of its own where the cluster has them.

What runs where:

* the ServerApp's process keeps the server side, as on the Ray engine: the strategy's sampling,
  aggregation, clustering and the results; its grid is a :class:`ShardedGrid`, which hands each
  exchange's messages to the actors of their clients' shards at once and gathers the replies in
  node order (partition-id order);
* each actor (:class:`ShardHost`) holds one shard's clients, built once with their data resident
  (read on its own node, from the partition it is told), and runs the batched engine (a
  :class:`~fedcluster_flwr.engines.inprocess.BatchedGrid`) on its shard's messages: each client's
  handler as on one machine, the torch work of the shard's clients stacked.

Shards are contiguous blocks of partition ids (:func:`shards`), fixed when the run starts. What a
client computes does not depend on which clients share its stack (the batched engine makes the
in-process engine's decisions, whatever is stacked with what; ``tests/test_engines.py``), so a seed
gives the same decisions on one process and on any number of actors; a resume may use another count.

Placement: without ``simulation.ray_address``, Ray starts on this machine for the run (in the run's
process group, which ends with it) and ``batched_actors`` actors share its cores, each with its
share as the batched engine's workers. With it, one actor per alive node of the cluster, holding
the node's CPUs (or, for ``client.device`` cuda, one per GPU), unless ``batched_actors`` says how many
(then spread over the nodes as Ray places them). An actor's stacks fit the memory of its own node
(``batched_memory_gb``, or half of what is free there).

Faults: a client's failure inside a shard is that client's error reply, as on one machine; the
batched engine's own errors, an actor that dies (a lost node) or cannot be built are the engine's:
the run stops with one line naming the shard and its partitions, and resumes from its last
checkpoint. A configuration or data mistake found while a shard is built is raised as itself.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from flwr.app import Message

from ..client import kept_state, restore_kept_state
from ..config.sections import ExperimentConfig
from ..data import DataError
from ..declarations.schema import ConfigError
from .batched import EngineError, cpu_threads
from .inprocess import PARTITION_ID, BatchedGrid, InProcessGrid

log = logging.getLogger("fedcluster")

ShardBuilder = Callable[[Sequence[int], int], BatchedGrid]  # (partition ids, CPU workers) -> the shard's grid


def shards(num_clients: int, count: int) -> list[list[int]]:
    """``count`` contiguous blocks of the partition ids 0..num_clients-1, sizes differing by at most one."""
    count = max(1, min(count, num_clients))
    bounds = [round(k * num_clients / count) for k in range(count + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(count)]


class ShardHost:
    """One shard's clients and their batched grid, in a Ray actor (made remote by :func:`sharded_grid`)."""

    def __init__(self, build: ShardBuilder, pids: Sequence[int], workers: int) -> None:
        self.pids = list(pids)
        self.error: Exception | None = None
        try:
            self.grid = build(self.pids, workers)
        except Exception as err:  # noqa: BLE001 - kept, and raised by node(): Ray then names the cause
            self.error = err  # (an actor whose constructor raises only says that it died)

    def node(self) -> str:
        """Where this actor runs (its Ray node: address and id, and the GPUs Ray gave it), once its
        shard is built; the error that kept it from being built otherwise."""
        import ray

        if self.error is not None:
            raise self.error
        gpus = ray.get_gpu_ids()
        held = f", GPU {','.join(map(str, gpus))}" if gpus else ""
        return f"{ray.util.get_node_ip_address()}, {ray.get_runtime_context().get_node_id()[:12]}{held}"

    def deliver(self, messages: Sequence[Message]) -> list[Message]:
        return self.grid.deliver(messages)

    def states(self) -> dict[int, dict[str, Any]]:
        """What each client of the shard keeps on its node (by partition id), as plain values."""
        return {int(c.node_config[PARTITION_ID]): kept_state(c.state) for c in self.grid.contexts.values()}

    def restore(self, kept: Mapping[int, Mapping[str, Any]]) -> None:
        for context in self.grid.contexts.values():
            restore_kept_state(context.state, kept.get(int(context.node_config[PARTITION_ID]), {}))

    def close(self) -> None:
        rendezvous = getattr(self.grid, "rendezvous", None)
        if rendezvous is not None:
            rendezvous.close()


class ShardedGrid(InProcessGrid):
    """The grid of a sharded batched run: every node known here, each exchange run by the actors of
    its clients' shards at once (see the module docstring)."""

    def __init__(self, node_configs: Sequence[Mapping[str, Any]], hosts: Sequence[Any],
                 shard_pids: Sequence[Sequence[int]], nodes: Sequence[str]) -> None:
        super().__init__(self._no_local_app, node_configs)
        self.hosts, self.shard_pids, self.nodes = list(hosts), [list(p) for p in shard_pids], list(nodes)
        self.shard_of = {pid: k for k, pids in enumerate(self.shard_pids) for pid in pids}

    @staticmethod
    def _no_local_app(message: Message, context: Any) -> Message:
        raise EngineError("a sharded grid runs no client in the ServerApp's process")

    def by_shard(self, messages: Sequence[Message]) -> dict[int, list[int]]:
        """The messages' indices, by the shard of their client (each shard's list is one actor call)."""
        indices: dict[int, list[int]] = {}
        for index, message in enumerate(messages):
            pid = int(self.contexts[message.metadata.dst_node_id].node_config[PARTITION_ID])
            indices.setdefault(self.shard_of[pid], []).append(index)
        return indices

    def deliver(self, messages: Sequence[Message]) -> list[Message]:
        """Each message's reply, from the actor of its client's shard; every shard's messages at once."""
        by_shard = self.by_shard(messages)
        pending = {k: self.hosts[k].deliver.remote([messages[i] for i in indices]) for k, indices in by_shard.items()}
        replies: list[Message | None] = [None] * len(messages)
        for k, indices in by_shard.items():
            for index, reply in zip(indices, self._get(k, pending[k])):
                replies[index] = reply
        return replies  # type: ignore[return-value]

    def _get(self, shard: int, ref: Any) -> Any:
        """``ray.get`` of one shard's work; an actor lost or failing is this engine's fault, said once."""
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            raise EngineError(f"{self.describe(shard)} was lost ({type(err).__name__}): the run stops; resume it "
                              "(its last checkpoint), on the nodes still there") from None
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else err
            if isinstance(cause, (ConfigError, DataError)):  # a user's mistake, found on the node: as itself
                raise cause from None
            raise EngineError(f"{self.describe(shard)} failed: {type(cause).__name__}: {cause}") from None

    def describe(self, shard: int) -> str:
        pids = self.shard_pids[shard]
        return f"the Ray actor of shard {shard} (partitions {pids[0]}-{pids[-1]}, node {self.nodes[shard]})"

    def engine_fault(self, err: Exception) -> bool:
        return isinstance(err, EngineError)

    def node_states(self) -> dict[int, dict[str, Any]]:
        """What every client keeps on its node, gathered from the shards (by partition id)."""
        states: dict[int, dict[str, Any]] = {}
        for shard, host in enumerate(self.hosts):
            states |= self._get(shard, host.states.remote())
        return states

    def restore_states(self, kept: Mapping[int, Mapping[str, Any]]) -> None:
        """Give each shard's clients back what they kept (a resumed run's checkpoint)."""
        refs = [(k, host.restore.remote({pid: kept[pid] for pid in self.shard_pids[k] if pid in kept}))
                for k, host in enumerate(self.hosts)]
        for shard, ref in refs:
            self._get(shard, ref)


PLACEMENT_TIMEOUT_S = 120.0  # an actor Ray cannot place waits for ever; a run waits this long, then says why


def place_shards(config: ExperimentConfig, cluster: Mapping[str, float],
                 alive: Sequence[Mapping[str, Any]]) -> tuple[list[list[int]], list[tuple[dict[str, Any], int]]]:
    """The shards and, per shard, its actor's Ray options and CPU workers: ``batched_actors`` actors
    sharing the cluster's CPUs evenly (a fraction each where they outnumber the cores; at least one
    worker each); else one per GPU (``client.device`` not
    cpu, on a cluster with GPUs: one GPU and one worker each) or, on a joined cluster, one per alive
    node holding all that node's CPUs (pinned to it)."""
    num_clients, count = config.partition.num_clients, config.simulation.batched_actors
    gpus = int(cluster.get("GPU", 0)) if config.client.device != "cpu" else 0
    if count is None and gpus:
        count = gpus
    if count is not None:
        blocks = shards(num_clients, count)
        gpu = 1 if gpus >= len(blocks) else 0
        share = cluster.get("CPU", 1) / len(blocks)  # Ray's reservation may be a fraction: more actors than cores
        workers = 1 if gpu else max(1, math.floor(share))
        return blocks, [({"num_cpus": share, "num_gpus": gpu}, workers) for _ in blocks]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(alive, key=lambda n: str(n.get("NodeManagerAddress")))
    blocks = shards(num_clients, len(nodes))
    placements = []
    for node in nodes[: len(blocks)]:
        cpus = max(1, int(node.get("Resources", {}).get("CPU", 1)))
        placements.append(({"num_cpus": cpus, "scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}, cpus))
    return blocks, placements


@contextmanager
def sharded_grid(config: ExperimentConfig, build: ShardBuilder) -> Iterator[ShardedGrid]:
    """Ray started (or joined: ``simulation.ray_address``), one actor per shard built with ``build``
    (every client made before the first round), the grid over them; the actors ended and Ray left
    (a cluster joined keeps running) when the run ends, however it ends."""
    import ray

    address = config.simulation.ray_address
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    init: dict[str, Any] = {"address": address or "local", "include_dashboard": False, "logging_level": "ERROR",
                            "log_to_driver": False, "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}}}
    if address is None:
        init["num_cpus"] = cpu_threads()
    with warnings.catch_warnings():  # Ray's tip about a future default for GPU visibility: not ours to act on
        warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
        ray.init(**init)
    hosts: list[Any] = []
    try:
        num_clients = config.partition.num_clients
        blocks, placements = place_shards(config, ray.cluster_resources(), [n for n in ray.nodes() if n.get("Alive")])
        remote = ray.remote(ShardHost)
        for pids, (options, workers) in zip(blocks, placements):
            hosts.append(remote.options(max_restarts=0, **options).remote(build, pids, workers))
        grid = ShardedGrid([{PARTITION_ID: pid, "num-partitions": num_clients} for pid in range(num_clients)],
                           hosts, blocks, ["?"] * len(blocks))
        refs = [host.node.remote() for host in hosts]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=PLACEMENT_TIMEOUT_S)
        if waiting:
            shard = refs.index(waiting[0])
            raise ConfigError("simulation.batched_actors", f"{grid.describe(shard)} was not placed within "
                              f"{PLACEMENT_TIMEOUT_S:.0f} s: the cluster has no node with {placements[shard][0]} "
                              "free; ask for fewer actors, or start more nodes")
        grid.nodes = [grid._get(k, ref) for k, ref in enumerate(refs)]  # each shard built, or its error
        log.info("fedcluster: batched over %d Ray actors: %s", len(hosts),
                 "; ".join(f"partitions {p[0]}-{p[-1]} on node {n}" for p, n in zip(blocks, grid.nodes)))
        yield grid
    finally:
        for host in hosts:
            try:
                ray.get(host.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - an actor already lost has nothing to close
                pass
            ray.kill(host)
        ray.shutdown()
