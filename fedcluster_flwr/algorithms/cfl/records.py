"""What CFL records about its clusters: each split, each cluster that stayed whole and why
(its diagnosis), and a cluster's updates of one round (the split test's input)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Split:
    """One bi-partition: cluster ``parent`` became ``children`` (their members by partition id)."""

    round: int
    parent: int
    children: tuple[int, int]
    members: tuple[tuple[int, ...], tuple[int, ...]]
    alpha_max_cross: float  # the largest cosine similarity of updates across the two children
    mean_update_norm: float  # ‖Σ |D_i|/|D_c| Δθ_i‖ of the parent in the split round (< ε1)
    max_update_norm: float  # max ‖Δθ_i‖ (> ε2)

    def as_dict(self) -> dict[str, Any]:
        plain = asdict(self)
        return plain | {"children": list(self.children), "members": [list(m) for m in self.members]}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Split:
        return cls(
            int(state["round"]), int(state["parent"]), tuple(int(c) for c in state["children"]),
            tuple(tuple(int(p) for p in m) for m in state["members"]),
            float(state["alpha_max_cross"]), float(state["mean_update_norm"]), float(state["max_update_norm"]),
        )


@dataclass(frozen=True)
class Diagnosis:
    """A cluster that did not split in ``round``: the split test's norms against its ε, and the
    optimal bi-partition of its updates (child sizes, α_max^cross)."""

    round: int
    cluster: int
    size: int
    mean_update_norm: float
    max_update_norm: float
    eps1: float
    eps2: float
    children_sizes: tuple[int, int]
    alpha_max_cross: float
    kept_whole_by: str  # what stopped the split: "max update norm <= eps2", "gamma_max", ...

    @property
    def incongruent(self) -> bool:
        """Stationary by ε1 and certified incongruent: α_max^cross < 0 (the paper's criterion holds
        for every γ_max < 1/√2) between two children of at least 2 clients each (one client's update
        pointing away from the rest cannot be told from noise in one round)."""
        return self.mean_update_norm < self.eps1 and self.alpha_max_cross < 0 and min(self.children_sizes) >= 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"children_sizes": list(self.children_sizes)}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Diagnosis:
        return cls(**(dict(state) | {"children_sizes": tuple(int(n) for n in state["children_sizes"])}))

    def warning(self) -> str:
        return (f"CFL: cluster {self.cluster} ({self.size} clients) ended with incongruent updates (round "
                f"{self.round}): mean update norm {self.mean_update_norm:.3g} < ε1 {self.eps1:.3g}, largest "
                f"{self.max_update_norm:.3g} (ε2 {self.eps2:.3g}); its optimal bi-partition "
                f"{self.children_sizes[0]} + {self.children_sizes[1]} has α_max^cross {self.alpha_max_cross:.3g} < 0; "
                f"kept whole by {self.kept_whole_by}")


@dataclass(frozen=True)
class UpdateStatistics:
    """A cluster's updates of one round: Δθ_i as rows (partition-id order) and the test's two norms."""

    pids: tuple[int, ...]
    updates: np.ndarray  # float32, one row per client
    mean_norm: float
    max_norm: float
    mean_client_norm: float = 0.0  # 1/n Σ ‖Δθ_i‖: the scale S of relative thresholds is its largest before any split
