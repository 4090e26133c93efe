"""The array and scalar types of messages, as Flower defines them (``flwr.common.typing``), for the
code that has no business importing Flower: training, aggregation, clustering, the paper math,
the client tasks and the batched engine."""

from __future__ import annotations

from typing import Union

import numpy as np
from numpy.typing import NDArray

NDArrays = list[NDArray[np.generic]]  # a model: its arrays in state_dict order
Scalar = Union[bool, bytes, float, int, str]  # a config or metric value
