"""The batched engine: a round's clients run their task handlers as usual (on the batched grid,
:class:`~fedcluster_flwr.engines.inprocess.BatchedGrid`), and the torch work the handlers ask for
(local training, evaluation, a model's loss on the client's data) executes for all of them together.

How, without a second copy of any algorithm: the ClientApp's handler of every message of an exchange
runs unchanged, each in a thread of its own, one handler at a time (:class:`Rendezvous`). When a handler asks its client's :class:`BatchedCompute`
to train or evaluate a model, the request is parked and the thread waits. Once every handler of
the round is either waiting or done, the parked requests execute together (:func:`execute`):
requests of one kind on one architecture and device, with equal training settings, run stacked
(:mod:`.stacked`); the others run one client at a time, exactly as on the in-process engine. Then
the handlers go on, to their next request or their reply. Which requests meet is a function of the
handlers alone, never of thread timing, and each group runs in partition-id order, so a seed
gives the same run every time on the same machine.

Where stacking does not pay or cannot honour the work, the requests run one client at a time,
spread over the workers: on a CPU the training of the models in :data:`CPU_UNSTACKED_MODELS`;
anywhere, a model with buffers or hooks and an optimizer the stacked step does not know (the run
says so once). The client axis is cut into chunks that fit ``simulation.batched_memory_gb``
(default: half the memory free when the engine starts, on the GPU or in RAM, at most 4 GB of RAM);
on a CPU an evaluation stack holds at most :data:`CPU_EVALUATION_STACK` clients.

**Engine errors are not client failures.** A stack that runs out of memory is split in halves and
retried (down to one client at a time); any other exception inside stacked work is the engine's
(:class:`EngineError`): it stops the run with the error instead of failing the chunk's clients. Only
a client's own work (a request run alone, as on the in-process engine) can fail that client.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..training import PLAIN, LocalCompute, Objective, TrainSettings, evaluate, train
from ..types import NDArrays
from .stacked import STACKED_OPTIMIZERS, ClientBatchData, architecture_key, evaluate_stacked, train_stacked, why_not_stackable

log = logging.getLogger("fedcluster")

# Models that train slower stacked than one client after another on a CPU worker (one torch
# thread): `python benchmarks/engines/run.py models`, results/models.json, stacked/alone per
# client-step with the grouped channels-last step: 1.24 (cnn_briggs, batch 10), 1.13 (lenet_cifar,
# batch 32); every other registered model is faster stacked (0.11-0.91; cnn_zec_fmnist 0.32). Their
# wide convolutions at these batch sizes are already efficient one client at a time.
# On a GPU every model is stacked.
CPU_UNSTACKED_MODELS = frozenset({"cnn_briggs", "lenet_cifar"})

# Clients per evaluation stack on a CPU: a client's evaluation is already one large batch, and a
# few clients' grouped channels-last convolutions run about twice as fast as one client's after
# another, more gain nothing (benchmarks/engines/README.md).
CPU_EVALUATION_STACK = 8


class EngineError(RuntimeError):
    """The batched engine's own failure (not a client's): stops the run, with the original error."""

# Below this many parameter-samples a batch runs on the calling thread: handing tiny jobs to the
# workers costs more than it saves (the default digits conf's rounds: ~2e6). Ours, not measured
# finely: DAC's full-scale rounds are ~1e10, far above it.
WORK_FOR_WORKERS = 20_000_000


@dataclass(eq=False)
class Request:
    """One client's torch work, parked until its group executes."""

    kind: str  # "train" | "evaluate"
    pid: int
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    device: torch.device
    settings: TrainSettings | None = None
    generator: torch.Generator | None = None
    objective: Objective = PLAIN
    anchors: Mapping[str, NDArrays] = field(default_factory=dict)  # the objective's named models, this client's
    done: bool = False
    result: Any = None
    error: BaseException | None = None

    def group_key(self) -> tuple:
        """Requests with equal keys run stacked. The objective is part of it: its terms must be
        hashable and comparable (settings only; the anchors' values are per client, not in it)."""
        return (self.kind, architecture_key(self.model), self.device, self.settings, self.objective,
                tuple(sorted(self.anchors)))

    def run_alone(self) -> Any:
        """What the in-process engine does for this request."""
        if self.kind == "train":
            return train(self.model, self.x, self.y, self.settings, self.generator, self.device, self.objective,
                         self.anchors)
        return evaluate(self.model, self.x, self.y, self.device)


class Rendezvous:
    """Runs callables in threads of their own, one at a time (a baton passes between them); a
    thread that submits a request waits until every thread is waiting or finished, then all
    waiting requests execute (``execute``) at once."""

    def __init__(self, execute: Callable[[list[Request]], None], close: Callable[[], None] = lambda: None) -> None:
        self._execute = execute
        self.close = close  # ends what ``execute`` keeps between batches (the engine's workers)
        self._condition = threading.Condition()
        self._running = 0
        self._parked: list[Request] = []
        self._requests = 0
        # Only the thread holding the baton runs handler code; it passes it on when it parks or
        # ends. The handlers then never interleave (CPython 3.11's ast module, lazy imports and much
        # library code are not safe to run from several threads at once: seen as "SystemError: AST
        # constructor recursion depth mismatch" in one client), and the threads are coroutines in all
        # but name. The torch work itself runs on the workers, outside the baton.
        self._baton = threading.Lock()
        self._unbatched_said: set[str] = set()

    def run_all(self, calls: Sequence[Callable[[], Any]], task: str = "") -> list[tuple[bool, Any]]:
        """``(True, value)`` or ``(False, exception)`` for each call, in order. ``task`` names what
        the calls do: a task none of whose calls asked for batched work is named once in the log."""
        outcomes: list[tuple[bool, Any]] = [(False, RuntimeError("not run"))] * len(calls)
        with self._condition:
            self._running = len(calls)
            self._requests = 0

        def body(i: int, call: Callable[[], Any]) -> None:
            self._baton.acquire()
            try:
                outcomes[i] = (True, call())
            except BaseException as err:  # noqa: BLE001 - the caller decides; a failed client is a failure
                outcomes[i] = (False, err)
            finally:
                with self._condition:
                    self._running -= 1
                    self._execute_if_all_wait()
                self._baton.release()

        threads = [threading.Thread(target=body, args=(i, call), daemon=True) for i, call in enumerate(calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if calls and not self._requests and task not in self._unbatched_said:
            self._unbatched_said.add(task)
            log.warning("batched engine: task %s has no work this engine stacks; its clients run one at a time", task)
        return outcomes

    def submit(self, request: Request) -> Any:
        with self._condition:
            self._requests += 1
            self._parked.append(request)
            self._running -= 1
            self._execute_if_all_wait()
            self._baton.release()
            while not request.done:
                self._condition.wait()
        self._baton.acquire()
        if request.error is not None:
            raise request.error
        return request.result

    def _execute_if_all_wait(self) -> None:  # with the lock held: no other thread can run meanwhile
        if self._running or not self._parked:
            return
        batch, self._parked = sorted(self._parked, key=lambda r: r.pid), []
        try:
            self._execute(batch)
        except BaseException as err:  # noqa: BLE001 - handed to each waiting client
            for request in batch:
                if not request.done:
                    request.error, request.done = err, True
        self._running += len(batch)
        self._condition.notify_all()


@dataclass
class BatchPolicy:
    """What runs stacked, in chunks of how many clients, on how many threads.

    ``workers`` threads each run one stack (or one lone client) at a time, on one torch thread:
    torch releases the GIL inside its kernels, so on a CPU this uses the cores as the Ray engine's
    one-thread client processes do, where one stack on several torch threads would spend its time
    synchronising them over small operations."""

    stack_on_cpu: bool
    memory_bytes: int
    workers: int = 1
    said: set[str] = field(default_factory=set)
    _pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        """The workers, started at the run's first batch large enough for them (:meth:`close` ends them)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="batched-worker")
        return self._pool

    def close(self) -> None:
        """End the workers: a process that runs many experiments must not collect idle threads."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def stacks(self, request: Request) -> bool:
        """Whether ``request``'s group runs stacked; a reason not to is said once."""
        reason = why_not_stackable(request.model)
        if reason is None and request.kind == "train" and request.settings.optimizer not in STACKED_OPTIMIZERS:
            reason = f"optimizer {request.settings.optimizer!r} is not one the stacked step knows: one client at a time"
        if reason is not None:
            self._say_once(reason, reason)
            return False
        if request.device.type == "cpu" and request.kind == "train" and not self.stack_on_cpu:
            self._say_once("cpu", "this model trains faster one client at a time on a CPU (benchmarks/engines)")
            return False
        return True

    def chunks(self, requests: list[Request], longest: int) -> list[list[Request]]:
        """``requests`` cut into consecutive stacks: at least one per worker, each fitting the
        memory budget (:meth:`client_bytes`), all stacks together within it. The stacks' sizes
        differ by one at most: the workers get even shares, and no client is left over alone in a
        stack of its own (a one-group convolution runs another kernel, whose round-off differs:
        ``benchmarks/engines/stack_split.py``)."""
        first = requests[0]
        fits = max(1, int(self.memory_bytes // self.client_bytes(first, longest)))
        if first.kind == "evaluate" and first.device.type == "cpu":
            fits = min(fits, CPU_EVALUATION_STACK)
        size = max(1, min(fits, -(-len(requests) // self.workers)))
        count = -(-len(requests) // size)
        smaller, larger = divmod(len(requests), count)  # ``larger`` stacks of smaller + 1, the rest of smaller
        bounds = itertools.accumulate((smaller + (k < larger) for k in range(count)), initial=0)
        return [requests[start:end] for start, end in itertools.pairwise(bounds)]

    @staticmethod
    def client_bytes(request: Request, longest: int) -> int:
        """A rough but safe upper estimate of one client's memory in a stack of ``request``'s kind:
        parameters, optimizer state and activations; ``longest``: the stack's most samples a client."""
        parameter_bytes = sum(p.numel() * p.element_size() for p in request.model.parameters())
        samples = longest if request.kind == "evaluate" else request.settings.batch_size
        sample_bytes = request.x[:1].numel() * request.x.element_size()
        return 5 * parameter_bytes + samples * sample_bytes * 64 + longest * sample_bytes

    def _say_once(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            log.warning("batched engine: %s", text)


def execute(batch: list[Request], policy: BatchPolicy) -> None:
    """Run ``batch``: each group of like requests stacked (or one by one, see :class:`BatchPolicy`),
    the stacks and the lone requests spread over ``policy.workers`` threads."""
    groups: dict[tuple, list[Request]] = {}
    for request in batch:
        try:
            groups.setdefault(request.group_key(), []).append(request)
        except Exception as err:  # noqa: BLE001 - e.g. a term holding a dict (unhashable): the engine cannot group
            raise EngineError(f"batched engine: client {request.pid}'s {request.kind} request cannot be grouped with "
                              f"the round's others ({type(err).__name__}: {err}); an objective's terms must hold "
                              "hashable, comparable settings only (docs/how-to/add-algorithm.md)") from err
    _say_if_objectives_split(groups, policy)
    jobs: list[Callable[[], None]] = []
    for group in groups.values():
        requests = [r for r in group if policy.stacks(r)]  # each model's own hooks decide, not its group's
        alone = [r for r in group if r not in requests] + (requests if len(requests) == 1 else [])
        jobs.extend(functools.partial(_finish, request, request.run_alone) for request in alone)
        if len(requests) < 2:
            continue
        longest = max(len(r.y) for r in requests)
        for chunk in policy.chunks(requests, longest):
            jobs.append(functools.partial(_run_stacked, chunk))
    if policy.workers == 1 or len(jobs) == 1 or _work(batch) < WORK_FOR_WORKERS:
        for job in jobs:
            job()
        return
    for done in [policy.pool().submit(job) for job in jobs]:
        done.result()


def _say_if_objectives_split(groups: dict[tuple, list[Request]], policy: BatchPolicy) -> None:
    """Said once: requests that would stack but for their objectives, each in a group of its own (a
    term holding per-client values, or tensors, which compare by identity: each client's then differs)."""
    alike: dict[tuple, list[int]] = {}
    for key, group in groups.items():
        if group[0].kind == "train":
            alike.setdefault(key[:4], []).append(len(group))  # the key without the objective and its anchors' names
    if any(len(sizes) > 1 and 1 in sizes for sizes in alike.values()):
        policy._say_once("objectives", "the round's clients train on objectives that differ (a term holding per-client "
                         "values or tensors, which compare by identity): they run in as many groups, one client at a "
                         "time where a group holds one; a term should hold settings only, its values coming in as "
                         "anchors (docs/how-to/add-algorithm.md)")


def _work(batch: list[Request]) -> int:
    """A batch's size in parameter-samples (parameters x samples x epochs): a proxy for its compute."""
    total = 0
    for request in batch:
        parameters = sum(p.numel() for p in request.model.parameters())
        total += parameters * len(request.y) * (request.settings.epochs if request.settings else 1)
    return total


def _finish(request: Request, work: Callable[[], Any]) -> None:
    try:
        request.result = work()
    except Exception as err:  # noqa: BLE001 - this client's failure alone
        request.error = err
    request.done = True


def is_out_of_memory(err: BaseException) -> bool:
    """A CUDA or host allocation failure (torch raises the first as ``OutOfMemoryError``, the second
    as a RuntimeError from the CPU allocator)."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err)
    )


def _run_stacked(requests: list[Request]) -> None:
    """Run ``requests`` as one stack; out of memory, as two halves (a lone request runs as on the
    in-process engine); any other failure is the engine's (:class:`EngineError`) for every request."""
    first = requests[0]
    data = [ClientBatchData(r.x, r.y) for r in requests]
    # the stacked step may not change the models before it succeeds: a retry must start from them
    try:
        if first.kind == "train":
            generators = [r.generator for r in requests]
            states = [g.get_state() for g in generators]
            try:
                results = train_stacked([r.model for r in requests], data, first.settings, generators, first.device,
                                        first.objective, [r.anchors for r in requests])
            except BaseException:
                for generator, state in zip(generators, states):
                    generator.set_state(state)
                raise
        else:
            results = evaluate_stacked([r.model for r in requests], data, first.device)
    except Exception as err:  # noqa: BLE001 - sorted below: memory is retried, the rest stops the run
        if first.device.type == "cuda":
            torch.cuda.empty_cache()
        if is_out_of_memory(err):
            if len(requests) == 1:
                _finish(first, first.run_alone)
                return
            log.warning("batched engine: a stack of %d clients ran out of memory; splitting it in two", len(requests))
            half = len(requests) // 2
            _run_stacked(requests[:half])
            _run_stacked(requests[half:])
            return
        error = EngineError(f"batched engine: stacked {first.kind} of clients {[r.pid for r in requests]} failed: "
                            f"{type(err).__name__}: {err}")
        error.__cause__ = err
        for request in requests:
            request.error, request.done = error, True
        return
    for request, result in zip(requests, results):
        request.result, request.done = result, True


class BatchedCompute(LocalCompute):
    """A client's torch work on the batched engine: parked with the round's others (see the module)."""

    def __init__(self, rendezvous: Rendezvous, pid: int) -> None:
        self.rendezvous = rendezvous
        self.pid = pid

    def train(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: TrainSettings,
        generator: torch.Generator, device: torch.device, objective: Objective = PLAIN,
        anchors: Mapping[str, NDArrays] | None = None,
    ) -> float:
        return self.rendezvous.submit(
            Request("train", self.pid, model, x, y, device, settings, generator, objective, dict(anchors or {})))

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[float, float]:
        return self.rendezvous.submit(Request("evaluate", self.pid, model, x, y, device))


CPU_MEMORY_CAP = 4 * 1024**3  # on a CPU, larger stacks gain nothing measurable and crowd the machine


def default_memory_bytes(device: torch.device) -> int:
    """Half the memory free now: on the GPU for a CUDA device, else in RAM (``MemAvailable``, at
    most :data:`CPU_MEMORY_CAP`)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return min(int(line.split()[1]) * 1024 // 2, CPU_MEMORY_CAP)
    except OSError:
        pass
    return CPU_MEMORY_CAP // 2


def cpu_threads() -> int:
    """The cores this process may use: the batched engine's workers, one per core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
