"""Which of these models is mine? ``train_select`` and ``select``: IFCA's cluster estimate, Lin et
al.'s gradloss, FL+HC's placement of a client that missed the clustering round.

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``train_select``   ``models`` (K), ``directions``       ``model`` (the chosen one,          ``selected`` < K, ``loss_k``
                   (K, optional)                        trained or one step)                (+ ``similarity_k``)
``select``         ``models`` (K), ``directions``       –                                   as ``train_select``
                   (K, optional)
=================  ===================================  ==================================  ===========================

The client scores each received model on its *training* data (:func:`score_models`): by its
loss L_k (lowest wins) or, when update directions come along, by Lin et al.'s λ·S_k − (1−λ)·L_k
(highest wins). ``train_select`` then trains the chosen model for the client's epochs, or with
``local_update: one_step`` takes one gradient step on the selection mini-batch
(:func:`step_best_model`); ``select`` only reports the choice (a client asked once for its
identity). Config: ``selection_batch``, ``loss_reduction``, ``lambda``, ``local_update``.
"""

from __future__ import annotations

import numpy as np
import torch
from ...types import Scalar
from torch import nn

from ...client import ClusterClient, TaskInput, TaskOutput, round_seed
from ...registry import handles
from ...protocol import (
    LOSS,
    MODEL,
    MODELS,
    QUERY_KIND,
    TRAIN_LOSS,
    ProtocolError,
    Task,
    index_into,
    indexed,
    no_arrays,
    one_model,
    one_per_item,
    when_sent,
)
from ...training import (
    descent_similarity,
    get_weights,
    gradient_step,
    parameter_gradients,
    selection_forward,
    selection_score_inputs,
)

# Instruction config.
SELECTION_BATCH_KEY = "selection_batch"  # samples the losses are taken on (0: all)
LOSS_REDUCTION_KEY = "loss_reduction"  # "mean" (default) or "sum" over those samples
LAMBDA_KEY = "lambda"  # with directions: weight of the gradient similarity
LOCAL_UPDATE_KEY = "local_update"  # train_select: EPOCHS (train the chosen model) or ONE_STEP (w_s - lr grad L_s(Z))
EPOCHS = "epochs"
ONE_STEP = "one_step"

# Reply metrics (and LOSS, per model).
SELECTED = "selected"
SIMILARITY = "similarity"  # per model: similarity_0, ...

# Block names.
DIRECTIONS = "directions"  # items: one update direction per model (gradloss)

_SELECTION_CHECKS = (
    index_into(SELECTED, MODELS),
    one_per_item(LOSS, MODELS),  # NaN allowed: a diverged model is reported, never chosen
    when_sent(DIRECTIONS, one_per_item(SIMILARITY, MODELS)),
)
_SELECTION = dict(
    sends=(MODELS,),
    optional=(DIRECTIONS,),
    metric_checks=_SELECTION_CHECKS,
    may_be_nonfinite=(LOSS, SIMILARITY),  # a diverged model's score is reported, and never chosen
    model_blocks=(MODEL, MODELS, DIRECTIONS),
)
TRAIN_SELECT = Task("train_select", reply=(MODEL,), reply_shapes=one_model, **_SELECTION)
# train_select without the training: "which of these models is mine?"
SELECT = Task("select", reply=(), reply_shapes=no_arrays, kind=QUERY_KIND, **_SELECTION)

SELECTION_STREAM = 1  # keeps the selection mini-batch's randomness apart from training's


def selection_sample(client: ClusterClient, server_round: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All the client's training samples (``size`` 0 or at least their number), or a mini-batch of
    ``size`` seeded by the client and the round."""
    x, y = client.data.x_train, client.data.y_train
    if size <= 0 or size >= len(y):
        return x, y
    seed = round_seed(client.seed, server_round, client.pid, SELECTION_STREAM)
    chosen = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:size]
    return x[chosen], y[chosen]


def score_models(client: ClusterClient, inputs: TaskInput, models: list[nn.Module]) -> dict[str, Scalar]:
    """Which received model fits this client's training data: ``selected`` and the metrics behind it.

    * Without ``directions`` (IFCA, Ghosh et al.): the model with the lowest loss L_k.
    * With ``directions`` Δw_k (Lin et al., eqs. 1-4): the highest λ·S_k − (1−λ)·L_k, where
      S_k = cos(−∇L_k, Δw_k) (see :func:`~fedcluster_flwr.training.selection_score_inputs`
      for the sign) and λ = config ``lambda``; λ = 0 is IFCA's rule.

    L_k is taken on all training samples, or on a seeded mini-batch of ``selection_batch``, as
    their ``mean`` or ``sum`` (``loss_reduction``). Lin et al.'s L is a sum over the mini-batch,
    so it grows with the batch while S stays in [−1, 1]: with ``sum`` the paper's λ values
    weigh S against losses of tens, with ``mean`` against losses of about one (S counts for
    far more). A NaN score is never the best.
    """
    config = inputs.config
    x, y = selection_sample(client, inputs.server_round, int(config.get(SELECTION_BATCH_KEY, 0)))
    reduction = str(config.get(LOSS_REDUCTION_KEY, "mean"))
    directions = inputs.blocks.get(DIRECTIONS)
    pairs = [
        selection_score_inputs(model, x, y, reduction, client.device, None if directions is None else directions[k])
        for k, model in enumerate(models)
    ]
    losses = [loss for loss, _ in pairs]
    similarities = [similarity for _, similarity in pairs] if directions is not None else []
    return selection_metrics(losses, similarities, float(config.get(LAMBDA_KEY, 0.0)))


def selection_metrics(losses: list[float], similarities: list[float], weight: float) -> dict[str, Scalar]:
    """``selected`` = argmax of −L_k (IFCA) or, with similarities, of λ·S_k − (1−λ)·L_k (Lin et
    al., eq. 4, λ = ``weight``), and every L_k (and S_k). A NaN score is never the best."""
    if similarities:
        scores = weight * np.asarray(similarities) - (1 - weight) * np.asarray(losses)
    else:
        scores = -np.asarray(losses)
    metrics: dict[str, Scalar] = {SELECTED: int(np.argmax(np.nan_to_num(scores, nan=-np.inf)))}
    metrics.update({indexed(LOSS, k): loss for k, loss in enumerate(losses)})
    metrics.update({indexed(SIMILARITY, k): s for k, s in enumerate(similarities)})
    return metrics


@handles(TRAIN_SELECT)
def train_best_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    models = [client.load_model(arrays) for arrays in inputs.blocks[MODELS]]
    local_update = inputs.config.get(LOCAL_UPDATE_KEY, EPOCHS)
    if local_update == ONE_STEP:
        return step_best_model(client, inputs, models)
    if local_update != EPOCHS:
        raise ProtocolError(f"{LOCAL_UPDATE_KEY!r} must be {EPOCHS!r} or {ONE_STEP!r}, got {local_update!r}")
    metrics = score_models(client, inputs, models)
    model = models[int(metrics[SELECTED])]
    metrics[TRAIN_LOSS] = client.train_model(model, inputs.server_round)
    return TaskOutput({MODEL: get_weights(model)}, client.num_train, metrics)


def step_best_model(client: ClusterClient, inputs: TaskInput, models: list[nn.Module]) -> TaskOutput:
    """Lin et al., Algorithm 1, lines 4-6, with one gradient step (``local_update: one_step``).

    On the seeded mini-batch Z (``selection_batch`` training samples), compute every model's
    loss L_k(Z) and, with directions, its gradient and S_k (eqs. 1-3); choose s by
    :func:`selection_metrics` (eq. 4); return w_s − lr·∇L_s(Z) (eq. 5), the gradient being the
    one already taken for S_s (IFCA's "gradient averaging" variant when no directions come,
    where only ∇L_s is taken). With ``loss_reduction: sum`` the gradient is of the summed loss,
    so ``client.lr`` is per sample. The reply's example count is |Z|.
    """
    config = inputs.config
    x, y = selection_sample(client, inputs.server_round, int(config.get(SELECTION_BATCH_KEY, 0)))
    reduction = str(config.get(LOSS_REDUCTION_KEY, "mean"))
    directions = inputs.blocks.get(DIRECTIONS)
    losses = [selection_forward(model, x, y, reduction, client.device, keep_graph=True) for model in models]
    gradients: dict[int, list[torch.Tensor]] = {}
    similarities: list[float] = []
    if directions is not None:
        gradients = {k: parameter_gradients(model, loss) for k, (model, loss) in enumerate(zip(models, losses))}
        similarities = [descent_similarity(models[k], gradients[k], directions[k]) for k in range(len(models))]
    metrics = selection_metrics([float(loss.detach()) for loss in losses], similarities, float(config.get(LAMBDA_KEY, 0.0)))
    chosen = int(metrics[SELECTED])
    model = models[chosen]
    gradient = gradients[chosen] if chosen in gradients else parameter_gradients(model, losses[chosen])
    gradient_step(model, gradient, client.settings)
    model.cpu()
    metrics[TRAIN_LOSS] = float(losses[chosen].detach()) / (len(y) if reduction == "sum" else 1)
    return TaskOutput({MODEL: get_weights(model)}, len(y), metrics)


@handles(SELECT)
def select_best_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    models = [client.load_model(arrays) for arrays in inputs.blocks[MODELS]]
    return TaskOutput({}, client.num_train, score_models(client, inputs, models))
