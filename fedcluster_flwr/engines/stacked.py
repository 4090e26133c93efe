"""Many clients' local training and evaluation as one computation: their parameters stacked along a
client axis, one ``torch.func.vmap``-ed step (``functional_call`` + ``grad``) for all of them.

This module holds no algorithm: it executes what :func:`fedcluster_flwr.training.train` and
:func:`~fedcluster_flwr.training.evaluate` do for one client, for K clients of one architecture at
once, with the same arithmetic:

* **Data order.** Each client's mini-batches come from its own generator exactly as ``train`` draws
  them (one ``randperm`` per epoch, consecutive slices of ``batch_size``), so a client sees the
  batches it sees on the other engines.
* **Optimizers.** torch's SGD (momentum, dampening 0, weight decay) and Adam (bias correction,
  weight decay added to the gradient) in the formulas of their single-tensor implementations
  (``torch/optim/sgd.py``, ``adam.py``), applied to the stacked tensors; each client's optimizer
  state is kept stacked along the same axis.
* **Unequal clients.** At step s only the clients with more than s steps take part, grouped by the
  size of their s-th batch (a last, shorter batch); a client outside the step is *masked*: neither
  its parameters nor its optimizer state change. All clients taking part in a step have taken
  the same number of steps before it, so Adam's bias correction is one number per step.

Results agree with the per-client loop to float round-off (vmap's batched convolution sums in
another order), not bit for bit. No ``flwr`` import here: this is the engine's arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..training import TrainSettings

ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which training.make_optimizer uses
ADAM_EPS = 1e-8


def architecture_key(model: nn.Module) -> tuple:
    """Models with equal keys can be stacked: same class, same parameter names, shapes and dtypes."""
    return (type(model).__qualname__,) + tuple(
        (name, tuple(tensor.shape), tensor.dtype) for name, tensor in model.state_dict().items()
    )


def can_stack(model: nn.Module) -> bool:
    """Stacking needs every state entry to be a parameter: a buffer (e.g. BatchNorm statistics) would
    change in the forward pass, which the functional step does not carry back."""
    return len(list(model.buffers())) == 0


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


def _stack_parameters(models: Sequence[nn.Module], device: torch.device) -> dict[str, torch.Tensor]:
    per_model = [dict(m.named_parameters()) for m in models]
    return {name: torch.stack([p[name].detach() for p in per_model]).to(device) for name in per_model[0]}


def _write_back(models: Sequence[nn.Module], stacked: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, model in enumerate(models):
            for name, parameter in model.named_parameters():
                parameter.copy_(stacked[name][k].cpu())


class StackedOptimizer:
    """SGD or Adam over stacked parameters, in torch's single-tensor formulas (see the module's
    docstring); ``update`` steps the clients ``rows`` (all when None), leaving the others as they are."""

    def __init__(self, params: dict[str, torch.Tensor], settings: TrainSettings) -> None:
        self.settings = settings
        self.adam = settings.optimizer == "adam"
        self.state: dict[str, list[torch.Tensor]] = {}
        if self.adam:
            self.state = {n: [torch.zeros_like(p), torch.zeros_like(p)] for n, p in params.items()}
        elif settings.momentum != 0:
            self.state = {n: [torch.zeros_like(p)] for n, p in params.items()}

    def update(
        self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], step: int, rows: torch.Tensor | None
    ) -> None:
        """Step ``step`` (1-based; the same for every client taking part) of the clients ``rows``."""
        for name, grad in grads.items():
            param = params[name] if rows is None else params[name][rows]
            state = [s if rows is None else s[rows] for s in self.state.get(name, [])]
            if self.adam:
                self._adam(param, grad, state, step)
            else:
                self._sgd(param, grad, state, step)
            if rows is not None:  # the rows were gathered copies: put them back
                params[name].index_copy_(0, rows, param)
                for full, part in zip(self.state.get(name, []), state):
                    full.index_copy_(0, rows, part)

    def _sgd(self, param: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], step: int) -> None:
        s = self.settings
        if s.weight_decay != 0:
            grad = grad.add(param, alpha=s.weight_decay)
        if s.momentum != 0:
            (buf,) = state
            if step == 1:  # torch: the first buffer is a copy of the gradient
                buf.copy_(grad)
            else:
                buf.mul_(s.momentum).add_(grad)  # dampening 0
            grad = buf
        param.add_(grad, alpha=-s.lr)

    def _adam(self, param: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], step: int) -> None:
        s = self.settings
        beta1, beta2 = ADAM_BETAS
        exp_avg, exp_avg_sq = state
        if s.weight_decay != 0:
            grad = grad.add(param, alpha=s.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = s.lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(ADAM_EPS)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def train_stacked(
    models: Sequence[nn.Module],
    data: Sequence[ClientBatchData],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    device: torch.device,
) -> list[float]:
    """:func:`fedcluster_flwr.training.train` for every ``models[k]`` on ``data[k]`` with
    ``generators[k]``, all at once; the models are updated in place (they stay on the CPU) and each
    client's mean batch loss is returned, as ``train`` returns it."""
    template = models[0].to(device).train()
    params = _stack_parameters(models, device)
    optimizer = StackedOptimizer(params, settings)
    schedules = [batch_schedule(len(d.y), settings, g) for d, g in zip(data, generators)]
    offsets = np.cumsum([0] + [len(d.y) for d in data[:-1]])
    x_all = torch.cat([d.x for d in data]).to(device)
    y_all = torch.cat([d.y for d in data]).to(device)
    num_steps = max((len(s) for s in schedules), default=0)
    losses = torch.full((num_steps, len(models)), float("nan"), device=device)

    def loss_of(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(template, p, (xb,)), yb)

    step_all = vmap(grad_and_value(loss_of))
    for step in range(num_steps):
        taking_part: dict[int, list[int]] = {}  # batch size -> clients whose step-th batch has it
        for k, schedule in enumerate(schedules):
            if step < len(schedule):
                taking_part.setdefault(len(schedule[step]), []).append(k)
        for clients in taking_part.values():
            index = torch.stack([schedules[k][step] + int(offsets[k]) for k in clients]).to(device)
            everyone = len(clients) == len(models)
            rows = None if everyone else torch.tensor(clients, device=device)
            p = params if everyone else {n: v[rows] for n, v in params.items()}
            grads, loss = step_all(p, x_all[index], y_all[index])
            optimizer.update(params, grads, step + 1, rows)
            losses[step, clients if not everyone else slice(None)] = loss.detach()
    template.cpu()
    _write_back(models, params)
    table = losses.cpu()
    return [
        float(np.mean(table[: len(schedules[k]), k].tolist())) if schedules[k] else float("nan")
        for k in range(len(models))
    ]


@torch.no_grad()
def evaluate_stacked(
    models: Sequence[nn.Module], data: Sequence[ClientBatchData], device: torch.device
) -> list[tuple[float, float]]:
    """:func:`fedcluster_flwr.training.evaluate` (mean cross-entropy, accuracy) for every
    ``models[k]`` on ``data[k]``, in one forward pass over the clients' samples padded to the
    largest client's count (padding counts in neither the loss nor the accuracy)."""
    template = models[0].to(device).eval()
    params = _stack_parameters(models, device)
    counts = [len(d.y) for d in data]
    longest = max(counts, default=0)
    if longest == 0:
        template.cpu()
        return [(0.0, 0.0)] * len(models)
    x = torch.zeros((len(models), longest, *data[0].x.shape[1:]), dtype=data[0].x.dtype)
    y = torch.zeros((len(models), longest), dtype=torch.long)
    for k, d in enumerate(data):
        x[k, : counts[k]], y[k, : counts[k]] = d.x, d.y
    x, y = x.to(device), y.to(device)
    valid = (torch.arange(longest) < torch.tensor(counts)[:, None]).to(device)
    logits = vmap(lambda p, xb: functional_call(template, p, (xb,)))(params, x)
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(models), longest)
    loss_sums = (losses * valid).sum(dim=1).double().cpu().tolist()
    correct = ((logits.argmax(dim=2) == y) & valid).sum(dim=1).cpu().tolist()
    template.cpu()
    return [(loss_sums[k] / max(n, 1), correct[k] / max(n, 1)) for k, n in enumerate(counts)]
