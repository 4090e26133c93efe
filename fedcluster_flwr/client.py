"""ClusterClient: the NumPyClient every strategy talks to, and its task handlers.

The client unpacks an instruction with the codec of :mod:`fedcluster_flwr.protocol`, looks
up the handler registered for its task and packs the handler's reply in the order the task
declares. Handlers here:

* ``train``: load the one model received, train it locally (``client.epochs``, or the
  instruction's ``epochs``, e.g. a gossip client's pretraining), return it.
* ``train_select``: score each received model on the local *training* data, train the best
  and return it with ``selected`` = its index and every model's loss (and similarity). The
  score is the loss (lowest wins: IFCA's cluster estimate; FL+HC's placement of a client
  that missed the clustering round) or, when update directions come along, Lin et al.'s
  λ·S − (1−λ)·L (highest wins); see :func:`score_models`. With ``local_update: one_step`` the
  chosen model takes one gradient step on the selection mini-batch instead (:func:`step_best_model`).
* ``select``: the same choice without training (a client asked once for its identity).
* ``gram_eigen``: the top-k eigenvectors of G = (1/n) Φ(X)ᵀΦ(X) of the client's training images
  (Ali & Arafa's one-shot summary of its data), and their eigenvalues when the instruction says
  ``share_eigenvalues`` (Amiri et al.'s relevance needs them; the paper's does not).
* ``relevance``: given every client's eigenvectors (and eigenvalues, when shared), the client's
  row r(i, ·) of the relevance matrix (see :func:`~fedcluster_flwr.clustering.relevance_row`).
* ``gossip_train``: given its own model and m neighbours' models, the loss of each neighbour
  model on the client's training data, then FedAvg of all m + 1 models by sample counts, then
  local training of the merged model (Zec et al.'s DAC step). With ``merge_lowest`` = m' only
  the m' neighbour models of lowest loss are merged with its own (Onoszko et al.'s PENS).
* ``evaluate``: test the received model on the client's own test split.

A new task's handler is a function ``(client, TaskInput) -> TaskOutput`` registered with
``@handles(protocol.SOME_TASK)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import NDArrays, Scalar
from torch import nn

from . import protocol
from .protocol import MODEL, MODELS, Task
from .aggregation import lowest, weighted_mean
from .clustering import relevance_row
from .features import feature_map, gram_matrix, top_eigenpairs
from .training import (
    TrainSettings,
    descent_similarity,
    evaluate,
    get_weights,
    gradient_step,
    parameter_gradients,
    selection_forward,
    selection_score_inputs,
    set_weights,
    train,
)


class SimulatedClientFailure(RuntimeError):
    """Raised on purpose (``simulation.fail_fit``) to exercise failure handling."""


@dataclass(frozen=True, eq=False)
class ClientData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None = None  # held out of training for model selection (partition.val_fraction)
    y_val: torch.Tensor | None = None


@dataclass(frozen=True)
class TaskInput:
    """An unpacked instruction: the round, the named blocks and the config scalars."""

    server_round: int
    blocks: Mapping[str, list[NDArrays]]
    config: Mapping[str, Scalar]


@dataclass(frozen=True)
class TaskOutput:
    """A handler's reply: named arrays, the examples it used, metrics (and a loss for evaluate)."""

    blocks: Mapping[str, NDArrays]
    num_examples: int
    metrics: Mapping[str, Scalar] = field(default_factory=dict)
    loss: float = float("nan")


Handler = Callable[["ClusterClient", TaskInput], TaskOutput]
HANDLERS: dict[str, tuple[Task, Handler]] = {}  # task name -> (task, its handler)


def handles(task: Task) -> Callable[[Handler], Handler]:
    """Register the decorated function as the client's handler of ``task``."""

    def register(handler: Handler) -> Handler:
        HANDLERS[task.name] = (task, handler)
        return handler

    return register


SELECTION_STREAM = 1  # keeps the selection mini-batch's randomness apart from training's


def round_seed(seed: int, server_round: int, pid: int) -> int:
    """Independent, reproducible seed for one client's training in one round."""
    return int(np.random.SeedSequence([seed, server_round, pid]).generate_state(1)[0])


class ClusterClient(NumPyClient):
    """Local training and evaluation on one partition; the work itself is in the task handlers."""

    def __init__(
        self,
        pid: int,
        num_partitions: int,
        data: ClientData,
        model_factory: Callable[[], nn.Module],
        settings: TrainSettings,
        seed: int,
        device: torch.device,
        fail_rounds: tuple[int, ...] = (),
    ) -> None:
        self.pid = pid
        self.num_partitions = num_partitions
        self.data = data
        self.model_factory = model_factory
        self.settings = settings
        self.seed = seed
        self.device = device
        self.fail_rounds = fail_rounds

    def get_properties(self, config: dict[str, Scalar]) -> dict[str, Scalar]:
        return {
            protocol.PARTITION_ID: self.pid,
            protocol.NUM_PARTITIONS: self.num_partitions,
            protocol.NUM_TRAIN: len(self.data.y_train),
            protocol.NUM_TEST: len(self.data.y_test),
        }

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        server_round = int(config[protocol.ROUND_KEY])
        if server_round in self.fail_rounds:
            raise SimulatedClientFailure(f"client {self.pid} fails in round {server_round} (simulation.fail_fit)")
        task, output = self._run(parameters, config)
        return task.pack_reply(output.blocks), output.num_examples, {protocol.PARTITION_ID: self.pid, **output.metrics}

    def evaluate(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[float, int, dict[str, Scalar]]:
        _, output = self._run(parameters, config)
        return output.loss, output.num_examples, {protocol.PARTITION_ID: self.pid, **output.metrics}

    def _run(self, parameters: NDArrays, config: Mapping[str, Scalar]) -> tuple[Task, TaskOutput]:
        name = config.get(protocol.TASK_KEY)
        if name not in HANDLERS:
            known = "known to the protocol but not handled yet" if name in protocol.TASKS else "unknown"
            raise protocol.ProtocolError(f"task {name!r} is {known}; this client handles {', '.join(HANDLERS)}")
        task, handler = HANDLERS[name]
        blocks = protocol.unpack(parameters, config[protocol.LAYOUT_KEY])
        task.check_instruction(blocks, config)
        return task, handler(self, TaskInput(int(config.get(protocol.ROUND_KEY, 0)), blocks, config))

    # ---- what handlers share ----------------------------------------------------------------

    def load_model(self, arrays: NDArrays) -> nn.Module:
        """The model with ``arrays`` as its state. Built on the meta device: a random initialisation
        that the arrays overwrite anyway would cost more than the work on small models."""
        with torch.device("meta"):
            model = self.model_factory()
        set_weights(model, arrays, assign=True)
        return model

    def train_model(self, model: nn.Module, server_round: int, epochs: int | None = None) -> float:
        """Local training of ``model`` with this round's seed (for ``epochs``, default the client's
        own ``client.epochs``); returns the mean batch loss."""
        generator = torch.Generator().manual_seed(round_seed(self.seed, server_round, self.pid))
        settings = self.settings if epochs is None else replace(self.settings, epochs=epochs)
        return train(model, self.data.x_train, self.data.y_train, settings, generator, self.device)

    def training_loss(self, model: nn.Module) -> float:
        return evaluate(model, self.data.x_train, self.data.y_train, self.device)[0]

    def selection_sample(self, server_round: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All training samples (``size`` 0 or at least their number), or a seeded mini-batch of ``size``."""
        x, y = self.data.x_train, self.data.y_train
        if size <= 0 or size >= len(y):
            return x, y
        seed = int(np.random.SeedSequence([self.seed, server_round, self.pid, SELECTION_STREAM]).generate_state(1)[0])
        chosen = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:size]
        return x[chosen], y[chosen]

    @property
    def num_train(self) -> int:
        return len(self.data.y_train)

    def gram(self, config: Mapping[str, Scalar]) -> torch.Tensor:
        """G = (1/n) ΦᵀΦ of the training images, with the feature map the config names."""
        phi = feature_map(
            str(config[protocol.FEATURES_KEY]),
            tuple(self.data.x_train.shape[1:]),
            int(config[protocol.FEATURE_DIM_KEY]),
            int(config[protocol.FEATURE_SEED_KEY]),
            str(config[protocol.PRETRAINED_WEIGHTS_KEY]) or None,
        )
        return gram_matrix(phi(self.data.x_train))


@handles(protocol.TRAIN)
def train_received_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    (arrays,) = inputs.blocks[MODELS]
    model = client.load_model(arrays)
    epochs = inputs.config.get(protocol.EPOCHS_KEY)
    loss = client.train_model(model, inputs.server_round, None if epochs is None else int(epochs))
    return TaskOutput({MODEL: get_weights(model)}, client.num_train, {protocol.TRAIN_LOSS: loss})


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
    batch = int(config.get(protocol.SELECTION_BATCH_KEY, 0))
    reduction = str(config.get(protocol.LOSS_REDUCTION_KEY, "mean"))
    directions = inputs.blocks.get(protocol.DIRECTIONS)
    if directions is None and batch == 0 and reduction == "mean":
        # The batched evaluation loop FL+HC's placements have always used: its float sums, hence
        # its choices, stay bit-identical (the recorded trajectories check it).
        losses = [client.training_loss(model) for model in models]
        similarities: list[float] = []
    else:
        x, y = client.selection_sample(inputs.server_round, batch)
        pairs = [
            selection_score_inputs(model, x, y, reduction, client.device, None if directions is None else directions[k])
            for k, model in enumerate(models)
        ]
        losses = [loss for loss, _ in pairs]
        similarities = [similarity for _, similarity in pairs] if directions is not None else []
    return selection_metrics(losses, similarities, float(config.get(protocol.LAMBDA_KEY, 0.0)))


def selection_metrics(losses: list[float], similarities: list[float], weight: float) -> dict[str, Scalar]:
    """``selected`` = argmax of −L_k (IFCA) or, with similarities, of λ·S_k − (1−λ)·L_k (Lin et
    al., eq. 4, λ = ``weight``), and every L_k (and S_k). A NaN score is never the best."""
    if similarities:
        scores = weight * np.asarray(similarities) - (1 - weight) * np.asarray(losses)
    else:
        scores = -np.asarray(losses)
    metrics: dict[str, Scalar] = {protocol.SELECTED: int(np.argmax(np.nan_to_num(scores, nan=-np.inf)))}
    metrics.update({protocol.indexed(protocol.LOSS, k): loss for k, loss in enumerate(losses)})
    metrics.update({protocol.indexed(protocol.SIMILARITY, k): s for k, s in enumerate(similarities)})
    return metrics


@handles(protocol.TRAIN_SELECT)
def train_best_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    models = [client.load_model(arrays) for arrays in inputs.blocks[MODELS]]
    local_update = inputs.config.get(protocol.LOCAL_UPDATE_KEY, protocol.EPOCHS)
    if local_update == protocol.ONE_STEP:
        return step_best_model(client, inputs, models)
    if local_update != protocol.EPOCHS:
        raise protocol.ProtocolError(f"{protocol.LOCAL_UPDATE_KEY!r} must be {protocol.EPOCHS!r} or {protocol.ONE_STEP!r}, got {local_update!r}")
    metrics = score_models(client, inputs, models)
    model = models[int(metrics[protocol.SELECTED])]
    metrics[protocol.TRAIN_LOSS] = client.train_model(model, inputs.server_round)
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
    x, y = client.selection_sample(inputs.server_round, int(config.get(protocol.SELECTION_BATCH_KEY, 0)))
    reduction = str(config.get(protocol.LOSS_REDUCTION_KEY, "mean"))
    directions = inputs.blocks.get(protocol.DIRECTIONS)
    losses = [selection_forward(model, x, y, reduction, client.device, keep_graph=True) for model in models]
    gradients: dict[int, list[torch.Tensor]] = {}
    similarities: list[float] = []
    if directions is not None:
        gradients = {k: parameter_gradients(model, loss) for k, (model, loss) in enumerate(zip(models, losses))}
        similarities = [descent_similarity(models[k], gradients[k], directions[k]) for k in range(len(models))]
    metrics = selection_metrics([float(loss.detach()) for loss in losses], similarities, float(config.get(protocol.LAMBDA_KEY, 0.0)))
    chosen = int(metrics[protocol.SELECTED])
    model = models[chosen]
    gradient = gradients[chosen] if chosen in gradients else parameter_gradients(model, losses[chosen])
    gradient_step(model, gradient, client.settings.lr)
    model.cpu()
    metrics[protocol.TRAIN_LOSS] = float(losses[chosen].detach()) / (len(y) if reduction == "sum" else 1)
    return TaskOutput({MODEL: get_weights(model)}, len(y), metrics)


@handles(protocol.SELECT)
def select_best_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    models = [client.load_model(arrays) for arrays in inputs.blocks[MODELS]]
    return TaskOutput({}, client.num_train, score_models(client, inputs, models))


@handles(protocol.EVALUATE)
def evaluate_received_model(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    """Test loss and accuracy; with a validation split, also the validation loss."""
    (arrays,) = inputs.blocks[MODELS]
    model = client.load_model(arrays)
    data = client.data
    loss, accuracy = evaluate(model, data.x_test, data.y_test, client.device)
    metrics: dict[str, Scalar] = {protocol.ACCURACY: accuracy}
    if data.x_val is not None and data.y_val is not None and len(data.y_val):
        metrics[protocol.VAL_LOSS] = evaluate(model, data.x_val, data.y_val, client.device)[0]
    return TaskOutput({}, len(data.y_test), metrics, loss=loss)


@handles(protocol.GRAM_EIGEN)
def top_gram_eigenpairs(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    vectors, values = top_eigenpairs(client.gram(inputs.config), int(inputs.config[protocol.NUM_EIGENVECTORS_KEY]))
    shared_values = [values.float().numpy()] if inputs.config[protocol.SHARE_EIGENVALUES_KEY] else []
    blocks = {protocol.EIGENVECTORS: [vectors.float().numpy()], protocol.EIGENVALUES: shared_values}
    return TaskOutput(blocks, client.num_train)


@handles(protocol.RELEVANCE_ROW)
def relevance_to_every_client(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    summaries = inputs.blocks[protocol.EIGENVECTORS]
    shared = bool(inputs.config[protocol.SHARE_EIGENVALUES_KEY])
    expected = 2 if shared else 1  # [vectors, values] or [vectors]
    if any(len(item) != expected for item in summaries):
        raise protocol.ProtocolError(
            f"task relevance: with {protocol.SHARE_EIGENVALUES_KEY}={shared} each summary holds {expected} arrays, "
            f"got {sorted({len(item) for item in summaries})}"
        )
    values = [item[1] for item in summaries] if shared else None
    row = relevance_row(client.gram(inputs.config).numpy(), [item[0] for item in summaries], values)
    return TaskOutput({protocol.RELEVANCE: [row.astype(np.float32)]}, client.num_train)


@handles(protocol.GOSSIP_TRAIN)
def merge_neighbours_and_train(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    own, *neighbours = inputs.blocks[MODELS]
    losses = [client.training_loss(client.load_model(arrays)) for arrays in neighbours]
    metrics: dict[str, Scalar] = {protocol.indexed(protocol.LOSS, j): loss for j, loss in enumerate(losses)}
    keep = inputs.config.get(protocol.MERGE_LOWEST_KEY)
    merging = range(len(neighbours)) if keep is None else lowest(losses, int(keep))
    counts = [client.num_train] + [int(inputs.config[protocol.indexed(protocol.SAMPLES_KEY, j)]) for j in merging]
    merged = client.load_model(weighted_mean([own, *(neighbours[j] for j in merging)], counts, [a.dtype for a in own]))
    metrics[protocol.TRAIN_LOSS] = client.train_model(merged, inputs.server_round)
    return TaskOutput({MODEL: get_weights(merged)}, client.num_train, metrics)
