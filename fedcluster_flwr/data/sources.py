"""Where a run's samples come from, by ``dataset.name``: a built-in loader (:mod:`.datasets`,
whose input shape and class count are fixed) or ``hf`` (:mod:`.hf`, which reads them from the
data). The config and the experiment ask these two functions, never a loader."""

from __future__ import annotations

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
