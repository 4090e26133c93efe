"""Dataset pools: digits, MNIST/Fashion-MNIST from $FEDCLUSTER_DATA_DIR, and CIFAR-10 and
FEMNIST from tiny files written here in their real on-disk formats. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcluster_flwr.data import ClientTransform, DataError, load_pool, make_partition, resolve_data_dir
from fedcluster_flwr.data.datasets import DATA_DIR_ENV, _load_pool
from fedcluster_flwr.data.partition_options import NaturalOptions
from helpers import CIFAR_BATCHES, write_cifar

# ---- digits ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return load_pool("digits")


def test_digits_pool(digits):
    assert digits.name == "digits"
    assert tuple(digits.images.shape) == (1797, 1, 8, 8)
    assert digits.input_shape == (1, 8, 8)
    assert digits.labels.shape == (1797,)
    assert digits.num_classes == 10
    assert sorted(np.unique(digits.labels).tolist()) == list(range(10))
    assert digits.writers is None


def test_digits_tensors_are_normalized(digits):
    x, y = digits.tensors(np.arange(1797))
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert tuple(x.shape) == (1797, 1, 8, 8)
    np.testing.assert_array_equal(y.numpy(), digits.labels)
    expected = (digits.images.to(torch.float32) / 16.0 - 0.305) / 0.375
    torch.testing.assert_close(x, expected)
    # the normalization constants fit the data: about zero mean, unit std
    assert abs(float(x.mean())) < 0.05
    assert abs(float(x.std()) - 1.0) < 0.05


def test_unit_scaling_keeps_the_inputs_in_0_1_and_reaches_the_clients(digits):
    x, _ = digits.tensors(np.arange(1797), standardize=False)
    torch.testing.assert_close(x, digits.images.to(torch.float32) / 16.0)
    from conftest import DEFAULT_CONFIG
    from fedcluster_flwr.config.load import load_config
    from fedcluster_flwr.experiment import Experiment

    config, _ = load_config(DEFAULT_CONFIG, [("dataset.scaling", "unit")])
    data = Experiment(config).client_data(0)
    assert float(data.x_train.min()) >= 0.0 and float(data.x_train.max()) <= 1.0
    standardized, _ = load_config(DEFAULT_CONFIG, [])
    assert float(Experiment(standardized).client_data(0).x_train.min()) < 0.0


def test_tensors_selects_the_given_indices(digits):
    idx = np.array([5, 0, 1796, 5])
    x, y = digits.tensors(idx)
    full, labels = digits.tensors(np.arange(1797))
    torch.testing.assert_close(x, full[idx])
    assert y.tolist() == labels[idx].tolist()


def test_tensors_label_map_permutes_labels(digits):
    idx = np.arange(200)
    label_map = (1, 0, 2, 3, 4, 5, 6, 7, 9, 8)
    x_plain, y_plain = digits.tensors(idx)
    x, y = digits.tensors(idx, ClientTransform(label_map=label_map))
    torch.testing.assert_close(x, x_plain)  # images untouched
    assert y.dtype == torch.int64
    assert y.tolist() == [label_map[v] for v in y_plain.tolist()]
    assert set(y_plain.tolist()) >= {0, 1, 8, 9}  # the swap is actually exercised


def _normalize_digits(raw: torch.Tensor) -> torch.Tensor:
    return (raw / 16.0 - 0.305) / 0.375


def test_tensors_rotation_90_is_exact_counter_clockwise(digits):
    idx = np.arange(10)
    x, _ = digits.tensors(idx, ClientTransform(rotation=90.0))
    raw = digits.images[torch.as_tensor(idx)].to(torch.float32)
    expected = _normalize_digits(torch.rot90(raw, k=1, dims=(2, 3)))  # rotate, then normalize
    assert torch.equal(x, expected)
    # counter-clockwise: the top row becomes the left column (read bottom-up)
    torch.testing.assert_close(x[:, 0, :, 0].flip(1), _normalize_digits(raw)[:, 0, 0, :])


@pytest.mark.parametrize(("degrees", "k"), [(180.0, 2), (270.0, 3), (-90.0, 3), (360.0, 0), (450.0, 1)])
def test_tensors_rotation_multiples_of_90(digits, degrees, k):
    idx = np.arange(4)
    x, _ = digits.tensors(idx, ClientTransform(rotation=degrees))
    raw = digits.images[torch.as_tensor(idx)].to(torch.float32)
    assert torch.equal(x, _normalize_digits(torch.rot90(raw, k=k, dims=(2, 3))))


def test_tensors_rotation_by_other_angle(digits):
    idx = np.arange(10)
    plain, _ = digits.tensors(idx)
    x, y = digits.tensors(idx, ClientTransform(rotation=30.0))
    assert x.shape == plain.shape and x.dtype == torch.float32
    assert not torch.allclose(x, plain)
    assert y.tolist() == digits.labels[:10].tolist()
    # same direction as the exact 90-degree rotation: 80 degrees is close to it
    near, _ = digits.tensors(idx, ClientTransform(rotation=80.0))
    exact, _ = digits.tensors(idx, ClientTransform(rotation=90.0))
    assert (near - exact).abs().mean() < (near - plain).abs().mean()


@pytest.mark.parametrize(
    "fill, corner",
    [
        # the DAC reference's (main_fed.py: Normalize, then RandomRotation with fill 0): the model sees 0
        ("normalized_zero", 0.0),
        # rotated before normalizing: raw 0 (black), normalized with digits' mean/std
        ("black", (0.0 - 0.305) / 0.375),
    ],
)
def test_rotation_fill_of_the_corners_of_a_45_degree_rotation(fill, corner):
    """A white image rotated by 45 degrees: its corner pixel is the fill, its centre stays white."""
    from fedcluster_flwr.data.datasets import DatasetPool

    white = DatasetPool("white", torch.full((1, 1, 8, 8), 16.0), np.zeros(1, dtype=np.int64), 10, 16.0, (0.305,), (0.375,))
    x, _ = white.tensors(np.array([0]), ClientTransform(rotation=45.0, rotation_fill=fill))
    one = (1.0 - 0.305) / 0.375
    assert float(x[0, 0, 0, 0]) == pytest.approx(corner, abs=1e-5)
    assert float(x[0, 0, 4, 4]) == pytest.approx(one, abs=1e-5)


def test_rotation_fill_is_the_same_for_multiples_of_90_degrees(digits):
    """No corner is left by 90/180/270 degrees: rotating after normalising (normalized_zero) and
    before (black) give the same bits, as a permutation of the pixels commutes with normalising."""
    idx = np.arange(5)
    for degrees in (90.0, 180.0, 270.0):
        grey, _ = digits.tensors(idx, ClientTransform(rotation=degrees, rotation_fill="normalized_zero"))
        black, _ = digits.tensors(idx, ClientTransform(rotation=degrees, rotation_fill="black"))
        assert torch.equal(grey, black), degrees


def test_rotation_partition_passes_its_fill_to_every_client(digits):
    from fedcluster_flwr.data.partition_options import RotationOptions

    for fill in ("normalized_zero", "black"):
        part = make_partition(
            "rotation", RotationOptions(angles=(0.0, 45.0), rotation_fill=fill), labels=digits.labels,
            num_classes=10, num_clients=4, samples_per_client=20, test_fraction=0.2, seed=0,
        )
        assert {t.rotation_fill for t in part.transforms} == {fill}
    assert RotationOptions().rotation_fill == "normalized_zero"  # the reference's is the default


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown dataset 'svhn'"):
        load_pool("svhn")


# ---- MNIST / Fashion-MNIST from $FEDCLUSTER_DATA_DIR -----------------------------------

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _shared_data_dir(class_name: str) -> str:
    root = os.environ.get(DATA_DIR_ENV)
    if not root:
        pytest.skip(f"{DATA_DIR_ENV} is not set; {class_name} tests need the offline dataset files")
    raw = Path(root) / class_name / "raw"
    missing = [f for f in MNIST_FILES if not (raw / f).is_file()]
    if missing:
        pytest.skip(f"{class_name} files missing under {raw}: {', '.join(missing)}")
    return str(Path(root).resolve())


@pytest.fixture(scope="module")
def mnist():
    return load_pool("mnist", _shared_data_dir("MNIST"))


@pytest.fixture(scope="module")
def fashion_mnist():
    return load_pool("fashion_mnist", _shared_data_dir("FashionMNIST"))


def test_mnist_pool(mnist):
    assert mnist.name == "mnist"
    assert tuple(mnist.images.shape) == (70000, 1, 28, 28)
    assert mnist.images.dtype == torch.uint8
    assert mnist.labels.shape == (70000,) and mnist.labels.dtype == np.int64
    assert mnist.num_classes == 10
    # train first, then test: the train label counts of the official split
    assert np.bincount(mnist.labels[:60000]).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert len(mnist.labels[60000:]) == 10000


def test_mnist_tensors_normalized(mnist):
    x, y = mnist.tensors(np.arange(2000))
    assert x.dtype == torch.float32 and tuple(x.shape) == (2000, 1, 28, 28)
    assert y.dtype == torch.int64
    assert abs(float(x.mean())) < 0.1 and abs(float(x.std()) - 1.0) < 0.1


def test_fashion_mnist_pool(fashion_mnist):
    assert fashion_mnist.name == "fashion_mnist"
    assert tuple(fashion_mnist.images.shape) == (70000, 1, 28, 28)
    assert fashion_mnist.images.dtype == torch.uint8
    assert np.bincount(fashion_mnist.labels[:60000]).tolist() == [6000] * 10
    assert np.bincount(fashion_mnist.labels[60000:]).tolist() == [1000] * 10


def test_mnist_missing_files_is_data_error(tmp_path):
    with pytest.raises(DataError) as err:
        load_pool("mnist", str(tmp_path))
    assert str(tmp_path / "MNIST" / "raw") in str(err.value)


# ---- CIFAR-10: tiny batches in the real pickle format -----------------------------------

def test_cifar10_pool_from_batches(tmp_path):
    images, labels = write_cifar(tmp_path, per_batch=4)
    pool = load_pool("cifar10", str(tmp_path))
    assert pool.name == "cifar10" and pool.num_classes == 10
    assert tuple(pool.images.shape) == (24, 3, 32, 32)  # 5 train batches + test batch
    assert pool.images.dtype == torch.uint8
    assert pool.input_shape == (3, 32, 32)
    np.testing.assert_array_equal(pool.labels, labels)
    np.testing.assert_array_equal(pool.images.numpy(), images)


def test_cifar10_pixel_plane_ordering(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in CIFAR_BATCHES:
        data = np.zeros((2, 3072), dtype=np.uint8)
        if name == "data_batch_2":
            # second image of the batch: green (plane 1) pixel at row 5, column 7
            data[1, 1 * 1024 + 5 * 32 + 7] = 200
            data[1, 2 * 1024 + 31 * 32 + 0] = 77  # blue, last row, first column
        with open(folder / name, "wb") as handle:
            pickle.dump({"data": data, "labels": [3, 8]}, handle, protocol=2)
    pool = load_pool("cifar10", str(tmp_path))
    image = pool.images[3]  # data_batch_1 holds samples 0-1, data_batch_2 samples 2-3
    assert int(image[1, 5, 7]) == 200
    assert int(image[2, 31, 0]) == 77
    assert int(image.sum()) == 277
    assert pool.labels.tolist() == [3, 8] * 6
    x, _ = pool.tensors(np.array([3]))
    assert float(x[0, 1, 5, 7]) == pytest.approx((200 / 255 - 0.4822) / 0.2435, rel=1e-5)


def test_cifar10_missing_files(tmp_path):
    with pytest.raises(DataError) as err:
        load_pool("cifar10", str(tmp_path))
    assert "cifar-10-batches-py" in str(err.value)
    assert str(tmp_path / "cifar-10-batches-py") in str(err.value)


def test_cifar10_missing_one_batch(tmp_path):
    write_cifar(tmp_path, per_batch=1)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3"):
        load_pool("cifar10", str(tmp_path))


def test_cifar10_malformed_batch(tmp_path):
    write_cifar(tmp_path, per_batch=1)
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as handle:
        pickle.dump({"labels": [1]}, handle, protocol=2)  # no "data"
    with pytest.raises(DataError, match="test_batch"):
        load_pool("cifar10", str(tmp_path))


# ---- FEMNIST: LEAF JSON files -----------------------------------------------------------


def _user_blob(users: dict[str, tuple[np.ndarray, list[int]]]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.reshape(len(x), 784).tolist(), "y": y} for u, (x, y) in users.items()},
    }


def _write_femnist(root: Path, seed: int = 0) -> dict[str, dict[str, int]]:
    """LEAF layout: femnist/train/*.json and femnist/test/*.json; writers appear in both."""
    rng = np.random.default_rng(seed)
    counts = {"train": {}, "test": {}}
    files = {
        "train": {"all_data_0_niid_0_keep_0_train_9.json": ["f0001_41", "f0002_07"], "all_data_1_niid_0_keep_0_train_9.json": ["f0003_12", "f0004_33", "f0005_20"]},
        "test": {"all_data_0_niid_0_keep_0_test_9.json": ["f0001_41", "f0002_07"], "all_data_1_niid_0_keep_0_test_9.json": ["f0003_12", "f0004_33", "f0005_20"]},
    }
    for split, per_file in files.items():
        (root / "femnist" / split).mkdir(parents=True)
        for filename, users in per_file.items():
            data = {}
            for u in users:
                n = int(rng.integers(3, 7)) if split == "train" else 2
                x = rng.random((n, 28, 28)).astype(np.float32)
                y = [int(v) for v in rng.integers(0, 62, size=n)]
                data[u] = (x, y)
                counts[split][u] = n
            (root / "femnist" / split / filename).write_text(json.dumps(_user_blob(data)))
    return counts


def test_femnist_pool_maps_samples_to_writers(tmp_path):
    counts = _write_femnist(tmp_path)
    pool = load_pool("femnist", str(tmp_path))
    total = sum(counts["train"].values()) + sum(counts["test"].values())
    assert pool.name == "femnist" and pool.num_classes == 62
    assert tuple(pool.images.shape) == (total, 1, 28, 28)
    assert pool.labels.shape == (total,) and pool.labels.dtype == np.int64
    assert pool.writers is not None and pool.writers.shape == (total,)
    # five writers; a writer keeps one id across the train and the test files
    assert sorted(np.unique(pool.writers).tolist()) == [0, 1, 2, 3, 4]
    users = ["f0001_41", "f0002_07", "f0003_12", "f0004_33", "f0005_20"]
    per_writer = np.bincount(pool.writers)
    assert sorted(per_writer.tolist()) == sorted(counts["train"][u] + counts["test"][u] for u in users)
    # the train files come first: the first writer's train samples open the pool
    first = counts["train"]["f0001_41"]
    assert pool.writers[:first].tolist() == [pool.writers[0]] * first


def test_femnist_pixels_and_labels_round_trip(tmp_path):
    (tmp_path / "femnist" / "train").mkdir(parents=True)
    x = np.zeros((2, 28, 28), dtype=np.float32)
    x[0, 3, 4] = 0.25
    x[1, 27, 0] = 0.5
    blob = _user_blob({"w1": (x, [61, 7])})
    (tmp_path / "femnist" / "train" / "part.json").write_text(json.dumps(blob))
    pool = load_pool("femnist", str(tmp_path))
    assert pool.labels.tolist() == [61, 7]
    assert float(pool.images[0, 0, 3, 4]) == 0.25
    assert float(pool.images[1, 0, 27, 0]) == 0.5
    assert float(pool.images.sum()) == 0.75


def test_femnist_natural_partition_one_writer_per_client(tmp_path):
    _write_femnist(tmp_path, seed=1)
    pool = load_pool("femnist", str(tmp_path))
    p = make_partition(
        "natural",
        NaturalOptions(),
        labels=pool.labels,
        num_classes=pool.num_classes,
        num_clients=4,
        samples_per_client=None,
        test_fraction=0.2,
        seed=0,
        writers=pool.writers,
    )
    chosen = []
    for train, test in zip(p.train_indices, p.test_indices):
        idx = np.concatenate([train, test])
        writers = set(pool.writers[idx].tolist())
        assert len(writers) == 1
        chosen.append(writers.pop())
        assert len(idx) == int((pool.writers == chosen[-1]).sum())
    assert len(set(chosen)) == 4


def test_femnist_missing_folder(tmp_path):
    with pytest.raises(DataError) as err:
        load_pool("femnist", str(tmp_path))
    assert str(tmp_path / "femnist") in str(err.value)


def test_femnist_malformed_file(tmp_path):
    (tmp_path / "femnist" / "train").mkdir(parents=True)
    bad = {"users": ["w1"], "num_samples": [1], "user_data": {"w1": {"x": [[0.0] * 10], "y": [1]}}}  # not 784 pixels
    (tmp_path / "femnist" / "train" / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(DataError, match="bad.json"):
        load_pool("femnist", str(tmp_path))


# ---- resolve_data_dir / caching ---------------------------------------------------------


def test_resolve_data_dir_explicit_argument_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "from_env"))
    assert resolve_data_dir(str(tmp_path / "explicit")) == (tmp_path / "explicit").resolve()


def test_resolve_data_dir_env_wins_over_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "from_env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert resolve_data_dir(None) == (tmp_path / "from_env").resolve()


def test_resolve_data_dir_defaults_to_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert resolve_data_dir(None) == (tmp_path / "cache" / "fedcluster" / "data").resolve()


def test_load_pool_reads_env_dir(tmp_path, monkeypatch):
    write_cifar(tmp_path, per_batch=1)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    _load_pool.cache_clear()
    try:
        pool = load_pool("cifar10")
        assert len(pool.labels) == 6
    finally:
        _load_pool.cache_clear()


def test_load_pool_is_cached(tmp_path):
    write_cifar(tmp_path, per_batch=1)
    first = load_pool("cifar10", str(tmp_path))
    assert load_pool("cifar10", str(tmp_path)) is first


def test_load_pool_follows_a_changed_data_dir_env(tmp_path, monkeypatch):
    """The cache is keyed by the resolved folder, not by the (unset) data_dir argument."""
    write_cifar(tmp_path / "a", per_batch=1)
    write_cifar(tmp_path / "b", per_batch=2)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "a"))
    assert len(load_pool("cifar10").labels) == 6
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "b"))
    assert len(load_pool("cifar10").labels) == 12
