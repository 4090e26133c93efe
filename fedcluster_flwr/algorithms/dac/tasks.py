"""Gossip learning with neighbour selection (Zec et al.'s DAC, Onoszko et al.'s PENS): ``gossip_train``.

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``gossip_train``   ``models`` (own + m neighbours),     ``model`` (own, trained)            ``loss_j``, j < m, finite
                   ``samples_j`` in the config
                   (+ ``merge_lowest``, optional)
=================  ===================================  ==================================  ===========================

Given its own model and m neighbours' models, the client takes the loss of each neighbour model
on its training data, then FedAvg of all m + 1 models by sample counts (``samples_j``: the
training samples behind neighbour j's model), then trains the merged model locally (DAC's step).
With ``merge_lowest`` = m' only the m' neighbour models of lowest loss are merged with its own
(PENS). The losses go back to the server, whose similarity of client and neighbour is 1/loss.
"""

from __future__ import annotations

from ...types import Scalar

from ...aggregation import lowest, weighted_mean
from ...client import ClusterClient, TaskInput, TaskOutput
from ...registry import handles
from ...protocol import LOSS, MODEL, MODELS, TRAIN_LOSS, Task, indexed, one_model, one_per_item
from ...training import get_weights

# Instruction config.
SAMPLES_KEY = "samples"  # samples_j, the training samples behind neighbour j's model
MERGE_LOWEST_KEY = "merge_lowest"  # (optional): merge only this many neighbours, those of lowest loss (PENS)

GOSSIP_TRAIN = Task(
    "gossip_train",
    sends=(MODELS,),
    reply=(MODEL,),
    reply_shapes=one_model,
    metric_checks=(one_per_item(LOSS, MODELS, skip=1, finite=True, minimum=0.0),),
)


@handles(GOSSIP_TRAIN)
def merge_neighbours_and_train(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    own, *neighbours = inputs.blocks[MODELS]
    losses = [client.training_loss(client.load_model(arrays)) for arrays in neighbours]
    metrics: dict[str, Scalar] = {indexed(LOSS, j): loss for j, loss in enumerate(losses)}
    keep = inputs.config.get(MERGE_LOWEST_KEY)
    merging = range(len(neighbours)) if keep is None else lowest(losses, int(keep))
    counts = [client.num_train] + [int(inputs.config[indexed(SAMPLES_KEY, j)]) for j in merging]
    merged = client.load_model(weighted_mean([own, *(neighbours[j] for j in merging)], counts, [a.dtype for a in own]))
    metrics[TRAIN_LOSS] = client.train_model(merged, inputs.server_round)
    return TaskOutput({MODEL: get_weights(merged)}, client.num_train, metrics)
