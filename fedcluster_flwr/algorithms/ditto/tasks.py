"""Ditto's client tasks: ``ditto_train`` (one round of Algorithm 1 on a client) and ``personal``
(the evaluation of the client's personal model, the global model's beside it).

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``ditto_train``    ``arrays`` (the global model w^t),   ``arrays`` (w_k, the global         ``train_loss`` (of w_k),
(train)            ``start`` (v_k's first value, to a   model trained: FedAvg's update)     ``personal_loss`` (of v_k)
                   client that never trained; optional),
                   ``lambda`` (+ the personal training's
                   ``personal_epochs``, ``personal_lr``)
``personal``       ``arrays`` (w^t), ``start``          –                                   ``accuracy``, ``test_loss``
(evaluate)         (optional, as above)                                                     (+ ``val_loss``) of v_k;
                                                                                             ``global_accuracy`` of w^t
=================  ===================================  ==================================  ===========================

The personal model v_k is the client's own: it stays on its node (client state ``personal``, the
node's ``Context.state``), never travels, and its reply is FedAvg's. On a client, one round
(Li et al. 2021, Algorithm 1, lines 5-8):

    w_k ← w^t trained on F_k for the client's epochs                    UPDATE_GLOBAL (FedAvg's local update)
    v_k ← v_k trained on h_k(v; w^t) = F_k(v) + (λ/2)||v − w^t||²       eq. 2 / line 7, s local steps

Both trainings see the round's mini-batches in the same order, as the authors' code feeds each
batch to both updates (github.com/litian96/ditto, ``flearn/trainers_MTL/ditto.py``: one
``data_batch`` per local iteration for the personal and the global step); the two updates do not
depend on each other within a round (v_k's pull is to w^t, fixed), so one after the other is that
interleaving exactly. Hence, bit for bit: the global half is ``fedavg``'s update, and with λ = 0 the
personal half is ``local``'s training.
"""

from __future__ import annotations

from ...client import ClusterClient, TaskInput, TaskOutput
from ...protocol import (
    ACCURACY, EVALUATE_KIND, MODEL, TEST_LOSS, TRAIN_LOSS, VAL_LOSS, Task, finite, in_unit_interval, no_arrays,
    one_model,
)
from ...registry import handles
from ...training import Objective, get_weights
from ...types import NDArrays, Scalar
from ..fedprox.math import ProximalTerm

# Blocks.
START = "start"  # v_k^0, to a client that keeps no personal model yet (the run's initial model, Algorithm 1's input)
# What a client keeps on its node.
PERSONAL = "personal"
# Instruction config.
LAMBDA_KEY = "lambda"  # λ of eq. 2
PERSONAL_EPOCHS_KEY = "personal_epochs"  # (optional) the personal training's epochs instead of the client's
PERSONAL_LR_KEY = "personal_lr"  # (optional) the personal training's learning rate instead of the client's
# Reply metrics.
PERSONAL_LOSS = "personal_loss"
GLOBAL_ACCURACY = "global_accuracy"
# The anchor the personal objective pulls towards: the global model of the round.
GLOBAL_ANCHOR = "global"

DITTO_TRAIN = Task(
    "ditto_train", sends=(MODEL,), optional=(START,), reply=(MODEL,), reply_shapes=one_model,
    config=(LAMBDA_KEY,), model_blocks=(MODEL, START), state=(PERSONAL,),
)
PERSONAL_EVALUATE = Task(
    "personal", sends=(MODEL,), optional=(START,), reply=(), reply_shapes=no_arrays, kind=EVALUATE_KIND,
    metric_checks=(in_unit_interval(ACCURACY), finite(TEST_LOSS), in_unit_interval(GLOBAL_ACCURACY)),
    model_blocks=(MODEL, START), state=(PERSONAL,),
)


def personal_model(client: ClusterClient, inputs: TaskInput) -> NDArrays:
    """v_k: the one the client keeps, else the ``start`` it was sent, else the global model (a client
    whose node lost its state: a resumed run whose checkpoint could not hold it)."""
    kept = client.state.arrays(PERSONAL)
    if kept is not None:
        return kept
    return inputs.blocks[START][0] if START in inputs.blocks else inputs.blocks[MODEL][0]


@handles(DITTO_TRAIN)
def train_global_and_personal(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    (global_arrays,) = inputs.blocks[MODEL]
    config = inputs.config
    shared = client.load_model(global_arrays)
    loss = client.train_model(shared, inputs.server_round)  # FedAvg's local update of w^t
    personal = client.load_model(personal_model(client, inputs))
    objective = Objective(terms=(ProximalTerm(float(config[LAMBDA_KEY]), anchor=GLOBAL_ANCHOR),))
    epochs, lr = config.get(PERSONAL_EPOCHS_KEY), config.get(PERSONAL_LR_KEY)
    personal_loss = client.train_model(
        personal, inputs.server_round, None if epochs is None else int(epochs), objective,
        anchors={GLOBAL_ANCHOR: global_arrays}, lr=None if lr is None else float(lr),
    )
    client.state.set_arrays(PERSONAL, get_weights(personal))
    return TaskOutput({MODEL: get_weights(shared)}, client.num_train, {TRAIN_LOSS: loss, PERSONAL_LOSS: personal_loss})


@handles(PERSONAL_EVALUATE)
def evaluate_personal_and_global(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    """The personal model's test loss and accuracy (and validation loss), and the global model's accuracy."""
    data = client.data
    personal = client.load_model(personal_model(client, inputs))
    loss, accuracy = client.evaluate_model(personal, data.x_test, data.y_test)
    metrics: dict[str, Scalar] = {ACCURACY: accuracy, TEST_LOSS: loss}
    if data.x_val is not None and data.y_val is not None and len(data.y_val):
        metrics[VAL_LOSS] = client.evaluate_model(personal, data.x_val, data.y_val)[0]
    metrics[GLOBAL_ACCURACY] = client.evaluate_model(client.load_model(inputs.blocks[MODEL][0]), data.x_test, data.y_test)[1]
    return TaskOutput({}, len(data.y_test), metrics)
