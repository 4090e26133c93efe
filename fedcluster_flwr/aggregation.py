"""Sample-weighted averaging of models, streamed one model at a time, and which models to average."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from .types import NDArrays


def weighted_mean(models: Iterable[NDArrays], weights: Sequence[float], dtypes: Sequence[Any]) -> NDArrays:
    """Sample-weighted average of ``models`` (an iterable: read one model at a time),
    accumulated in float64 and returned in ``dtypes``."""
    total = float(sum(weights))
    sums: list[np.ndarray] = []
    for model, weight in zip(models, weights):
        if not sums:
            sums = [np.zeros(a.shape, dtype=np.float64) for a in model]
        for acc, array in zip(sums, model):
            acc += np.multiply(array, weight / total, dtype=np.float64)
    return [acc.astype(dtype) for acc, dtype in zip(sums, dtypes)]


def average_layers(models: Mapping[int, NDArrays], weights: Mapping[int, float], indices: Sequence[int]) -> dict[int, NDArrays]:
    """``models`` with the arrays at ``indices`` replaced by their ``weights``-weighted average
    across the models; every other array is kept as it is (the same object)."""
    keys = sorted(models)
    if not keys or not indices:
        return dict(models)
    dtypes = [models[keys[0]][i].dtype for i in indices]
    shared = weighted_mean(([models[k][i] for i in indices] for k in keys), [weights[k] for k in keys], dtypes)
    replaced = dict(zip(indices, shared))
    return {k: [replaced.get(i, array) for i, array in enumerate(models[k])] for k in keys}


def lowest(values: Sequence[float], count: int) -> list[int]:
    """Indices of the ``count`` smallest ``values`` in increasing order, ties by position: the
    neighbour models a PENS client merges (lowest loss on its data). The client merges them and the
    relay counts them with this one rule, so both sides name the same models."""
    return [int(i) for i in np.argsort(np.asarray(values, dtype=np.float64), kind="stable")[:count]]
