"""Many clients' local training and evaluation as one computation: their parameters stacked along a
client axis, one step for all of them.

This module holds no algorithm: it executes what :func:`fedcluster_flwr.training.train` and
:func:`~fedcluster_flwr.training.evaluate` do for one client, for K clients of one architecture at
once, with the same arithmetic:

* **The step.** The K models' forward is the architecture's own ``forward_stacked`` where it has
  one (:mod:`fedcluster_flwr.models`: grouped convolutions in channels-last memory, batched matrix
  products), else ``torch.func.vmap`` of ``functional_call``. Each client's loss is its batch's mean
  cross-entropy plus its objective's terms (:class:`~fedcluster_flwr.training.Objective`, the same
  pure functions ``train`` adds, vmapped over the clients); the K losses are summed and one backward
  pass gives every client its own gradient (the clients share no parameter).
* **Data order.** Each client's mini-batches come from its own generator exactly as ``train`` draws
  them (one ``randperm`` per epoch, consecutive slices of ``batch_size``), so a client sees the
  batches it sees on the other engines.
* **Optimizers.** torch's own Adam (``torch.optim.adam.adam``, fused where the device has the
  kernel, else for-each) and SGD in the formula of ``torch.optim.SGD`` (momentum, dampening 0,
  weight decay) as for-each operations, applied to the stacked tensors; each client's optimizer
  state is kept stacked along the same axis. Gradients are made contiguous
  first: the fused kernels assume a gradient laid out as its parameter (a channels-last gradient of
  a contiguous weight gave wrong values).
* **Unequal clients.** At step s only the clients with more than s steps take part, grouped by the
  size of their s-th batch (a last, shorter batch); a client outside the step is *masked*: neither
  its parameters nor its optimizer state change. All clients taking part in a step have taken
  the same number of steps before it, so Adam's bias correction is one number per step.
* **Device-clean.** The clients' data, the parameters, the optimizer state and every step's batch
  indices are on the device before the first step (the indices are drawn on the CPU, for the same
  batches everywhere, and copied once); the loop reads nothing back until its end, so a GPU never
  waits for the host inside it (tests run it on the ``meta`` device, where any host tensor would
  fail, and count the host-to-device copies).

Results agree with the per-client loop to float round-off (the grouped convolution sums in another
order), not bit for bit. No ``flwr`` import here: this is the engine's arithmetic.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.optim.adam import adam as adam_step
from torch.optim.sgd import sgd as sgd_step

from ..training import ADAM_BETAS, ADAM_EPS, PLAIN, START, Objective, TrainSettings
from ..types import NDArrays

StackedParameters = dict[str, torch.Tensor]  # name -> [K, *shape]
StackedForward = Callable[[StackedParameters, torch.Tensor], torch.Tensor]  # [K, B, ...] -> [K, B, classes]
STACKED_OPTIMIZERS = ("sgd", "adam")
FUSED_DEVICES = ("cpu", "cuda", "meta")  # devices with torch's fused Adam/SGD kernels


def architecture_key(model: nn.Module) -> tuple:
    """Models with equal keys can be stacked: same class, same parameter names, shapes and dtypes."""
    return (type(model).__qualname__,) + tuple(
        (name, tuple(tensor.shape), tensor.dtype) for name, tensor in model.state_dict().items()
    )


def why_not_stackable(model: nn.Module) -> str | None:
    """Why ``model`` cannot train stacked (None if it can): a buffer (e.g. BatchNorm statistics)
    changes in the forward pass, which the functional step does not carry back; a hook on a module
    or a parameter would be skipped by a step that never calls the module (a hook must be honoured,
    so such a model trains one client at a time)."""
    if any(True for _ in model.buffers()):
        return "models with buffers (e.g. BatchNorm) train one client at a time"
    for name, module in model.named_modules():
        hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                 getattr(module, "_backward_pre_hooks", {}))
        if any(hooks):
            return f"module {name or type(model).__name__!r} has a hook: its model trains one client at a time"
    for name, parameter in model.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            return f"parameter {name!r} has a hook: its model trains one client at a time"
    global_hooks = nn.modules.module
    if any((global_hooks._global_forward_hooks, global_hooks._global_forward_pre_hooks,
            global_hooks._global_backward_hooks, getattr(global_hooks, "_global_backward_pre_hooks", {}))):
        return "a global module hook is registered: models train one client at a time"
    return None


def batch_schedule(num_samples: int, settings: TrainSettings, generator: torch.Generator) -> list[torch.Tensor]:
    """The index batches :func:`fedcluster_flwr.training.train` draws from ``generator``, in order."""
    batches = []
    for _ in range(settings.epochs):
        order = torch.randperm(num_samples, generator=generator)
        batches.extend(order[start : start + settings.batch_size] for start in range(0, num_samples, settings.batch_size))
    return batches


@dataclass
class ClientBatchData:
    """One client's samples, as ``train``/``evaluate`` take them."""

    x: torch.Tensor
    y: torch.Tensor


class ResidentData:
    """Device copies of the clients' data tensors, made once and kept while the tensors live and the
    copies fit ``limit_bytes``: a client's samples cross to an accelerator once per run, not once
    per request. On the CPU the tensors are used as they are."""

    def __init__(self, limit_bytes: int = 8 * 1024**3) -> None:
        self.limit_bytes = limit_bytes
        self._copies: dict[tuple[int, torch.device], tuple[weakref.ref, torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()  # the batched engine's workers share it

    def on(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        key = (id(tensor), device)
        with self._lock:
            found = self._copies.get(key)
            if found is not None and found[0]() is tensor:
                return found[1]
            copy = tensor.to(device)
            size = copy.numel() * copy.element_size()
            if self._bytes + size <= self.limit_bytes:
                self._copies[key] = (weakref.ref(tensor, lambda _, key=key: self._forget(key)), copy)
                self._bytes += size
            return copy

    def _forget(self, key: tuple[int, torch.device]) -> None:
        with self._lock:
            found = self._copies.pop(key, None)
            if found is not None:
                self._bytes -= found[1].numel() * found[1].element_size()


RESIDENT = ResidentData()


def stacked_forward(template: nn.Module) -> StackedForward:
    """The K-model forward of ``template``'s architecture: its ``forward_stacked``, else vmap."""
    own = getattr(template, "forward_stacked", None)
    if own is not None:
        return own
    per_model = vmap(lambda p, xb: functional_call(template, p, (xb,)))
    return per_model


def stack_parameters(models: Sequence[nn.Module], device: torch.device) -> StackedParameters:
    """Each parameter of the K models stacked along a new first axis, then moved to ``device`` once
    (stacked where the models are: a model moved first would mix devices in the stack)."""
    per_model = [dict(m.named_parameters()) for m in models]
    return {name: torch.stack([p[name].detach() for p in per_model]).to(device) for name in per_model[0]}


def write_back(models: Sequence[nn.Module], stacked: StackedParameters) -> None:
    """Row k of every stacked parameter into ``models[k]`` (which stay where they are)."""
    host = {name: tensor.cpu() for name, tensor in stacked.items()}  # one copy per name, not per model
    with torch.no_grad():
        for k, model in enumerate(models):
            for name, parameter in model.named_parameters():
                parameter.copy_(host[name][k])


class StackedOptimizer:
    """torch's SGD or Adam over stacked parameters (see the module's docstring); ``update`` steps the
    clients ``rows`` (all when None), leaving the others as they are."""

    def __init__(self, params: StackedParameters, settings: TrainSettings, names: Sequence[str]) -> None:
        if settings.optimizer not in STACKED_OPTIMIZERS:
            raise ValueError(f"the stacked trainer knows the optimizers {STACKED_OPTIMIZERS}, not {settings.optimizer!r}")
        self.settings = settings
        self.names = list(names)
        self.adam = settings.optimizer == "adam"
        device = next(iter(params.values())).device
        self.fused = device.type in FUSED_DEVICES
        self.state: dict[str, list[torch.Tensor]] = {}
        if self.adam:
            self.state = {n: [torch.zeros_like(params[n]), torch.zeros_like(params[n])] for n in self.names}
        elif settings.momentum != 0:
            self.state = {n: [torch.zeros_like(params[n])] for n in self.names}

    def update(self, params: StackedParameters, grads: Sequence[torch.Tensor], steps_before: torch.Tensor,
               rows: torch.Tensor | None) -> None:
        """One step of the clients ``rows`` (all when None); ``steps_before`` (a device scalar) is
        how many steps each of them has taken (the same for all)."""
        gather = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        current = [gather(params[n]) for n in self.names]
        state = {n: [gather(s) for s in self.state.get(n, [])] for n in self.names}
        grads = [g.contiguous() for g in grads]  # the fused kernels assume a parameter's own layout
        s = self.settings
        with torch.no_grad():
            if self.adam:
                beta1, beta2 = ADAM_BETAS
                adam_step(current, grads, [state[n][0] for n in self.names], [state[n][1] for n in self.names], [],
                          [steps_before.clone() for _ in self.names], fused=self.fused, foreach=None if self.fused else True,
                          amsgrad=False, beta1=beta1, beta2=beta2, lr=s.lr, weight_decay=s.weight_decay, eps=ADAM_EPS,
                          maximize=False)
            else:
                buffers = [state[n][0] for n in self.names] if s.momentum != 0 else [None] * len(self.names)
                self._sgd(current, grads, buffers)
            if rows is not None:  # the rows were gathered copies: put them back
                for n, part in zip(self.names, current):
                    params[n].index_copy_(0, rows, part)
                    for full, part_state in zip(self.state.get(n, []), state[n]):
                        full.index_copy_(0, rows, part_state)

    def _sgd(self, params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list) -> None:
        """torch.optim.SGD's step (dampening 0, no Nesterov), torch's own function: the learning
        rate, weight decay and momentum applied as every unstacked training applies them. Its first
        momentum buffer is a copy of the gradient; here the buffers start at zero, and zero times
        ``momentum`` plus the gradient is that copy in every bit."""
        s = self.settings
        sgd_step(params, grads, buffers, foreach=True, weight_decay=s.weight_decay, momentum=s.momentum, lr=s.lr,
                 dampening=0.0, nesterov=False, maximize=False)


def _schedule_on_device(
    schedules: Sequence[Sequence[torch.Tensor]], offsets: Sequence[int], device: torch.device
) -> list[list[tuple[torch.Tensor, torch.Tensor | None, list[int]]]]:
    """For every step, the groups of clients taking part with equal batch sizes: ``(index [k, b]
    into the concatenated data, rows [k] or None for everyone, the clients as ints)``, every tensor
    built on the CPU and copied to ``device`` in one transfer."""
    num_clients = len(schedules)
    plan: list[list[tuple[torch.Tensor, list[int] | None, list[int]]]] = []
    pieces: list[torch.Tensor] = []
    for step in range(max((len(s) for s in schedules), default=0)):
        groups: dict[int, list[int]] = {}
        for k, schedule in enumerate(schedules):
            if step < len(schedule):
                groups.setdefault(len(schedule[step]), []).append(k)
        step_plan = []
        for clients in groups.values():
            pieces.append(torch.stack([schedules[k][step] + int(offsets[k]) for k in clients]).flatten())
            everyone = len(clients) == num_clients
            if not everyone:
                pieces.append(torch.tensor(clients, dtype=torch.long))
            step_plan.append((len(clients), everyone, clients))
        plan.append(step_plan)
    flat = torch.cat(pieces).to(device) if pieces else torch.zeros(0, dtype=torch.long, device=device)
    out, at = [], 0
    for step_plan in plan:
        groups_out = []
        for count, everyone, clients in step_plan:
            size = count * len(schedules[clients[0]][len(out)])
            index = flat[at : at + size].view(count, -1)
            at += size
            rows = None
            if not everyone:
                rows = flat[at : at + count]
                at += count
            groups_out.append((index, rows, clients))
        out.append(groups_out)
    return out


def stack_anchors(template: nn.Module, anchors: Sequence[Mapping[str, NDArrays]], device: torch.device) -> dict[str, StackedParameters]:
    """Each client's named anchor models (arrays in ``state_dict`` order) stacked along the client
    axis, parameters only, in the model's dtypes, moved to ``device`` once, before the step loop."""
    if not anchors:
        return {}
    parameters = dict(template.named_parameters())
    keys = [name for name in template.state_dict() if name in parameters]
    order = {name: k for k, name in enumerate(template.state_dict())}
    return {
        anchor: {name: torch.stack([torch.as_tensor(client[anchor][order[name]]) for client in anchors])
                 .to(device=device, dtype=parameters[name].dtype) for name in keys}
        for anchor in anchors[0]
    }


def train_steps(
    template: nn.Module,
    params: StackedParameters,
    data: Sequence[ClientBatchData],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    device: torch.device,
    objective: Objective = PLAIN,
    anchors: Sequence[Mapping[str, NDArrays]] = (),
) -> torch.Tensor:
    """Train the stacked ``params`` in place on ``device``; return each client's mean batch loss as a
    device tensor ``[K]`` (NaN for a client without a step). Nothing is read back to the host.
    ``anchors``: each client's named anchor models (the same names for every client)."""
    forward = stacked_forward(template)
    names = list(params)
    trainable = objective.trainable(names)
    schedules = [batch_schedule(len(d.y), settings, g) for d, g in zip(data, generators)]
    offsets, total = [], 0
    for d in data:
        offsets.append(total)
        total += len(d.y)
    plan = _schedule_on_device(schedules, offsets, device)
    x_all = torch.cat([RESIDENT.on(d.x, device) for d in data])
    y_all = torch.cat([RESIDENT.on(d.y, device) for d in data])
    num_clients = len(data)
    loss_sums = torch.zeros(num_clients, device=device)
    step_counts = torch.tensor([float(len(s)) for s in schedules]).to(device)
    steps_before = torch.arange(len(plan), dtype=torch.float32).to(device)
    optimizer = StackedOptimizer(params, settings, trainable)
    constants = {START: {n: params[n].clone() for n in names}} | stack_anchors(template, anchors, device) \
        if objective.terms else None
    penalty = vmap(objective.penalty) if objective.terms else None
    with host_sync_check(device):
        _run_plan(forward, params, names, trainable, plan, x_all, y_all, optimizer, steps_before, loss_sums, constants,
                  penalty)
    return loss_sums / step_counts


SYNC_DEBUG_VARIABLE = "FEDCLUSTER_SYNC_DEBUG"  # "error" or "warn": torch.cuda.set_sync_debug_mode in the step loop


@contextlib.contextmanager
def host_sync_check(device: torch.device) -> Iterator[None]:
    """On a GPU, with ``$FEDCLUSTER_SYNC_DEBUG`` set (``error`` or ``warn``; the device script sets
    it), make torch raise or warn on any operation that waits for the GPU inside the step loop."""
    mode = os.environ.get(SYNC_DEBUG_VARIABLE)
    if device.type != "cuda" or not mode:
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _run_plan(forward, params, names, trainable, plan, x_all, y_all, optimizer, steps_before, loss_sums, constants,
              penalty):
    """The step loop of :func:`train_steps` (nothing in it reads the device back)."""
    for step, groups in enumerate(plan):
        for index, rows, _ in groups:
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            current = {n: pick(params[n]).requires_grad_(n in trainable) for n in names}
            logits = forward(current, x_all[index])
            count, batch = index.shape
            losses = nn.functional.cross_entropy(
                logits.reshape(count * batch, -1), y_all[index].reshape(-1), reduction="none"
            ).view(count, batch).mean(dim=1)
            if penalty is not None:
                anchors = {a: {n: pick(t) for n, t in anchor.items()} for a, anchor in constants.items()}
                losses = losses + penalty(current, anchors)
            grads = torch.autograd.grad(losses.sum(), [current[n] for n in trainable])
            optimizer.update(params, grads, steps_before[step], rows)
            if rows is None:
                loss_sums += losses.detach()
            else:
                loss_sums.index_add_(0, rows, losses.detach())


def train_stacked(
    models: Sequence[nn.Module],
    data: Sequence[ClientBatchData],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    device: torch.device,
    objective: Objective = PLAIN,
    anchors: Sequence[Mapping[str, NDArrays]] = (),
) -> list[float]:
    """:func:`fedcluster_flwr.training.train` for every ``models[k]`` on ``data[k]`` with
    ``generators[k]`` (and ``anchors[k]``), all at once; the models are updated in place (they stay
    where they are) and each client's mean batch loss is returned, as ``train`` returns it."""
    params = stack_parameters(models, device)
    mean_losses = train_steps(models[0], params, data, settings, generators, device, objective, anchors)
    write_back(models, params)
    return [float(v) for v in mean_losses.cpu().tolist()]


EVALUATION_SAMPLES = 4096  # samples (over all clients of a stack) per slice of an evaluation: fixes each client's slices
# On a CPU, about this many samples per forward pass: a slice's clients go through in groups, so the
# activations stay cache-sized (benchmarks/engines/evaluation.py). A client's numbers keep their bits
# (tests/test_engines.py): its samples are cut into the same slices and summed in the same order.
CPU_PASS_SAMPLES = 128


def client_groups(num_clients: int, step: int, device: torch.device) -> list[slice]:
    """The consecutive groups of clients that go through a pass together: all of them, or on a CPU
    ``num_clients // g`` nearly equal groups of at least ``g = max(2, CPU_PASS_SAMPLES // step)``
    clients. Never a group of one among several: one model's convolution (``groups=1``) takes
    another kernel than a stack's, whose bits differ under the portable numerics."""
    if device.type != "cpu":
        return [slice(0, num_clients)]
    count = max(1, num_clients // max(2, CPU_PASS_SAMPLES // step))
    bounds = [round(i * num_clients / count) for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def evaluation_sums(
    template: nn.Module, params: StackedParameters, data: Sequence[ClientBatchData], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's summed cross-entropy (float64) and number of correct predictions on its own
    samples, as device tensors ``[K]``: the clients' samples padded to the largest count, in slices
    of at most :data:`EVALUATION_SAMPLES` samples over all clients (padding counts in neither), on a
    CPU a slice's clients in groups of about :data:`CPU_PASS_SAMPLES` samples per pass
    (:func:`client_groups`). A pass never cuts a client's slice: a smaller batch changes the
    kernels' blocking, hence the bits, of a client's logits; fewer clients per pass does not."""
    forward = stacked_forward(template)
    counts = [len(d.y) for d in data]
    longest = max(counts, default=0)
    num_clients = len(data)
    loss_sums = torch.zeros(num_clients, dtype=torch.float64, device=device)
    correct = torch.zeros(num_clients, dtype=torch.long, device=device)
    if longest == 0:
        return loss_sums, correct
    x = torch.zeros((num_clients, longest, *data[0].x.shape[1:]), dtype=data[0].x.dtype, device=device)
    y = torch.zeros((num_clients, longest), dtype=torch.long, device=device)
    for k, d in enumerate(data):
        x[k, : counts[k]], y[k, : counts[k]] = RESIDENT.on(d.x, device), RESIDENT.on(d.y, device)
    valid = (torch.arange(longest) < torch.tensor(counts)[:, None]).to(device)
    step = max(1, EVALUATION_SAMPLES // num_clients)
    for clients in client_groups(num_clients, step, device):
        group_params = {name: tensor[clients] for name, tensor in params.items()}
        for start in range(0, longest, step):
            xb, yb, vb = x[clients, start : start + step], y[clients, start : start + step], valid[clients, start : start + step]
            logits = forward(group_params, xb)
            losses = nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none").view(yb.shape)
            loss_sums[clients] += (losses.double() * vb).sum(dim=1)
            correct[clients] += ((logits.argmax(dim=2) == yb) & vb).sum(dim=1)
    return loss_sums, correct


def evaluate_stacked(
    models: Sequence[nn.Module], data: Sequence[ClientBatchData], device: torch.device
) -> list[tuple[float, float]]:
    """:func:`fedcluster_flwr.training.evaluate` (mean cross-entropy, accuracy) for every
    ``models[k]`` on ``data[k]``, all at once."""
    loss_sums, correct = evaluation_sums(models[0], stack_parameters(models, device), data, device)
    counts = [len(d.y) for d in data]
    losses, hits = loss_sums.cpu().tolist(), correct.cpu().tolist()
    return [(losses[k] / max(n, 1), hits[k] / max(n, 1)) for k, n in enumerate(counts)]
