"""Torch loops run on a client: local SGD/Adam, evaluation and per-model training loss.

Data arrive as in-memory tensors (a client holds a few hundred samples), so batches
are sliced from a seeded permutation instead of going through a DataLoader.

What local training minimises is each mini-batch's mean cross-entropy plus the terms of an
:class:`Objective` (FedProx's proximal term, Ditto's pull towards the global model, a regulariser),
with the parameters the objective freezes held fixed. A term is a pure function of the client's
parameters and of *anchors*: named constant models, the parameters the training started from
(``start``) and any the handler names (``global``: the model the server sent, a cluster model, ...).
Every engine applies it through this one definition (``train`` here, the batched engine's stacked
step through ``torch.func.vmap`` of the same function), so a method that changes local training
states its objective and never copies a training loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from .declarations.roles import RUN_CONFIG
from .declarations.options import DeclaredOptions
from .declarations.schema import Interval, at_least, option
from .types import NDArrays


CUBLAS_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")  # the settings cuBLAS is deterministic with; first: ours


def cublas_workspace_problem() -> str | None:
    """Why the environment's ``CUBLAS_WORKSPACE_CONFIG`` rules out deterministic cuBLAS, if it does."""
    configured = os.environ.get("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACES[0])
    if configured in CUBLAS_DETERMINISTIC_WORKSPACES:
        return None
    return (
        f"deterministic CUDA kernels need CUBLAS_WORKSPACE_CONFIG={' or '.join(CUBLAS_DETERMINISTIC_WORKSPACES)}; "
        f"the environment sets {configured!r}"
    )


def use_deterministic_kernels() -> None:
    """Make CUDA training a function of the seed (as CPU training already is), for this process.

    Forces cuDNN's deterministic convolution algorithms (no benchmark-time choice between
    algorithms), a fixed cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS first
    starts, so this must run before the process's first CUDA matrix product) and
    ``torch.use_deterministic_algorithms``, which raises on an operation that has no
    deterministic CUDA kernel instead of silently running a nondeterministic one.
    """
    if problem := cublas_workspace_problem():
        raise ValueError(problem)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACES[0])
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def get_weights(model: nn.Module) -> NDArrays:
    """The model's state as float32 numpy arrays (copies, safe to send)."""
    return [t.detach().cpu().numpy().copy() for t in model.state_dict().values()]


def set_weights(model: nn.Module, weights: NDArrays, assign: bool = False) -> None:
    """Load ``weights`` (in :func:`get_weights` order) into ``model``; shapes must match.

    ``assign``: the model's tensors become copies of ``weights`` instead of being written into,
    as a model built on the meta device needs.
    """
    state = model.state_dict()
    if len(weights) != len(state):
        raise ValueError(f"expected {len(state)} arrays, got {len(weights)}")
    for (name, current), array in zip(state.items(), weights):
        if tuple(current.shape) != tuple(array.shape):
            raise ValueError(f"{name}: expected shape {tuple(current.shape)}, got {array.shape}")
    if assign:  # copies in the model's own dtypes (a float64 array must not turn a layer float64)
        tensors = {name: torch.tensor(array, dtype=current.dtype) for (name, current), array in zip(state.items(), weights)}
    else:
        tensors = {name: torch.as_tensor(array) for name, array in zip(state.keys(), weights)}
    model.load_state_dict(tensors, strict=True, assign=assign)


ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which make_optimizer uses
ADAM_EPS = 1e-8

Parameters = Mapping[str, torch.Tensor]  # parameter name -> tensor (one client's, or K clients' stacked)
Anchors = Mapping[str, Parameters]  # anchor name -> constant parameters by name (START: the training's own start)
Term = Callable[[Parameters, Parameters], torch.Tensor]  # (parameters, its anchor) -> a scalar added to the loss
START = "start"  # the anchor every training has: its parameters' values when it began


def anchor_of(term: Term) -> str:
    """The anchor a term is computed against: its ``anchor`` attribute, else :data:`START`."""
    return getattr(term, "anchor", START)


@dataclass(frozen=True)
class Objective:
    """What local training minimises beyond each mini-batch's mean cross-entropy.

    ``terms``: functions ``(parameters, anchor) -> scalar`` added to every mini-batch's loss, where
    ``parameters`` are the client's parameters by name and ``anchor`` a constant model, parameters by
    name: the one the term's ``anchor`` attribute names, by default :data:`START` (the parameters'
    values when this training began), else one the handler passes to the training (e.g.
    ``anchors={"global": the model the server sent}``, for a term with ``anchor = "global"``). They must be pure torch
    functions of these tensors (no ``.item()``, no Python branch on a value, no module hook): the
    batched engine vmaps them over the clients. A term holds settings only (numbers, strings, an
    anchor's name), never a model's values: the values come in ``anchors``, per client. Frozen
    dataclasses of numbers make good terms: clients with equal objectives are stacked together, and a
    term that cannot be compared or hashed stops a batched run as the engine's error.
    ``frozen``: parameter-name prefixes (whole dotted components, as ``shared_layers``) whose
    parameters do not change: they get no gradient and no optimizer step.
    """

    terms: tuple[Term, ...] = ()
    frozen: tuple[str, ...] = ()

    def penalty(self, parameters: Parameters, anchors: Anchors) -> torch.Tensor:
        """The sum of the terms (one client's parameters; vmapped over a stack by the batched engine)."""
        total = self.terms[0](parameters, anchors[anchor_of(self.terms[0])])
        for term in self.terms[1:]:
            total = total + term(parameters, anchors[anchor_of(term)])
        return total

    def is_frozen(self, name: str) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in self.frozen)

    def trainable(self, names: Sequence[str]) -> list[str]:
        """The names of ``names`` that training changes; a frozen prefix that names none of them
        is an error (a misspelt layer would otherwise train everything)."""
        for prefix in self.frozen:
            if not any(name == prefix or name.startswith(prefix + ".") for name in names):
                raise ValueError(f"frozen layer {prefix!r} names no parameter of the model; its parameters: {', '.join(names)}")
        return [name for name in names if not self.is_frozen(name)]


PLAIN = Objective()  # cross-entropy alone, every parameter trained


# The most a factor of the optimizer's update (client.lr, client.weight_decay) may be. torch turns it
# into the float32 parameters' type and refuses one float32 cannot hold (3.4e38): every fit then
# fails with "value cannot be converted to type float without overflow" and the run goes on at
# chance, naming nothing. Adam's first step is lr / (1 - β1) = 10·lr, so 1e37 (with room for
# round-off) is the largest every optimizer takes; an lr anywhere near it diverges in one step anyway.
OPTIMIZER_FACTOR_MAX = 1e37
FLOAT32_STEP = "at most 1e37: Adam's first step, 10·lr, must be a float32 number, as the parameters are"
LEARNING_RATE = Interval(0, OPTIMIZER_FACTOR_MAX, closed="right")  # client.lr, and any lr a task trains with


@dataclass(frozen=True)
class TrainSettings(DeclaredOptions):
    """How a client trains: the config's ``client`` keys (less ``device``), declared here once. Every
    engine's training reads this type; a task that trains with other epochs or another learning rate
    (Ditto's personal model) replaces those fields, checked against the same declarations."""

    epochs: int = option(1, at_least(1), roles=(RUN_CONFIG,))
    batch_size: int = option(32, at_least(1), roles=(RUN_CONFIG,))
    lr: float = option(0.05, LEARNING_RATE, note=FLOAT32_STEP, roles=(RUN_CONFIG,))
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = option(0.0, Interval(0, 1, closed="left"))
    weight_decay: float = option(0.0, Interval(0, OPTIMIZER_FACTOR_MAX),
                                 note="at most 1e37: it multiplies the float32 parameters in every step")


def make_optimizer(model: nn.Module, settings: TrainSettings, objective: Objective = PLAIN) -> torch.optim.Optimizer:
    parameters = [p for name, p in model.named_parameters() if not objective.is_frozen(name)]
    if settings.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=settings.lr, weight_decay=settings.weight_decay)
    return torch.optim.SGD(parameters, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay)


def anchor_parameters(model: nn.Module, arrays: NDArrays, device: torch.device) -> dict[str, torch.Tensor]:
    """A model's arrays (``state_dict`` order) as constant parameters by name, on ``device``, in the
    model's own dtypes (its buffers left out: no term reads them)."""
    parameters = dict(model.named_parameters())
    return {name: torch.tensor(array, dtype=parameters[name].dtype, device=device)
            for name, array in zip(model.state_dict(), arrays) if name in parameters}


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    settings: TrainSettings,
    generator: torch.Generator,
    device: torch.device,
    objective: Objective = PLAIN,
    anchors: Mapping[str, NDArrays] | None = None,
) -> float:
    """Run ``settings.epochs`` epochs of minibatch training on ``objective``; return the mean
    batch loss (the terms included). ``anchors``: the named models the objective's terms may pull
    towards besides :data:`START` (arrays in ``state_dict`` order).

    The data go to ``device`` once and the batch losses are read back once at the end: on a
    GPU a host copy or ``.item()`` per step would wait for every step's kernels, and this
    model at batch 10 is bound by kernel launches. The batch order comes from ``generator``
    on the CPU, so the same seed gives the same batches on every device.
    """
    model.to(device).train()
    trainable = set(objective.trainable([name for name, _ in model.named_parameters()]))
    optimizer = make_optimizer(model, settings, objective)
    frozen = [p for name, p in model.named_parameters() if name not in trainable]
    for parameter in frozen:
        parameter.requires_grad_(False)
    parameters = dict(model.named_parameters())
    constants: dict[str, Parameters] = {}
    if objective.terms:
        constants = {START: {name: p.detach().clone() for name, p in parameters.items()}}
        constants |= {name: anchor_parameters(model, arrays, device) for name, arrays in (anchors or {}).items()}
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(settings.epochs):
        order = torch.randperm(len(y), generator=generator).to(device)
        for first in range(0, len(y), settings.batch_size):
            batch = order[first : first + settings.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            if objective.terms:
                loss = loss + objective.penalty(parameters, constants)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    for parameter in frozen:
        parameter.requires_grad_(True)
    model.cpu()
    return float(np.mean(torch.stack(losses).cpu().tolist())) if losses else float("nan")


class LocalCompute:
    """A client's torch work, run at once and alone (the Ray and in-process engines). The batched
    engine gives its clients another object with these two methods, which runs the work of a round's
    clients together (:class:`fedcluster_flwr.engines.batched.BatchedCompute`)."""

    def train(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: TrainSettings,
        generator: torch.Generator, device: torch.device, objective: Objective = PLAIN,
        anchors: Mapping[str, NDArrays] | None = None,
    ) -> float:
        return train(model, x, y, settings, generator, device, objective, anchors)

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[float, float]:
        return evaluate(model, x, y, device)


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1024
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` (in eval mode) on ``(x, y)``."""
    model.to(device).eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        logits = model(xb)
        loss_sum += nn.functional.cross_entropy(logits, yb, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == yb).sum().item())
    model.cpu()
    count = max(len(y), 1)
    return loss_sum / count, correct / count


def selection_forward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str, device: torch.device, keep_graph: bool
) -> torch.Tensor:
    """Loss of ``model`` (eval mode) on ``(x, y)`` with ``reduction`` ("mean" or "sum"); with
    ``keep_graph`` its autograd graph is kept, so gradients can be taken without a second pass."""
    model.to(device).eval()
    with torch.set_grad_enabled(keep_graph):
        return nn.functional.cross_entropy(model(x.to(device)), y.to(device), reduction=reduction)


def parameter_gradients(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """d loss / d parameter for every parameter, in ``state_dict`` order (buffers have none)."""
    parameters = dict(model.named_parameters())
    return list(torch.autograd.grad(loss, [parameters[n] for n in model.state_dict() if n in parameters]))


def descent_similarity(model: nn.Module, gradients: list[torch.Tensor], direction: NDArrays) -> float:
    """S = cos(-grad L, direction) over the model's parameters; ``direction`` holds arrays in
    ``state_dict`` order (its buffers are left out).

    ``-grad L``, not ``grad L``: a cluster's update w^t - w^{t-1} is a descent step, so the
    data that produced it has a *negative* gradient pointing the same way. S is 0, not NaN,
    when the direction or the gradient is zero (a cluster not updated last round).
    """
    parameters = dict(model.named_parameters())
    names = list(model.state_dict())
    descent = -torch.cat([g.detach().flatten().double().cpu() for g in gradients])
    step = torch.cat([torch.as_tensor(a).flatten().double() for n, a in zip(names, direction) if n in parameters])
    norms = descent.norm() * step.norm()
    return float(descent @ step / norms) if norms > 0 else 0.0


def selection_score_inputs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    reduction: str,
    device: torch.device,
    direction: NDArrays | None = None,
) -> tuple[float, float]:
    """Loss of ``model`` on ``(x, y)`` and, given a ``direction``, S (:func:`descent_similarity`; NaN without)."""
    loss = selection_forward(model, x, y, reduction, device, keep_graph=direction is not None)
    similarity = float("nan")
    if direction is not None:
        similarity = descent_similarity(model, parameter_gradients(model, loss), direction)
    model.cpu()
    return float(loss.detach()), similarity


@torch.no_grad()
def gradient_step(model: nn.Module, gradients: list[torch.Tensor], settings: TrainSettings) -> None:
    """One step of the client's optimizer (:func:`make_optimizer`, so ``settings.lr`` is applied
    where every unstacked training applies it) on ``gradients`` (``state_dict`` order of the
    parameters), in place: with plain SGD, w <- w - lr * grad."""
    parameters = dict(model.named_parameters())
    for name, gradient in zip([n for n in model.state_dict() if n in parameters], gradients):
        parameters[name].grad = gradient
    make_optimizer(model, settings).step()
    model.zero_grad(set_to_none=True)
