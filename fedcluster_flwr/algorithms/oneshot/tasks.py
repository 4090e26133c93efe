"""One-shot clustering by data similarity (Ali & Arafa): ``gram_eigen``, then ``relevance``.

=================  ===================================  ==================================  ===========================
task               sends                                reply arrays                        reply metrics
=================  ===================================  ==================================  ===========================
``gram_eigen``     – (Φ, k and ``share_eigenvalues``    ``eigenvectors`` (k × d),            –
                   in the config)                       ``eigenvalues`` (k; none unless
                                                        ``share_eigenvalues``)
``relevance``      ``eigenvectors`` (N items of         ``relevance`` (N)                   –
                   k × d vectors, + k values each
                   with ``share_eigenvalues``)
=================  ===================================  ==================================  ===========================

``gram_eigen``: the top-k eigenvectors of G = (1/n) Φ(X)ᵀΦ(X) of the client's training images
(its one-shot summary of its data), and their eigenvalues when the instruction says
``share_eigenvalues`` (Amiri et al.'s relevance needs them; the paper's does not). They are also
the top-k left singular vectors of the data matrix Φ(X)ᵀ (features × samples), PACFL's U_p.
``relevance``: given every client's eigenvectors (and eigenvalues, when shared), the client's
row r(i, ·) of the relevance matrix (see :func:`~fedcluster_flwr.clustering.relevance_row`).
Both name the feature map Φ in the config (``features``, ``feature_dim``, ``feature_seed``,
``pretrained_weights``; see :mod:`fedcluster_flwr.features`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from ...types import Scalar

from ...client import ClusterClient, TaskInput, TaskOutput
from ...registry import handles
from .math import relevance_row
from ...features import feature_map, gram_matrix, top_eigenpairs
from ...protocol import QUERY_KIND, ArraySpec, ModelSpec, ProtocolError, Sent, Task

# Instruction config.
NUM_EIGENVECTORS_KEY = "num_eigenvectors"
FEATURES_KEY = "features"  # the feature map Φ (see features.py)
FEATURE_DIM_KEY = "feature_dim"  # d, the number of features of Φ
FEATURE_SEED_KEY = "feature_seed"  # random_projection: the seed every client draws the projection from
PRETRAINED_WEIGHTS_KEY = "pretrained_weights"  # pretrained: the backbone's weights file on the client
# Whether clients share their eigenvalues along with their eigenvectors (Amiri et al.'s relevance
# compares j's eigenvalues; Ali & Arafa's eq. 3 the client's own, so none are sent)
SHARE_EIGENVALUES_KEY = "share_eigenvalues"
# relevance: ε of eq. 3's guarded ratio, relative to the largest eigenvalue compared (strategy.eigen_floor)
EIGEN_FLOOR_KEY = "eigen_floor"

# Block names.
EIGENVECTORS = "eigenvectors"  # sent: items [vectors (k, d)] (+ values (k,) when shared); replied: vectors (k, d)
EIGENVALUES = "eigenvalues"  # replied: values (k,) when shared, else no array
RELEVANCE = "relevance"  # replied: one row r(i, .) of the relevance matrix


def _eigen_shapes(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    k, d = int(sent.config[NUM_EIGENVECTORS_KEY]), int(sent.config[FEATURE_DIM_KEY])
    values = [ArraySpec((k,), low=0.0)] if sent.config[SHARE_EIGENVALUES_KEY] else []
    return {EIGENVECTORS: [ArraySpec((k, d))], EIGENVALUES: values}


def _relevance_shape(sent: Sent, model: ModelSpec) -> dict[str, list[ArraySpec]]:
    return {RELEVANCE: [ArraySpec((sent.items[EIGENVECTORS],), low=0.0, high=1.0)]}


_ONESHOT_CONFIG = (FEATURES_KEY, FEATURE_DIM_KEY, FEATURE_SEED_KEY, PRETRAINED_WEIGHTS_KEY, SHARE_EIGENVALUES_KEY)
GRAM_EIGEN = Task(
    "gram_eigen",
    sends=(),
    reply=(EIGENVECTORS, EIGENVALUES),
    reply_shapes=_eigen_shapes,
    config=(NUM_EIGENVECTORS_KEY, *_ONESHOT_CONFIG),
    kind=QUERY_KIND,
)
RELEVANCE_ROW = Task(
    "relevance", sends=(EIGENVECTORS,), reply=(RELEVANCE,), reply_shapes=_relevance_shape,
    config=(*_ONESHOT_CONFIG, EIGEN_FLOOR_KEY), kind=QUERY_KIND,
)


def client_gram(client: ClusterClient, config: Mapping[str, Scalar]) -> torch.Tensor:
    """G = (1/n) ΦᵀΦ of the client's training images, with the feature map the config names."""
    phi = feature_map(
        str(config[FEATURES_KEY]),
        tuple(client.data.x_train.shape[1:]),
        int(config[FEATURE_DIM_KEY]),
        int(config[FEATURE_SEED_KEY]),
        str(config[PRETRAINED_WEIGHTS_KEY]) or None,
    )
    return gram_matrix(phi(client.data.x_train))


@handles(GRAM_EIGEN)
def top_gram_eigenpairs(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    vectors, values = top_eigenpairs(client_gram(client, inputs.config), int(inputs.config[NUM_EIGENVECTORS_KEY]))
    shared_values = [values.float().numpy()] if inputs.config[SHARE_EIGENVALUES_KEY] else []
    blocks = {EIGENVECTORS: [vectors.float().numpy()], EIGENVALUES: shared_values}
    return TaskOutput(blocks, client.num_train)


@handles(RELEVANCE_ROW)
def relevance_to_every_client(client: ClusterClient, inputs: TaskInput) -> TaskOutput:
    summaries = inputs.blocks[EIGENVECTORS]
    shared = bool(inputs.config[SHARE_EIGENVALUES_KEY])
    expected = 2 if shared else 1  # [vectors, values] or [vectors]
    if any(len(item) != expected for item in summaries):
        raise ProtocolError(
            f"task relevance: with {SHARE_EIGENVALUES_KEY}={shared} each summary holds {expected} arrays, "
            f"got {sorted({len(item) for item in summaries})}"
        )
    values = [item[1] for item in summaries] if shared else None
    floor = float(inputs.config[EIGEN_FLOOR_KEY])
    row = relevance_row(client_gram(client, inputs.config).numpy(), [item[0] for item in summaries], values, floor)
    return TaskOutput({RELEVANCE: [row.astype(np.float32)]}, client.num_train)
