"""Where a run's samples come from, by ``dataset.name``: a built-in loader (:mod:`.datasets`,
whose input shape and class count are fixed) or ``hf`` (:mod:`.hf`, which reads them from the
data). The config and the experiment ask these two functions, never a loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .datasets import DATASETS, DatasetPool, load_pool

HF = "hf"
DATASET_SOURCES: dict[str, str] = {
    **{name: "built-in loader" for name in DATASETS},
    HF: "any image-classification dataset of the Hugging Face datasets library (extra fedcluster-flwr[hf])",
}


def dataset_shape(dataset: Any) -> tuple[tuple[int, int, int], int]:
    """(input shape (C, H, W), class count) of a ``dataset`` config section."""
    if dataset.name == HF:
        from .hf import dataset_key, hf_facts

        return hf_facts(*dataset_key(dataset))
    facts = DATASETS[dataset.name]
    return facts.input_shape, facts.num_classes


def dataset_pool(dataset: Any) -> DatasetPool:
    """The pool of a ``dataset`` config section, loaded once per process."""
    if dataset.name == HF:
        from .hf import dataset_key, load_hf_pool

        return load_hf_pool(*dataset_key(dataset))
    return load_pool(dataset.name, dataset.data_dir, dataset.download)


@dataclass(frozen=True)
class InputFormat:
    """What the experiment's model takes, and how 8-bit pixels become its inputs: scaled to [0, 1],
    then ``(x - mean) / std`` per channel. ``mean``/``std`` are None where a device cannot know
    them (``dataset.name: hf`` standardised by the pool's own statistics): its 8-bit images are then
    refused with the reason, and float arrays (``export-partitions``) are taken as they are."""

    dataset: str
    shape: tuple[int, int, int]
    num_classes: int
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def builtin(cls, dataset: str, scaling: str = "standardized") -> InputFormat:
        """A built-in dataset's format (``dataset.scaling``: standardized by its mean and std, or unit)."""
        facts = DATASETS[dataset]
        return cls(dataset, facts.input_shape, facts.num_classes, *normalization(facts.mean, facts.std, scaling))


def normalization(mean: tuple[float, ...], std: tuple[float, ...], scaling: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) that turn [0, 1] pixels into model inputs under ``dataset.scaling``."""
    return (mean, std) if scaling == "standardized" else ((0.0,) * len(mean), (1.0,) * len(std))


def input_format(config: Any) -> InputFormat:
    """The model inputs of an experiment config, as a device without the pool can know them."""
    dataset = config.dataset
    if dataset.name != HF:
        return InputFormat.builtin(dataset.name, dataset.scaling)
    shape, num_classes = tuple(config.input_shape), config.num_classes
    if dataset.scaling == "standardized":  # the pool's own statistics: only the whole dataset has them
        return InputFormat(HF, shape, num_classes, None, None)
    return InputFormat(HF, shape, num_classes, *normalization((0.0,) * shape[0], (1.0,) * shape[0], "unit"))
