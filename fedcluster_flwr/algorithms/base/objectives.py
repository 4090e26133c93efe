"""Local objectives several methods share, named in a ``train`` instruction (``objective``).

* ``frozen`` (``frozen_layers``: comma-separated parameter-name prefixes): the named layers do not
  change in local training; they get neither a gradient nor an optimizer step. FedRep (Collins et
  al., 2021) trains the head with the body frozen and LPS/GPS-style methods keep shared layers
  apart this way; combine it with another objective as ``objective: "proximal,frozen"``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...registry import objective
from ...training import Objective
from ...types import Scalar

FROZEN = "frozen"
FROZEN_LAYERS_KEY = "frozen_layers"


@objective(FROZEN, config=(FROZEN_LAYERS_KEY,))
def frozen_layers(config: Mapping[str, Scalar]) -> Objective:
    """Cross-entropy with the layers named in ``frozen_layers`` held fixed."""
    prefixes = tuple(p.strip() for p in str(config[FROZEN_LAYERS_KEY]).split(",") if p.strip())
    return Objective(frozen=prefixes)
