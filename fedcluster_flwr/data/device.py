"""A device's own data: what a real SuperNode started with ``data-dir`` trains and evaluates on
(:mod:`fedcluster_flwr.cli.export` writes a simulated experiment's partitions in this format).

A data folder holds either

* ``data.npz`` with ``x_train, y_train, x_test, y_test`` (optionally ``x_val, y_val``): float
  arrays are the model's inputs exactly as they are (``export-partitions`` writes these, so a
  device replays the simulated client bit for bit); ``uint8`` arrays are 8-bit pixels, treated
  like PNG files. Images are ``(N, C, H, W)`` (or ``(N, H, W)`` for one channel), labels integers.
* an ImageFolder-style tree ``train/<label>/*.png`` and ``test/<label>/*.png`` (optionally
  ``val/``), ``<label>`` being the class index (``0`` .. ``num_classes - 1``). Pixels are scaled
  to [0, 1] and standardised with the dataset's per-channel mean and std
  (:class:`~fedcluster_flwr.data.DatasetFacts`), as the simulation does.

Both are checked against the model's input shape and number of classes; a mismatch is one
:class:`DataError` line naming the file.

Node config of a SuperNode (``--node-config``), read by :func:`node_data_source`:

* ``partition-id=<i> num-partitions=<n>``: partition ``i`` of the experiment's dataset, as in
  simulation;
* ``data-dir='<folder>' client-id=<i> [cluster-id=<c>]``: the folder's data. ``client-id`` is
  the client's slot in the experiment (``0`` .. ``partition.num_clients - 1``): the server knows
  clients by that id (the directory asks each client for it once), samples, assigns and records
  them by it. ``cluster-id`` is the device's true cluster, if known; without it the run's
  clustering scores against the true clusters (purity, ARI, NMI) say ``unavailable``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..client import ClientData, ClusterClient
from ..protocol import OWN_DATA, TRAIN_EXAMPLES, TRUE_CLUSTER
from .datasets import DataError
from .sources import InputFormat

NPZ_FILE = "data.npz"
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "test", "val")  # val is optional
IMAGE_SUFFIXES = (".png",)

# Node-config keys (Flower's kebab-case).
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DATA_DIR = "data-dir"
CLIENT_ID = "client-id"
CLUSTER_ID = "cluster-id"
NODE_CONFIG_KEYS = (PARTITION_ID, NUM_PARTITIONS, DATA_DIR, CLIENT_ID, CLUSTER_ID)


class NodeConfigError(ValueError):
    """The SuperNode's ``--node-config`` does not say which data to use."""


@dataclass(frozen=True)
class PartitionSource:
    """Partition ``pid`` of the experiment's dataset (simulation, or a SuperNode with a partition id)."""

    pid: int
    num_partitions: int


@dataclass(frozen=True)
class FolderSource:
    """The data in ``data_dir`` on this device, as client ``client_id`` (true cluster if known)."""

    data_dir: Path
    client_id: int
    cluster_id: int | None = None


def node_data_source(node_config: Mapping[str, Any]) -> PartitionSource | FolderSource:
    """Which data this node trains on, from its node config; a bad node config is a one-line
    :class:`NodeConfigError` saying what to pass instead."""
    unknown = sorted(set(node_config) - set(NODE_CONFIG_KEYS))
    if unknown:
        raise NodeConfigError(
            f"node config: unknown key(s) {', '.join(unknown)}; expected "
            f"'{PARTITION_ID}=<i> {NUM_PARTITIONS}=<n>' or \"{DATA_DIR}='<folder>' {CLIENT_ID}=<i> [{CLUSTER_ID}=<c>]\""
        )
    if DATA_DIR in node_config:
        if PARTITION_ID in node_config or NUM_PARTITIONS in node_config:
            raise NodeConfigError(
                f"node config: give either {DATA_DIR} (this device's own data) or {PARTITION_ID}/"
                f"{NUM_PARTITIONS} (a partition of the experiment's dataset), not both"
            )
        if CLIENT_ID not in node_config:
            raise NodeConfigError(
                f"node config: {DATA_DIR} needs {CLIENT_ID}=<i>, this device's client id in the experiment "
                f"(0 .. partition.num_clients - 1)"
            )
        cluster = node_config.get(CLUSTER_ID)
        return FolderSource(
            Path(str(node_config[DATA_DIR])).expanduser(),
            _int_entry(node_config, CLIENT_ID),
            None if cluster is None else _int_entry(node_config, CLUSTER_ID),
        )
    for key in (CLIENT_ID, CLUSTER_ID):
        if key in node_config:
            raise NodeConfigError(f"node config: {key} goes with {DATA_DIR}; a partition is named by {PARTITION_ID}")
    if PARTITION_ID not in node_config or NUM_PARTITIONS not in node_config:
        raise NodeConfigError(
            f"node config lacks '{PARTITION_ID}' and '{NUM_PARTITIONS}' (or '{DATA_DIR}'); start the SuperNode with "
            f"--node-config '{PARTITION_ID}=<i> {NUM_PARTITIONS}=<n>' or "
            f"--node-config \"{DATA_DIR}='<folder>' {CLIENT_ID}=<i>\""
        )
    return PartitionSource(_int_entry(node_config, PARTITION_ID), _int_entry(node_config, NUM_PARTITIONS))


def _int_entry(node_config: Mapping[str, Any], key: str) -> int:
    value = node_config[key]
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(r"-?\d+", str(value)):
        raise NodeConfigError(f"node config: {key}={value!r}, expected an integer")
    number = int(value)
    if number < 0:
        raise NodeConfigError(f"node config: {key}={number}, expected an integer >= 0")
    return number


# ---- loading a device's data folder ------------------------------------------------------------


def load_device_data(data_dir: Path | str, inputs: InputFormat) -> ClientData:
    """The data in ``data_dir`` for a model that takes ``inputs``; loaded once per process (a
    SuperNode's ClientApp builds a client for every message it gets)."""
    return _load_device_data(str(Path(data_dir).expanduser().resolve()), inputs)


@functools.lru_cache(maxsize=4)
def _load_device_data(data_dir: str, inputs: InputFormat) -> ClientData:
    folder = Path(data_dir)
    if not folder.is_dir():
        problem = "is a file, expected a folder" if folder.exists() else "does not exist"
        raise DataError(f"{folder}: {problem} (data-dir of this SuperNode: the folder holding {NPZ_FILE} or train/ and test/)")
    if (folder / NPZ_FILE).is_file():
        splits = _read_npz(folder / NPZ_FILE, inputs)
    elif (folder / "train").is_dir():
        splits = {split: _read_image_folder(folder / split, inputs) for split in SPLITS if (folder / split).is_dir()}
    else:
        raise DataError(f"{folder}: no {NPZ_FILE} and no train/<label>/*.png folder (data-dir of this SuperNode)")
    for split in ("train", "test"):
        if split not in splits:
            raise DataError(f"{folder / split}: missing; a device needs a train and a test split")
        if len(splits[split][1]) == 0:
            raise DataError(f"{folder / split}: no samples")
    val = splits.get("val", (None, None))
    return ClientData(*splits["train"], *splits["test"], *val)


def _read_npz(path: Path, inputs: InputFormat) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a readable .npz ({err})") from None
    splits = {}
    for split in SPLITS:
        x_key, y_key = f"x_{split}", f"y_{split}"
        if x_key not in arrays and y_key not in arrays and split == "val":
            continue
        for key in (x_key, y_key):
            if key not in arrays:
                raise DataError(f"{path}: lacks '{key}' (expected x_train, y_train, x_test, y_test)")
        splits[split] = (
            _images(arrays[x_key], inputs, f"{path}: {x_key}"),
            _labels(arrays[y_key], len(arrays[x_key]), inputs.num_classes, f"{path}: {y_key}"),
        )
    return splits


def _images(x: np.ndarray, inputs: InputFormat, where: str) -> torch.Tensor:
    """Model inputs from float images (as they are) or 8-bit pixels (scaled and normalised)."""
    shape = inputs.shape
    if x.ndim == 3 and shape[0] == 1:
        x = x[:, None]
    if x.ndim != 4 or tuple(x.shape[1:]) != shape:
        raise DataError(f"{where} has shape {x.shape}, but the model takes {inputs.dataset} images (N, {', '.join(map(str, shape))})")
    if x.dtype == np.uint8:
        return _normalise(torch.from_numpy(x.astype(np.float32) / 255.0), inputs, where)
    if x.dtype != np.float32:
        raise DataError(f"{where} has dtype {x.dtype}; expected float32 model inputs or uint8 pixels")
    if not np.isfinite(x).all():
        raise DataError(f"{where} holds NaN or infinite values")
    return torch.from_numpy(np.ascontiguousarray(x))


def _normalise(x: torch.Tensor, inputs: InputFormat, where: str) -> torch.Tensor:
    if inputs.mean is None or inputs.std is None:
        raise DataError(
            f"{where}: 8-bit images of dataset {inputs.dataset} are standardised by the whole dataset's mean and "
            "std, which a device cannot compute: give it the float arrays of `fedcluster export-partitions` "
            "(data.npz), or run the experiment with dataset.scaling: unit")
    mean = torch.tensor(inputs.mean).view(1, -1, 1, 1)
    std = torch.tensor(inputs.std).view(1, -1, 1, 1)
    return (x - mean) / std


def _labels(y: np.ndarray, count: int, num_classes: int, where: str) -> torch.Tensor:
    if y.ndim != 1 or len(y) != count:
        raise DataError(f"{where} has shape {y.shape}; expected ({count},), one label per image")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where} has dtype {y.dtype}; expected integer class labels")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"{where} holds labels {int(y.min())}..{int(y.max())}; the model has {num_classes} classes (0..{num_classes - 1})")
    return torch.from_numpy(y.astype(np.int64))


def _read_image_folder(root: Path, inputs: InputFormat) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image

    channels, height, width = inputs.shape
    num_classes = inputs.num_classes
    mode = {1: "L", 3: "RGB"}[channels]
    images, labels = [], []
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if not label_dir.name.isdigit() or int(label_dir.name) >= num_classes:
            raise DataError(f"{label_dir}: a label folder must be a class index 0..{num_classes - 1}")
        for file in sorted(p for p in label_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            try:
                with Image.open(file) as image:
                    pixels = np.asarray(image.convert(mode), dtype=np.uint8)
            except OSError as err:
                raise DataError(f"{file}: not a readable image ({err})") from None
            if pixels.shape[:2] != (height, width):
                raise DataError(f"{file} is {pixels.shape[1]}x{pixels.shape[0]} pixels; {inputs.dataset} images are {width}x{height}")
            images.append(pixels.reshape(height, width, channels).transpose(2, 0, 1))
            labels.append(int(label_dir.name))
    if not images:
        return torch.empty((0, channels, height, width)), torch.empty(0, dtype=torch.long)
    x = torch.from_numpy(np.stack(images).astype(np.float32) / 255.0)
    return _normalise(x, inputs, str(root)), torch.as_tensor(labels, dtype=torch.long)


class DeviceClient(ClusterClient):
    """A client on a device's own data: it also tells the server where its data come from, how
    many training examples it holds (the server refuses replies claiming more) and its true
    cluster, where the device knows it."""

    def __init__(self, *args: Any, cluster_id: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_id = cluster_id

    def identity(self) -> dict[str, int]:
        return super().identity() | {
            OWN_DATA: 1, TRAIN_EXAMPLES: self.num_train, TRUE_CLUSTER: -1 if self.cluster_id is None else self.cluster_id}
