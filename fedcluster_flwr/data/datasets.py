"""Dataset loaders: one in-memory pool of images and labels per dataset, cached per process.

A pool joins a dataset's official train and test splits; partitioners then give
every client a local train and test split drawn from the same distribution.
Images stay in their compact on-disk dtype (uint8 for MNIST-like data) and are
converted to normalized float tensors only for the samples a client uses.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .cifar_pickle import RefusedPickle, load_batch
from .partitions import ClientTransform

DATA_DIR_ENV = "FEDCLUSTER_DATA_DIR"


@dataclass(frozen=True)
class DatasetFacts:
    """What is known of a dataset without loading it: the config checks models against these."""

    input_shape: tuple[int, int, int]  # (C, H, W) of one image
    num_classes: int
    mean: tuple[float, ...]  # per channel, of images scaled to [0, 1]: the model's inputs are (x - mean) / std
    std: tuple[float, ...]


DATASETS: dict[str, DatasetFacts] = {
    "digits": DatasetFacts((1, 8, 8), 10, (0.305,), (0.375,)),
    "mnist": DatasetFacts((1, 28, 28), 10, (0.1307,), (0.3081,)),
    "fashion_mnist": DatasetFacts((1, 28, 28), 10, (0.2860,), (0.3530,)),
    "cifar10": DatasetFacts((3, 32, 32), 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "femnist": DatasetFacts((1, 28, 28), 62, (0.9637,), (0.1592,)),
}


class DataError(RuntimeError):
    """Dataset files are missing or malformed; the message says where and what."""


@dataclass(frozen=True, eq=False)
class DatasetPool:
    """All samples of a dataset: ``images`` (N, C, H, W) and integer ``labels`` (N,)."""

    name: str
    images: torch.Tensor
    labels: np.ndarray
    num_classes: int
    scale: float  # images / scale lies in [0, 1]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    writers: np.ndarray | None = None  # per-sample writer id (FEMNIST)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def tensors(
        self, indices: np.ndarray, transform: ClientTransform = ClientTransform(), standardize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float images and int64 labels of ``indices``, as a client sees them: scaled to [0, 1] and,
        with ``standardize`` (``dataset.scaling: standardized``), normalized by the dataset's mean and std."""
        index = torch.as_tensor(indices, dtype=torch.long)
        # index_select copies whole images; indexing with a tensor (images[index]) took ~7x as
        # long, and on the Ray engine the ClientApp builds a client for every message it gets
        x = self.images.index_select(0, index).to(torch.float32).div_(self.scale)
        y = torch.as_tensor(self.labels[indices], dtype=torch.long)
        rotated = transform.rotation % 360 != 0
        after = rotated and transform.rotation_fill == "normalized_zero"
        if rotated and not after:
            x = rotate(x, transform.rotation)  # before normalizing: corners are raw 0 (black)
        if transform.label_map is not None:
            y = torch.as_tensor(transform.label_map, dtype=torch.long)[y]
        if standardize:
            mean = torch.tensor(self.mean).view(1, -1, 1, 1)
            std = torch.tensor(self.std).view(1, -1, 1, 1)
            x = x.sub_(mean).div_(std)  # in place: the same arithmetic without two temporaries
        if after:
            # after normalizing, as the DAC reference (main_fed.py: Normalize, then RandomRotation):
            # corners are 0 in the model's input space (RotationOptions explains)
            x = rotate(x, transform.rotation)
        return x, y


def rotate(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """Rotate a batch (N, C, H, W) counter-clockwise; exact for multiples of 90 degrees."""
    if degrees % 90 == 0:
        return torch.rot90(images, k=int(degrees // 90) % 4, dims=(2, 3))
    from torchvision.transforms.functional import InterpolationMode
    from torchvision.transforms.functional import rotate as tv_rotate

    return tv_rotate(images, degrees, interpolation=InterpolationMode.BILINEAR)


def resolve_data_dir(data_dir: str | None) -> Path:
    """``dataset.data_dir``, else ``$FEDCLUSTER_DATA_DIR``, else the user cache dir."""
    if data_dir:
        return Path(data_dir).expanduser().resolve()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser().resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return (cache / "fedcluster" / "data").resolve()


def load_pool(name: str, data_dir: str | None = None, download: bool = False) -> DatasetPool:
    """Load dataset ``name`` once per process (the ClientApp builds a client per message on the Ray engine)."""
    root = None if name == "digits" else str(resolve_data_dir(data_dir))
    return _load_pool(name, root, download)


@functools.lru_cache(maxsize=4)
def _load_pool(name: str, data_dir: str | None, download: bool) -> DatasetPool:
    if name == "digits":
        return _load_digits()
    root = Path(data_dir or ".")
    if name in ("mnist", "fashion_mnist"):
        return _load_torchvision_gray(name, root, download)
    if name == "cifar10":
        return _load_cifar10(root, download)
    if name == "femnist":
        return _load_femnist(root)
    raise DataError(f"unknown dataset '{name}'; available: {', '.join(DATASETS)}")


def _load_digits() -> DatasetPool:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    return DatasetPool(
        name="digits",
        images=images,
        labels=bunch.target.astype(np.int64),
        num_classes=DATASETS["digits"].num_classes,
        scale=16.0,
        mean=DATASETS["digits"].mean,
        std=DATASETS["digits"].std,
    )


_TORCHVISION_GRAY = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}  # name: torchvision class name


# torchvision's raw files of MNIST and Fashion-MNIST: name -> (IDX magic number, dimensions after the count)
_IDX_FILES = {
    "train-images-idx3-ubyte": (0x0803, (28, 28)),
    "train-labels-idx1-ubyte": (0x0801, ()),
    "t10k-images-idx3-ubyte": (0x0803, (28, 28)),
    "t10k-labels-idx1-ubyte": (0x0801, ()),
}


def _missing_data_message(name: str, raw: Path, root: Path, missing: list[str]) -> str:
    """What to do about missing MNIST-like files: where they were expected, and where similar files
    were found instead (a folder too deep or too shallow, only the .gz archives)."""
    where = "" if root.is_dir() else f" (the data folder {root} does not exist)"
    head = f"{name}: missing {', '.join(missing)} in {raw}{where}"
    for folder in (root, root / "raw", raw.parent, *(p for p in root.glob("*/raw") if p != raw)):
        if folder != raw and all((folder / f).is_file() for f in missing):
            return f"{head}; they are in {folder}: move them to {raw} (torchvision's layout)"
    if all((raw / f"{f}.gz").is_file() for f in missing):
        return f"{head}; only their .gz archives are there: unpack them (gunzip -k {raw}/*.gz)"
    return (
        f"{head}. Put the torchvision files there, point dataset.data_dir or ${DATA_DIR_ENV} at their "
        "parent folder, or set dataset.download: true when online."
    )


def check_idx_files(name: str, raw: Path, root: Path) -> None:
    """The four IDX files of MNIST/Fashion-MNIST in ``raw``, checked from their headers and sizes:
    present, each an IDX file of the right kind, neither empty nor cut inside its header, whose
    size is what its header promises, as many labels as images, and every label one of the
    dataset's classes (the label files are read whole: 70,000 bytes). Raises a :class:`DataError`
    naming the file and what is wrong with it (sizes in bytes: what it is, what it should be)."""
    check_files_are_files(name, [raw / f for f in _IDX_FILES])
    missing = [f for f in _IDX_FILES if not (raw / f).is_file()]
    if missing:
        raise DataError(_missing_data_message(name, raw, root, missing))
    counts = {}
    for file, (magic, dims) in _IDX_FILES.items():
        path = raw / file
        kind = "image" if dims else "label"
        size = path.stat().st_size
        header_size = 4 * (2 + len(dims))
        item_size = int(np.prod(dims, dtype=np.int64))
        with open(path, "rb") as handle:
            header = handle.read(header_size)
        words = [int.from_bytes(header[i:i + 4], "big") for i in range(0, len(header) - len(header) % 4, 4)]
        if size == 0:
            raise DataError(f"{name}: {path} is empty (0 bytes; an IDX {kind} file holds a {header_size}-byte header, "
                            f"then {item_size} byte(s) per {kind}): replace it")
        if header[:4] != magic.to_bytes(4, "big")[:len(header[:4])]:  # a file cut inside the magic number is judged by what is there
            raise DataError(f"{name}: {path} is not an IDX {kind} file "
                            f"(magic number 0x{magic:08x} expected, got 0x{header[:4].hex()}); replace it")
        if size < header_size:
            promise = f"; its header promises {words[1]} {kind}s, {header_size + words[1] * item_size} bytes" if len(words) > 1 else ""
            raise DataError(f"{name}: {path} is truncated inside its header ({size} bytes, the header alone is "
                            f"{header_size}{promise}): replace it")
        if tuple(words[2:]) != dims:
            raise DataError(f"{name}: {path} holds items of shape {tuple(words[2:])}, expected {dims}; replace it")
        count = words[1]
        expected = header_size + count * item_size
        if size != expected:
            raise DataError(
                f"{name}: {path} is {'truncated' if size < expected else 'longer than its header says'} "
                f"({size} bytes; its header promises {count} items, {expected} bytes): replace it"
            )
        if count == 0:
            raise DataError(f"{name}: {path} is empty: its header says it holds no {kind}s ({size} bytes); replace it")
        if not dims:
            check_labels(np.fromfile(path, dtype=np.uint8, offset=header_size), DATASETS[name].num_classes, f"{name}: {path}")
        counts[file] = count
    for split in ("train", "t10k"):
        images, labels = counts[f"{split}-images-idx3-ubyte"], counts[f"{split}-labels-idx1-ubyte"]
        if images != labels:
            raise DataError(f"{name}: {raw / f'{split}-labels-idx1-ubyte'} holds {labels} labels for "
                            f"{images} images in {split}-images-idx3-ubyte: the two files do not belong together")


def check_files_are_files(name: str, paths: Sequence[Path]) -> None:
    """Each of ``paths`` that exists is a regular file: a folder (or a device, a FIFO) of a data
    file's name is named as what it is, not reported missing (nor opened)."""
    for path in paths:
        if path.is_dir():
            raise DataError(f"{name}: {path} is a folder, expected the file {path.name}; put the file there instead")
        if path.exists() and not path.is_file():
            raise DataError(f"{name}: {path} is not a regular file (a device, FIFO or socket); put the file there instead")


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Every label a class index 0..``num_classes`` - 1; else a :class:`DataError` on ``where``
    (the file) naming the first label that is not (a model cannot learn a class it has no output
    for: such a run trained on nothing and reported no accuracy)."""
    outside = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if outside.size:
        first = outside[0]
        raise DataError(f"{where} holds label {labels[first]} (item {first}, one of {outside.size} outside the classes); "
                        f"the dataset's classes are 0..{num_classes - 1}: the file is damaged or of another dataset")


def check_folders(name: str, root: Path, inside: Sequence[str] = ()) -> None:
    """``root`` (the data folder) and the folders ``inside`` it on the way to the files, where they
    exist, are folders: a file where a folder is expected is named as such, not reported missing."""
    folder = root
    for part in ("", *inside):
        folder = folder / part
        if folder.exists() and not folder.is_dir():
            whose = f" (dataset.data_dir, or ${DATA_DIR_ENV}: the folder that holds {Path(*inside)}/)" if inside and folder == root else ""
            raise DataError(f"{name}: {folder} is a file, expected a folder{whose}")


def _load_torchvision_gray(name: str, root: Path, download: bool) -> DatasetPool:
    import torchvision

    class_name = _TORCHVISION_GRAY[name]
    dataset_cls = getattr(torchvision.datasets, class_name)
    raw = root / class_name / "raw"
    check_folders(name, root, (class_name, "raw"))
    if download:
        try:
            dataset_cls(str(root), train=True, download=True)
        except (RuntimeError, OSError) as err:
            raise DataError(f"{name}: could not download into {raw} ({' '.join(str(err).split())})") from None
    check_idx_files(name, raw, root)
    try:
        splits = [dataset_cls(str(root), train=train, download=False) for train in (True, False)]
    except (RuntimeError, AssertionError, ValueError, OSError) as err:  # files the header check could not tell
        raise DataError(f"{name}: torchvision cannot read the files in {raw} ({' '.join(str(err).split())})") from None
    images = torch.cat([s.data for s in splits]).unsqueeze(1)
    labels = torch.cat([s.targets for s in splits]).numpy().astype(np.int64)
    facts = DATASETS[name]
    return DatasetPool(name, images, labels, facts.num_classes, 255.0, facts.mean, facts.std)


CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def _load_cifar10(root: Path, download: bool) -> DatasetPool:
    folder = root / CIFAR_FOLDER
    check_folders("cifar10", root, (CIFAR_FOLDER,))
    if download and not folder.is_dir():
        import torchvision

        torchvision.datasets.CIFAR10(str(root), train=True, download=True)
    check_files_are_files("cifar10", [folder / b for b in CIFAR_BATCHES])
    missing = [b for b in CIFAR_BATCHES if not (folder / b).is_file()]
    if missing:
        raise DataError(
            f"cifar10: missing {', '.join(missing)} in {folder}. Extract the python version "
            f"of CIFAR-10 (cifar-10-python.tar.gz) there, point dataset.data_dir or "
            f"${DATA_DIR_ENV} at its parent folder, or set dataset.download: true when online."
        )
    batches = [_cifar_batch(folder / batch) for batch in CIFAR_BATCHES]
    return DatasetPool(
        name="cifar10",
        images=torch.from_numpy(np.concatenate([images for images, _ in batches])),
        labels=np.concatenate([labels for _, labels in batches]),
        num_classes=DATASETS["cifar10"].num_classes,
        scale=255.0,
        mean=DATASETS["cifar10"].mean,
        std=DATASETS["cifar10"].std,
    )


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) and labels of one python batch, read without running anything the
    file asks for (:mod:`.cifar_pickle`) and checked: pixels 0..255, one label per image, each a class."""
    try:
        entry = load_batch(path)
    except RefusedPickle as err:
        raise DataError(f"cifar10: {path} is not a CIFAR-10 python batch: {err} (refused unrun); replace it") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
            KeyError, MemoryError) as err:
        raise DataError(f"cifar10: {path} is truncated or not a pickle ({type(err).__name__}: "
                        f"{' '.join(str(err).split())}); replace it") from None
    if isinstance(entry, dict):  # Python 3 copies of the batches may hold bytes keys (pickled after encoding="bytes")
        entry = {key.decode("latin1") if isinstance(key, bytes) else key: value for key, value in entry.items()}
    try:
        data = np.asarray(entry["data"])
        labels = np.asarray(entry["labels"] if "labels" in entry else entry["fine_labels"])
        if data.dtype.kind not in "ui" or data.size and (data.min() < 0 or data.max() > 255):
            raise ValueError(f"data: expected 8-bit pixels, got {data.dtype} values")
        images = data.astype(np.uint8).reshape(-1, *DATASETS["cifar10"].input_shape)
        if labels.ndim != 1 or labels.dtype.kind not in "ui" or len(labels) != len(images):
            raise ValueError(f"labels: expected {len(images)} integers, one per image, got {labels.dtype} of shape {labels.shape}")
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"cifar10: {path} is not a CIFAR-10 python batch ({' '.join(str(err).split())})") from None
    check_labels(labels, DATASETS["cifar10"].num_classes, f"cifar10: {path}")
    return images, labels.astype(np.int64)


def _femnist_json_files(root: Path) -> list[Path]:
    check_folders("femnist", root, ("femnist",))
    for base in (root / "femnist", root / "femnist" / "data"):
        files = sorted(base.glob("train/*.json")) + sorted(base.glob("test/*.json"))
        if files:
            return files
    raise DataError(
        f"femnist: no LEAF JSON files under {root / 'femnist'}/train/ (or femnist/data/train/). "
        f"Run LEAF's femnist preprocessing and copy its data/train and data/test folders there."
    )


def _load_femnist(root: Path) -> DatasetPool:
    """LEAF FEMNIST: JSON files with ``users``, ``num_samples`` and ``user_data[u] = {x, y}``."""
    writer_ids: dict[str, int] = {}
    images, labels, writers = [], [], []
    for path in _femnist_json_files(root):
        try:
            blob = json.loads(path.read_text())
            for user in blob["users"]:
                record = blob["user_data"][user]
                x = np.asarray(record["x"], dtype=np.float32).reshape(-1, *DATASETS["femnist"].input_shape)
                y = np.asarray(record["y"])
                if len(x) != len(y):
                    raise ValueError(f"user {user}: {len(x)} images but {len(y)} labels")
                if y.size and y.dtype.kind not in "ui" or y.ndim != 1:
                    raise ValueError(f"user {user}: labels must be integers, got {y.dtype} of shape {y.shape}")
                if not np.isfinite(x).all() or x.size and (x.min() < 0 or x.max() > 1):
                    raise ValueError(f"user {user}: pixels must lie in [0, 1] (LEAF's scale)")
                check_labels(y, DATASETS["femnist"].num_classes, f"femnist: {path}: user {user}")
                writer = writer_ids.setdefault(user, len(writer_ids))
                images.append(x)
                labels.append(y.astype(np.int64))
                writers.append(np.full(len(y), writer, dtype=np.int64))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"femnist: {path} is not a LEAF FEMNIST file ({err})") from None
    all_labels = np.concatenate(labels)
    return DatasetPool(
        name="femnist",
        images=torch.from_numpy(np.concatenate(images)),
        labels=all_labels,
        num_classes=DATASETS["femnist"].num_classes,
        scale=1.0,
        mean=DATASETS["femnist"].mean,
        std=DATASETS["femnist"].std,
        writers=np.concatenate(writers),
    )
