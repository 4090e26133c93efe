"""The partitioners' options: one frozen dataclass per partitioner (the YAML keys under
``partition:`` besides the section's own), with what each true cluster is called and how many
groups an option sets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..declarations.options import DeclaredOptions
from ..declarations.schema import Interval, above, at_least, join_key, option, require


@dataclass(frozen=True)
class IidOptions(DeclaredOptions):
    """Shuffle the pool and give every client an equal share."""


@dataclass(frozen=True)
class PathologicalOptions(DeclaredOptions):
    """Sort by label, cut into shards, give each client `labels_per_client` shards."""

    labels_per_client: int = option(2, at_least(1))


@dataclass(frozen=True)
class LabelSwapOptions(DeclaredOptions):
    """IID split into `num_groups` groups; group g swaps the label pair `swaps[g]`."""

    num_groups: int = option(4, at_least(1))
    swaps: tuple[tuple[int, ...], ...] | None = None

    def validate(self, prefix: str) -> None:
        if self.swaps is not None:
            require(
                len(self.swaps) == self.num_groups,
                join_key(prefix, "swaps"),
                f"needs one label pair per group ({self.num_groups}), got {len(self.swaps)}",
            )
            for g, pair in enumerate(self.swaps):
                require(
                    len(pair) == 2 and pair[0] != pair[1],
                    join_key(prefix, f"swaps[{g}]"),
                    f"expected two different labels, got {list(pair)}",
                )

    def cluster_name(self, k: int) -> str:
        a, b = self.swaps[k] if self.swaps is not None else (2 * k, 2 * k + 1)
        return f"swap {a}↔{b}"

    def group_count(self) -> tuple[str, int]:
        return "num_groups", self.num_groups


@dataclass(frozen=True)
class RotationOptions(DeclaredOptions):
    """IID split; the clients of cluster k see images rotated by `angles[k]` degrees.

    ``rotation_fill`` is what the corners that a rotation by other than a multiple of 90 degrees
    turns away from the image hold:

    - ``normalized_zero`` (default, as published): the image is rotated *after* normalisation, so
      the corners are 0 in the model's input space. The DAC reference code (github.com/edvinli/DAC,
      main_fed.py) loads Fashion-MNIST/CIFAR-10 with ``Compose([ToTensor(), Normalize(0.5, 0.5)])``
      and its ``DatasetSplit`` then applies ``RandomRotation(degrees=(d, d))`` (default fill 0) to
      the normalised tensor (``ClientUpdate.__init__``; ``create_test_data`` puts the rotation after
      Normalize in the same Compose). Its zero is raw grey 0.5, because it normalises with 0.5/0.5;
      ours normalises with the dataset's mean/std, so here the corners are the dataset's mean
      intensity (0.286 for Fashion-MNIST) - the same "no information" input to the model.
    - ``black``: rotated *before* normalisation, corners raw 0 (this project's former behaviour).

    The reference also rotates with nearest-neighbour interpolation (RandomRotation's default);
    we use bilinear. Angles that are multiples of 90 degrees are exact permutations either way.
    """

    angles: tuple[float, ...] = (0.0, 90.0, 180.0, 270.0)
    cluster_sizes: tuple[int, ...] | None = None
    rotation_fill: Literal["normalized_zero", "black"] = "normalized_zero"

    def validate(self, prefix: str) -> None:
        require(len(self.angles) >= 1, join_key(prefix, "angles"), "needs at least one angle")
        _check_one_per_entry(self.cluster_sizes, "size", "angles", len(self.angles), join_key(prefix, "cluster_sizes"))

    def cluster_name(self, k: int) -> str:
        return f"{self.angles[k]:g}°"

    def group_count(self) -> tuple[str, int]:
        return "angles", len(self.angles)


@dataclass(frozen=True)
class LabelGroupsOptions(DeclaredOptions):
    """Cluster k mostly holds labels of `groups[k]`, plus `minority_fraction` of others."""

    groups: tuple[tuple[int, ...], ...] = ((0, 1, 8, 9), (2, 3, 4, 5, 6, 7))
    cluster_sizes: tuple[int, ...] | None = None
    minority_fraction: float = option(0.1, Interval(0, 1, closed="left"))

    def validate(self, prefix: str) -> None:
        require(len(self.groups) >= 2, join_key(prefix, "groups"), "needs at least two label groups")
        for k, group in enumerate(self.groups):
            require(len(group) >= 1, join_key(prefix, f"groups[{k}]"), "is empty")
        _check_one_per_entry(self.cluster_sizes, "size", "groups", len(self.groups), join_key(prefix, "cluster_sizes"))

    def cluster_name(self, k: int) -> str:
        return "labels " + ",".join(map(str, self.groups[k]))

    def group_count(self) -> tuple[str, int]:
        return "groups", len(self.groups)


@dataclass(frozen=True)
class ClassSubsetsOptions(DeclaredOptions):
    """Cluster k holds only the classes in `subsets[k]` (uniformly): either `samples_per_client`
    per client, or `cluster_samples[k]` in all, split equally and at random over its clients."""

    subsets: tuple[tuple[int, ...], ...] = (
        (0, 1, 2, 3, 4, 5, 6, 7),
        (2, 3, 4, 5, 6, 7, 8, 9),
        (0, 1, 2, 3, 6, 7, 8, 9),
        (0, 1, 4, 5, 6, 7, 8, 9),
    )
    cluster_sizes: tuple[int, ...] | None = None
    cluster_samples: tuple[int, ...] | None = None

    def validate(self, prefix: str) -> None:
        require(len(self.subsets) >= 1, join_key(prefix, "subsets"), "needs at least one class subset")
        for k, subset in enumerate(self.subsets):
            require(len(subset) >= 1, join_key(prefix, f"subsets[{k}]"), "is empty")
        for name, item in (("cluster_sizes", "size"), ("cluster_samples", "total")):
            _check_one_per_entry(getattr(self, name), item, "subsets", len(self.subsets), join_key(prefix, name))

    def cluster_name(self, k: int) -> str:
        return "classes " + ",".join(map(str, self.subsets[k]))

    def group_count(self) -> tuple[str, int]:
        return "subsets", len(self.subsets)


@dataclass(frozen=True)
class DirichletOptions(DeclaredOptions):
    """Each class is split over clients with proportions ~ Dir(alpha)."""

    alpha: float = option(0.5, above(0))
    min_samples: int = option(10, at_least(2))


@dataclass(frozen=True)
class NaturalOptions(DeclaredOptions):
    """One client per writer (FEMNIST/LEAF); writers drawn at random."""


def _check_one_per_entry(values: Sequence[int] | None, item: str, entries: str, count: int, key: str) -> None:
    """``values``, where given, holds one positive ``item`` (a cluster's size, its sample total) per
    entry of the option ``entries`` (angles, groups, subsets: one per true cluster), ``count`` of them.
    A length that depends on another option is structure, not a range, so it stays code."""
    if values is None:
        return
    require(len(values) == count, key, f"needs one {item} per entry of {entries} ({count}), got {len(values)}")
    require(all(v >= 1 for v in values), key, f"{item}s must be >= 1")


def group_count(options: Any) -> tuple[str, int] | None:
    """The option that sets a partitioner's true clusters (``num_groups``, ``angles``, ...) and how
    many it sets; None for a partitioner without fixed groups (iid, dirichlet, ...)."""
    count = getattr(options, "group_count", None)
    return count() if callable(count) else None


def cluster_names(options: Any, num_clusters: int) -> tuple[str, ...]:
    """What each true cluster is, for plots ("180°", "labels 0,1,8,9"), from the partitioner's
    options; "cluster k" where a partitioner's clusters have no other name."""
    name = getattr(options, "cluster_name", None)
    return tuple(name(k) if callable(name) else f"cluster {k}" for k in range(num_clusters))
