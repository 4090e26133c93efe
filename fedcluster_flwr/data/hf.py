"""``dataset.name: hf``: any image-classification dataset the Hugging Face ``datasets`` library
loads, as the same in-memory pool the built-in loaders give (:class:`~.datasets.DatasetPool`).

Needs the optional extra ``fedcluster-flwr[hf]`` (``datasets``), imported only here and only when
a config names ``hf``. From ``dataset.path``, ``split``, ``image_key`` and ``label_key``:

1. Find the data. A local folder written by ``save_to_disk`` is read with ``load_from_disk``
   (read by ``load_dataset`` it would be one row per file, and fail much later with "partitions >
   samples"); any other local folder or file (parquet, arrow, csv, image folder) with
   ``load_dataset``; a name that is no local path, as a Hub dataset (online only). A relative path
   is looked for in the working directory, then in the data folder (``dataset.data_dir``).
   ``load_dataset`` keeps its cache in ``dataset.cache_dir`` where it is given, else where Hugging
   Face's own variables say (``HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``, else
   ``~/.cache/huggingface/datasets``), as every other Hugging Face program of the user does.
2. Take ``split`` (default ``train``; ``train+test`` joins two, as the built-in pools join theirs).
3. The input shape and class count are read from the data: the first image's shape, and the
   labels' ``ClassLabel`` (its number of names) or, for plain integers, the largest label + 1.
4. Stack the images once: uint8 pixels stay uint8 (scale 255), floats in [0, 1] stay floats
   (scale 1); channel mean and standard deviation are the pool's own.

A missing column, a column that holds no images or no integer labels, an unknown split, a path
that is neither here nor on the Hub (or the Hub offline) is a :class:`ConfigError` naming the
key; a label outside the classes, images of different sizes or pixels out of range a
:class:`DataError` naming the column.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..declarations.schema import ConfigError
from .datasets import DataError, DatasetPool, resolve_data_dir

HF_EXTRA = "fedcluster-flwr[hf]"
DEFAULT_SPLIT = "train"
DEFAULT_IMAGE_KEY = "image"
DEFAULT_LABEL_KEY = "label"
# What save_to_disk writes: a DatasetDict's index, or a single Dataset's state
SAVED_MARKERS = ("dataset_dict.json", "state.json")
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def import_optional(module: str, key: str, what: str) -> Any:
    """``module`` of the ``hf`` extra, or a one-line :class:`ConfigError` on ``key`` naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(key, f"{what} needs the optional extra {HF_EXTRA} (the package "
                               f"'{module.split('.')[0]}' is not installed): pip install '{HF_EXTRA}'") from None


def _datasets() -> Any:
    datasets = import_optional("datasets", "dataset.name", "'hf'")
    datasets.disable_progress_bars()  # a bar per split and shard would drown the run's own output
    return datasets


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def cache_folder(cache_dir: str | None, data_dir: Path) -> Path | None:
    """``dataset.cache_dir``: absolute as given, relative under the data folder; none: None, which
    leaves the cache where ``HF_DATASETS_CACHE`` / ``HF_HOME`` say (the data folder may be read-only)."""
    if cache_dir is None:
        return None
    path = Path(cache_dir).expanduser()
    return path if path.is_absolute() else data_dir / path


def locate(path: str, data_dir: Path) -> Path | None:
    """The local file or folder ``path`` names (a relative one in the working directory, then in
    the data folder), or None."""
    candidate = Path(path).expanduser()
    bases = [Path()] if candidate.is_absolute() else [Path.cwd(), data_dir]
    for base in bases:
        if (base / candidate).exists():
            return (base / candidate).resolve()
    return None


@functools.lru_cache(maxsize=4)
def open_split(path: str, split: str | None, data_dir: str, cache_dir: str | None) -> tuple[Any, str]:
    """(the ``datasets.Dataset`` of ``split`` at ``path``, how messages name it); cached per process."""
    datasets = _datasets()
    root = Path(data_dir)
    local = locate(path, root)
    if local is None:
        if not HUB_NAME.fullmatch(path):
            raise ConfigError("dataset.path", f"no such file or folder: {path} (looked in {Path.cwd()} and "
                                              f"in the data folder {root})")
        return _load(datasets, path, split, root, cache_dir, hub=True), f"the Hub dataset '{path}'"
    if local.is_dir() and any((local / marker).is_file() for marker in SAVED_MARKERS):
        return _load_saved(datasets, local, split), str(local)
    return _load(datasets, str(local), split, root, cache_dir, hub=False), str(local)


def _load(datasets: Any, path: str, split: str | None, root: Path, cache_dir: str | None, hub: bool) -> Any:
    try:
        cache = cache_folder(cache_dir, root)
        return datasets.load_dataset(path, split=split or DEFAULT_SPLIT, cache_dir=None if cache is None else str(cache))
    except ValueError as err:
        if "split" in str(err).lower():
            raise ConfigError("dataset.split", f"{path}: {_one_line(err)}") from None
        raise ConfigError("dataset.path", f"{path}: {_one_line(err)}") from None
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        if hub:
            raise ConfigError(
                "dataset.path",
                f"'{path}' is no local file or folder (looked in {Path.cwd()} and in the data folder {root}) "
                f"and the Hugging Face Hub did not give it ({_one_line(err)}); offline, give the folder a "
                f"save_to_disk or to_parquet wrote",
            ) from None
        raise ConfigError("dataset.path", f"{path}: {_one_line(err)}") from None


def _load_saved(datasets: Any, folder: Path, split: str | None) -> Any:
    """A ``save_to_disk`` folder: one Dataset (no splits) or a DatasetDict (``a+b`` joins splits)."""
    try:
        saved = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as err:
        raise DataError(f"{folder}: load_from_disk cannot read it ({_one_line(err)})") from None
    if isinstance(saved, datasets.Dataset):
        if split is not None:
            raise ConfigError("dataset.split", f"the save_to_disk folder {folder} holds one dataset without "
                                               f"splits: leave dataset.split out")
        return saved
    names = (split or DEFAULT_SPLIT).split("+")
    for name in names:
        if name not in saved:
            raise ConfigError("dataset.split", f"'{name}' is not a split of {folder}; its splits: {', '.join(saved)}")
    parts = [saved[name] for name in names]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _column(dataset: Any, key: str, option: str, where: str) -> Any:
    feature = dataset.features.get(key)
    if feature is None:
        raise ConfigError(option, f"no column '{key}' in {where}; its columns: {', '.join(dataset.column_names)}")
    return feature


def check_image_column(dataset: Any, key: str, where: str) -> None:
    """``key`` names a column of images: an ``Image`` feature, or arrays of numbers (``Array2D``/``Array3D``, nested lists)."""
    feature = _column(dataset, key, "dataset.image_key", where)
    kind = type(feature).__name__
    nested = kind in ("List", "Sequence", "LargeList") and type(getattr(feature, "feature", None)).__name__ in (
        "List", "Sequence", "LargeList")
    if kind not in ("Image", "Array2D", "Array3D") and not nested:
        raise ConfigError("dataset.image_key", f"column '{key}' of {where} holds {feature}, not images (an Image "
                                               f"feature or arrays of pixels); its columns: {', '.join(dataset.column_names)}")


def read_labels(dataset: Any, key: str, where: str) -> tuple[np.ndarray, int]:
    """The labels of column ``key`` as int64, and the class count: a ``ClassLabel``'s number of
    names, else the largest label + 1. A label outside 0..count - 1 is a :class:`DataError`."""
    feature = _column(dataset, key, "dataset.label_key", where)
    kind = type(feature).__name__
    if kind == "ClassLabel":
        num_classes = feature.num_classes
    elif kind == "Value" and str(feature.dtype).startswith(("int", "uint")):
        num_classes = None
    else:
        raise ConfigError("dataset.label_key", f"column '{key}' of {where} holds {feature}, not class labels "
                                               f"(a ClassLabel or integers); its columns: {', '.join(dataset.column_names)}")
    labels = np.asarray(dataset.select_columns([key]).with_format("numpy")[key][:], dtype=np.int64)
    if len(labels) == 0:
        raise DataError(f"{where}: the split holds no samples")
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    outside = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(outside):
        row = int(outside[0])
        raise DataError(f"{where}: column '{key}' holds label {int(labels[row])} at row {row} ({len(outside)} "
                        f"such rows), outside the classes 0..{num_classes - 1}")
    return labels, num_classes


def _first_image_shape(dataset: Any, key: str) -> tuple[int, int, int]:
    return _channels_first(np.asarray(dataset.select_columns([key]).with_format("numpy")[key][0])[None],
                           type(dataset.features[key]).__name__ == "Image").shape[1:]  # type: ignore[return-value]


def _channels_first(images: np.ndarray, pil_layout: bool) -> np.ndarray:
    """(N, C, H, W) of decoded images: PIL's (H, W) or (H, W, C); arrays as (H, W) or (C, H, W)."""
    if images.ndim == 3:
        return images[:, None]
    if images.ndim == 4:
        return images.transpose(0, 3, 1, 2) if pil_layout else images
    raise ValueError(f"images of {images.ndim - 1} dimensions {images.shape[1:]}: expected (H, W) or "
                     f"{'(H, W, C)' if pil_layout else '(C, H, W)'}")


@functools.lru_cache(maxsize=4)
def hf_facts(path: str, split: str | None, image_key: str, label_key: str, data_dir: str, cache_dir: str | None
             ) -> tuple[tuple[int, int, int], int]:
    """(input shape (C, H, W), class count), read from the columns' types, the labels and the first
    image (the config checks the model against them before any image is stacked)."""
    dataset, where = open_split(path, split, data_dir, cache_dir)
    check_image_column(dataset, image_key, where)
    _, num_classes = read_labels(dataset, label_key, where)
    try:
        shape = _first_image_shape(dataset, image_key)
    except ValueError as err:
        raise DataError(f"{where}: column '{image_key}': {err}") from None
    return shape, num_classes


@functools.lru_cache(maxsize=2)
def load_hf_pool(path: str, split: str | None, image_key: str, label_key: str, data_dir: str, cache_dir: str | None
                 ) -> DatasetPool:
    """The pool of the split: every image decoded and stacked once (per process)."""
    dataset, where = open_split(path, split, data_dir, cache_dir)
    check_image_column(dataset, image_key, where)
    labels, num_classes = read_labels(dataset, label_key, where)
    decoded = dataset.select_columns([image_key]).with_format("numpy")[image_key][:]
    if not isinstance(decoded, np.ndarray) or decoded.dtype == object:
        shapes = sorted({np.shape(image) for image in decoded}, key=str)
        raise DataError(f"{where}: the images of column '{image_key}' differ in shape ({shapes[0]} and {shapes[1]}, "
                        f"(H, W[, C])): resize them to one size")
    try:
        images = _channels_first(decoded, type(dataset.features[image_key]).__name__ == "Image")
    except ValueError as err:
        raise DataError(f"{where}: column '{image_key}': {err}") from None
    low, high = images.min(), images.max()
    if np.issubdtype(images.dtype, np.integer) and low >= 0 and high <= 255:
        pixels, scale = torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8)), 255.0
    elif np.issubdtype(images.dtype, np.floating) and low >= 0 and high <= 1:
        pixels, scale = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)), 1.0
    else:
        raise DataError(f"{where}: column '{image_key}' holds {images.dtype} pixels from {low} to {high}: expected "
                        f"integers 0..255 or floats in [0, 1]")
    mean, std = channel_stats(images, scale)
    return DatasetPool("hf", pixels, labels, num_classes, scale, mean, std)


def channel_stats(images: np.ndarray, scale: float, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of ``images / scale`` (N, C, H, W), in float64
    chunks (a float copy of the whole pool would be 8x its uint8 size)."""
    total = np.zeros(images.shape[1])
    squares = np.zeros(images.shape[1])
    for start in range(0, len(images), chunk):
        part = images[start:start + chunk].astype(np.float64) / scale
        total += part.sum(axis=(0, 2, 3))
        squares += np.square(part).sum(axis=(0, 2, 3))
    count = images.shape[0] * images.shape[2] * images.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    # a channel of one value has std 0: the model's input (x - mean) / std would divide by zero
    return tuple(map(float, mean)), tuple(float(max(s, 1e-6)) for s in std)


def dataset_key(dataset: Any) -> tuple[str, str | None, str, str, str, str | None]:
    """The arguments of :func:`hf_facts` / :func:`load_hf_pool` for a ``dataset`` config section."""
    return (dataset.path, dataset.split, dataset.image_key or DEFAULT_IMAGE_KEY, dataset.label_key or DEFAULT_LABEL_KEY,
            str(resolve_data_dir(dataset.data_dir)), dataset.cache_dir)
