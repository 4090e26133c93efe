"""Sample-weighted averaging of models, streamed one model at a time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.common import NDArrays


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
