"""The ClientApp: one Flower action per client task, the same on every engine and every device.

Every declared task (the three every run uses, :data:`~fedcluster_flwr.protocol.TRAIN`,
:data:`~fedcluster_flwr.protocol.EVALUATE` and :data:`~fedcluster_flwr.protocol.IDENTIFY`, and each
family's own, :func:`fedcluster_flwr.registry.handles`) is a handler registered under Flower's
message type for it: ``train`` and ``evaluate`` (Flower's default actions, so Flower's stock
strategies can drive them too), ``train.<task>`` for work that trains a model (``train_select``,
``gossip_train``) and ``query.<task>`` for work that only reports (``select``, ``gram_eigen``,
``relevance``, ``identify``). A handler reads the instruction off the message (the task's codec
checks its records and round before any work), runs the task on the node's client
(:meth:`~fedcluster_flwr.client.ClusterClient.run`), with what the client keeps on its node
(the node's ``Context.state``, :class:`~fedcluster_flwr.client.ClientState`), and replies with the
task's records.

Which client: the node config says which data, ``partition-id``/``num-partitions`` (a partition of
the experiment's dataset, as in simulation) or ``data-dir``/``client-id`` (the device's own files;
see :mod:`fedcluster_flwr.data.device`); the experiment is the one given (``fedcluster run``) or
the one the run config names (``flwr run``).

How a NumPyClient's methods map here (Flower's "Upgrade to Message API" guide): ``fit`` is the
``train`` handler (``parameters`` are the message's ``arrays`` record, ``config`` its ``config``
record; the reply's ``arrays`` and ``metrics`` with ``num-examples``), ``evaluate`` the
``evaluate`` handler, ``get_properties`` the ``identify`` query.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .. import protocol, registry
from ..client import ClientState, ClusterClient
from ..data.device import DeviceClient, FolderSource, load_device_data, node_data_source
from ..data.sources import input_format
from ..experiment import Experiment
from ..numerics import configure_torch
from ..protocol import EVALUATE, IDENTIFY, TRAIN, Task
from ..training import LocalCompute
from .run_config import experiment_from_run_config


def make_device_client(experiment: Experiment, source: FolderSource) -> DeviceClient:
    """The client of a SuperNode started with ``data-dir``: client ``source.client_id`` of the
    experiment, on the folder's data."""
    config = experiment.config
    configure_torch(config)  # before the device's data become tensors (portable numerics' pins)
    data = load_device_data(source.data_dir, input_format(config))
    return experiment.client(source.client_id, data=data,
                             client_class=functools.partial(DeviceClient, cluster_id=source.cluster_id))


class FedclusterClientApp(ClientApp):
    """The ClientApp of one given experiment (``fedcluster run``; None: the run config's, ``flwr run``).

    ``keep_clients``: build each partition's client once and keep it (the in-process engines, where
    one process plays every node); otherwise a client is built per message, as Flower builds one
    per message from a ``client_fn``. ``compute`` gives each partition's client its local compute
    (the batched engine's, which meets the round's other clients).

    Flower's Ray engine pickles the ClientApp into every message it hands an actor; this one is
    pickled as its experiment and built again from it (a ClientApp made of closures is pickled by
    value, and cloudpickle searches the loaded modules for each function's submodules: ~2.3 ms of
    the engine process's GIL per message, benchmarks/overhead).
    """

    def __init__(
        self,
        experiment: Experiment | None = None,
        *,
        keep_clients: bool = False,
        compute: Callable[[int], LocalCompute] | None = None,
    ) -> None:
        super().__init__()
        self._experiment = experiment
        self.keep_clients = keep_clients
        self.compute = compute
        self._clients: dict[int, ClusterClient] = {}
        registry.load_families()
        tasks = {IDENTIFY.name: IDENTIFY, TRAIN.name: TRAIN, EVALUATE.name: EVALUATE}
        tasks |= {name: task for name, (task, _) in sorted(registry.HANDLERS.items())}
        register = {protocol.TRAIN_KIND: self.train, protocol.QUERY_KIND: self.query, protocol.EVALUATE_KIND: self.evaluate}
        for task in tasks.values():
            handler = self.identify if task is IDENTIFY else functools.partial(self.handle, task)
            register[task.kind](task.action)(handler)

    def __reduce__(self) -> tuple[type[FedclusterClientApp], tuple[Experiment | None]]:
        return FedclusterClientApp, (self._experiment,)

    def experiment(self, context: Context) -> Experiment:
        """The experiment given, or the run config's (``flwr run``: one per run config in a process)."""
        return self._experiment if self._experiment is not None else experiment_from_run_config(context.run_config)

    def client(self, context: Context) -> ClusterClient:
        """The client of this node's data (see the module docstring)."""
        source = node_data_source(context.node_config)
        pid = source.client_id if isinstance(source, FolderSource) else source.pid
        if self.keep_clients and pid in self._clients:
            return self._clients[pid]
        torch.set_num_threads(1)  # one thread per simulated client; Ray runs several at once
        experiment = self.experiment(context)
        if isinstance(source, FolderSource):
            client: ClusterClient = make_device_client(experiment, source)
        else:
            client = experiment.client(source.pid, source.num_partitions)
        if self.compute is not None:
            client.compute = self.compute(pid)
        if self.keep_clients:
            self._clients[pid] = client
        return client

    def handle(self, task: Task, message: Message, context: Context) -> Message:
        """``task``'s instruction in ``message``, run on this node's client; its reply."""
        inputs = task.read_instruction(message.content)
        client = self.client(context)
        client.state = ClientState(context.state, task.state, task.name)  # what it keeps on this node
        output = client.run(task, inputs)
        content = task.reply_content(output.blocks, output.num_examples, output.metrics, client.parameter_names)
        return Message(content, reply_to=message)

    def identify(self, message: Message, context: Context) -> Message:
        """Which partition this node is (and a device's own facts). A node whose partition id the
        experiment lacks (more SuperNodes than ``partition.num_clients``) still says it, so that the
        server refuses the federation once, naming the fix; any work it is sent fails."""
        source = node_data_source(context.node_config)
        if isinstance(source, FolderSource):
            identity = self.client(context).identity()
        else:
            identity = {protocol.PARTITION_ID: source.pid, protocol.NUM_PARTITIONS: source.num_partitions,
                        protocol.OWN_DATA: 0}
        return Message(RecordDict({protocol.METRICS: MetricRecord(identity)}), reply_to=message)


app = FedclusterClientApp()
