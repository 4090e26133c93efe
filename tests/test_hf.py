"""``dataset.name: hf`` and ``partition.name: flwr_datasets`` (the extra fedcluster-flwr[hf]): folders
written from small arrays load as the pool, train, and every mistake is one line; Flower Datasets'
partitioners give here the partitions they give outside. Offline: no test reaches the Hub.

Without the extra, the tests that need it skip, and the extra missing is one line naming it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.data import DataError
from fedcluster_flwr.apps.server_app import run_in_process
from fedcluster_flwr.experiment import Experiment
from fedcluster_flwr.results.run_files import format_summary, read_summary
from fedcluster_flwr.declarations.schema import ConfigError

HAS_EXTRA = importlib.util.find_spec("datasets") is not None and importlib.util.find_spec("flwr_datasets") is not None
needs_extra = pytest.mark.skipif(not HAS_EXTRA, reason="needs the extra fedcluster-flwr[hf] (datasets, flwr-datasets)")

NUM_CLASSES = 4
SIZE = 8


def quadrant_images(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(count, 8, 8) uint8 images whose class c (0..3) is a bright quadrant c over noise: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % NUM_CLASSES
    images = rng.integers(0, 60, (count, SIZE, SIZE))
    for index, label in enumerate(labels):
        row, col = divmod(int(label), 2)
        images[index, 4 * row:4 * row + 4, 4 * col:4 * col + 4] += 180
    return images.astype(np.uint8), labels.astype(np.int64)


def hf_dataset(images, labels, label_feature=None):
    from datasets import ClassLabel, Dataset, Features, Image

    features = Features({"image": Image(), "label": label_feature or ClassLabel(num_classes=NUM_CLASSES)})
    return Dataset.from_dict({"image": list(images), "label": [int(v) for v in labels]}, features=features)


def parquet_folder(path, images, labels, **kwargs):
    path.mkdir(parents=True)
    hf_dataset(images, labels, **kwargs).to_parquet(str(path / "train.parquet"))
    return path


def saved_folder(path, images, labels, test_images=None, test_labels=None):
    from datasets import DatasetDict

    splits = {"train": hf_dataset(images, labels)}
    if test_images is not None:
        splits["test"] = hf_dataset(test_images, test_labels)
    DatasetDict(splits).save_to_disk(str(path))
    return path


def hf_config(path, tmp_path, *overrides, **dataset):
    """A small experiment on the hf dataset at ``path`` (data folder and caches under ``tmp_path``)."""
    keys = {"name": "hf", "path": str(path), "data_dir": str(tmp_path / "data"), **dataset}
    config, _ = load_config(None, [*((f"dataset.{k}", v) for k, v in keys.items()), ("model.name", "mlp_fmnist"),
                                   ("partition.name", "iid"), ("partition.num_clients", 4), ("rounds", 2),
                                   ("strategy.name", "fedavg"), ("output_dir", str(tmp_path / "out")), *overrides])
    return config


def one_line_error(kind, match, make):
    with pytest.raises(kind, match=match) as raised:
        make()
    assert "\n" not in str(raised.value), str(raised.value)
    return str(raised.value)


# ---- the extra missing, the keys of hf only ----------------------------------------------------------------


@pytest.mark.parametrize("missing", ["datasets", "flwr_datasets"])
def test_the_extra_missing_is_one_line_naming_it(tmp_path, monkeypatch, missing):
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    if missing == "datasets":
        make = lambda: hf_config(tmp_path / "folder", tmp_path)  # noqa: E731
        key = "dataset.name: 'hf'"
    else:
        make = lambda: load_config(None, [("model.name", "mlp_digits"), ("partition.name", "flwr_datasets"),  # noqa: E731
                                          ("partition.partitioner", "IidPartitioner")])
        key = "partition.name: 'flwr_datasets'"
    message = one_line_error(ConfigError, "needs the optional extra", make)
    assert message.startswith(key) and "fedcluster-flwr[hf]" in message and f"'{missing}' is not installed" in message


def test_the_keys_of_hf_belong_to_hf_only():
    one_line_error(ConfigError, r"^dataset.image_key: only name hf takes image_key \(name is digits\)$",
                   lambda: load_config(None, [("model.name", "mlp_digits"), ("dataset.image_key", "img")]))
    one_line_error(ConfigError, "^dataset.path: dataset.name hf needs a folder of parquet/arrow files",
                   lambda: load_config(None, [("model.name", "mlp_digits"), ("dataset.name", "hf")]))


def test_a_run_of_one_true_group_says_purity_and_ari_do_not_apply(tmp_path):
    summary = {"mean_client_accuracy": 0.5, "best_mean_client_accuracy": 0.5, "pct_clients_over_target": 0.0,
               "target_accuracy": 0.9, "num_clusters": 3, "purity": 1.0, "ari": 0.0, "nmi": 0.0, "bytes_up": 0,
               "bytes_down": 0, "fit_failures": 0, "rejected_updates": 0, "wall_seconds": 1.0}
    one_group = format_summary(summary | {"true_clusters": [0, 0, 0, 0]}, tmp_path)
    assert "clusters               3 (one true group: purity, ARI and NMI do not apply)" in one_group
    assert "ARI 0.00" not in one_group
    groups = format_summary(summary | {"true_clusters": [0, 1, 0, 1]}, tmp_path)
    assert "clusters               3 (purity 1.00, ARI 0.00, NMI 0.00)" in groups


# ---- dataset.name: hf ------------------------------------------------------------------------------------


@needs_extra
def test_a_parquet_folder_written_from_arrays_is_the_pool(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # what $HF_DATASETS_CACHE sets
    images, labels = quadrant_images(40)
    config = hf_config(parquet_folder(tmp_path / "parquet", images, labels), tmp_path)
    assert config.input_shape == (1, SIZE, SIZE) and config.num_classes == NUM_CLASSES  # read from the data
    pool, _ = Experiment(config).data()
    assert pool.images.dtype.is_floating_point is False and pool.scale == 255.0
    assert np.array_equal(pool.images[:, 0].numpy(), images) and np.array_equal(pool.labels, labels)
    assert pool.mean[0] == pytest.approx(images.mean() / 255, rel=1e-9) and pool.std[0] == pytest.approx(images.std() / 255, rel=1e-6)
    cache = tmp_path / "hf_cache"
    assert cache.is_dir() and any(cache.iterdir())  # no dataset.cache_dir: Hugging Face's own cache folder
    assert not (tmp_path / "data" / "huggingface").exists()  # nothing in the data folder, which may be read-only


def test_the_datasets_cache_is_dataset_cache_dir_where_given_else_hugging_faces_own():
    from fedcluster_flwr.data.hf import cache_folder

    data = Path("/data")
    assert cache_folder(None, data) is None  # load_dataset then reads HF_DATASETS_CACHE / HF_HOME
    assert cache_folder("hf", data) == data / "hf" and cache_folder("/elsewhere/hf", data) == Path("/elsewhere/hf")


@needs_extra
def test_a_save_to_disk_folder_loads_through_load_from_disk_and_joins_splits(tmp_path):
    """Read by load_dataset, a save_to_disk folder would be one row per file (the trap)."""
    images, labels = quadrant_images(30)
    folder = saved_folder(tmp_path / "saved", images[:20], labels[:20], images[20:], labels[20:])
    pool, _ = Experiment(hf_config(folder, tmp_path, ("partition.num_clients", 2))).data()
    assert len(pool.labels) == 20 and np.array_equal(pool.images[:, 0].numpy(), images[:20])
    joined, _ = Experiment(hf_config(folder, tmp_path, ("partition.num_clients", 2), split="train+test")).data()
    assert np.array_equal(joined.labels, labels)
    one_line_error(ConfigError, r"^dataset.split: 'validation' is not a split of .*; its splits: train, test$",
                   lambda: hf_config(folder, tmp_path, split="validation"))


@needs_extra
def test_its_partitions_export_to_devices_and_its_png_tree_undoes_the_pools_own_statistics(tmp_path):
    """export-partitions on an hf pool: the float arrays are the simulated client's inputs; the PNG
    tree is the original 8-bit pixels (un-standardised by the pool's own mean and std)."""
    from fedcluster_flwr.data.device import load_device_data
    from fedcluster_flwr.data.sources import input_format
    from fedcluster_flwr.cli.export import export_partitions

    images, labels = quadrant_images(40)
    config = hf_config(parquet_folder(tmp_path / "parquet", images, labels), tmp_path, ("partition.num_clients", 2))
    export_partitions(config, tmp_path / "export", images=True)
    device = load_device_data(tmp_path / "export" / "client_0", input_format(config))
    assert np.array_equal(device.x_train.numpy(), Experiment(config).client_data(0).x_train.numpy())
    pngs = sorted((tmp_path / "export" / "client_0" / "train").rglob("*.png"))
    from PIL import Image

    written = np.sort(np.concatenate([np.asarray(Image.open(p)).ravel() for p in pngs]))
    pool, partition = Experiment(config).data()
    original = np.sort(pool.images[partition.train_indices[0]].numpy().ravel())
    assert np.abs(written.astype(int) - original.astype(int)).max() <= 1  # float32 round trip, then rounding


@needs_extra
def test_colour_images_are_channels_first_with_their_own_channel_statistics(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (12, 6, 5, 3), dtype=np.uint8)
    config = hf_config(parquet_folder(tmp_path / "rgb", images, np.arange(12) % 4), tmp_path,
                       ("partition.num_clients", 2))
    pool, _ = Experiment(config).data()
    assert config.input_shape == (3, 6, 5) and tuple(pool.images.shape) == (12, 3, 6, 5)
    assert np.array_equal(pool.images.numpy(), images.transpose(0, 3, 1, 2))
    assert pool.mean == pytest.approx(tuple(images.mean(axis=(0, 1, 2)) / 255), rel=1e-9)


@needs_extra
@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
@pytest.mark.parametrize("strategy", [
    [("strategy.name", "fedavg")],
    [("strategy.name", "flhc"), ("strategy.rounds_before_clustering", 1), ("strategy.num_clusters", 2),
     ("strategy.client_fraction", 1.0), ("strategy.distance", "cosine"), ("strategy.linkage", "average")],
], ids=["fedavg", "flhc"])
def test_an_hf_dataset_trains_with_fedavg_and_a_clustered_strategy(tmp_path, kind, strategy):
    """Every partitioner works on the pool: label_swap's two groups, found again by FL+HC."""
    images, labels = quadrant_images(240)
    make = parquet_folder if kind == "parquet" else saved_folder
    config = hf_config(make(tmp_path / kind, images, labels), tmp_path, ("partition.name", "label_swap"),
                       ("partition.num_groups", 2), ("partition.num_clients", 6), ("rounds", 3),
                       ("client.epochs", 2), ("client.batch_size", 8), ("client.lr", 0.1), *strategy)
    run_dir = tmp_path / "run"
    run_in_process(config, run_dir)
    summary = read_summary(run_dir)
    assert summary["finished"] and summary["completed_rounds"] == 3 and summary["fit_failures"] == 0
    assert summary["mean_client_accuracy"] > 0.4  # chance is 0.25; fedavg learns the classes no group swaps
    if strategy[0][1] == "flhc":
        assert summary["num_clusters"] == 2 and summary["ari"] == 1.0 and summary["mean_client_accuracy"] > 0.9


@needs_extra
def test_hf_mistakes_are_one_line_naming_the_key(tmp_path):
    images, labels = quadrant_images(8)
    folder = parquet_folder(tmp_path / "parquet", images, labels)
    one_line_error(ConfigError, r"^dataset.image_key: no column 'img' in .*; its columns: image, label$",
                   lambda: hf_config(folder, tmp_path, image_key="img"))
    one_line_error(ConfigError, r"^dataset.label_key: no column 'target'", lambda: hf_config(folder, tmp_path, label_key="target"))
    one_line_error(ConfigError, r"^dataset.image_key: column 'label' of .* holds ClassLabel.*, not images",
                   lambda: hf_config(folder, tmp_path, image_key="label"))
    one_line_error(ConfigError, r"^dataset.label_key: column 'image' of .* holds Image.*, not class labels",
                   lambda: hf_config(folder, tmp_path, label_key="image"))
    one_line_error(ConfigError, r"^dataset.path: no such file or folder: \./nowhere \(looked in ",
                   lambda: hf_config("./nowhere", tmp_path))


@needs_extra
def test_a_label_outside_the_classes_is_one_line_naming_the_column(tmp_path):
    from datasets import Value

    images, labels = quadrant_images(8)
    unlabelled = parquet_folder(tmp_path / "unlabelled", images, np.where(np.arange(8) == 5, -1, labels))  # ClassLabel's "no label"
    one_line_error(DataError, r"column 'label' holds label -1 at row 5 \(1 such rows\), outside the classes 0\.\.3$",
                   lambda: hf_config(unlabelled, tmp_path))
    negative = parquet_folder(tmp_path / "negative", images, labels - 1, label_feature=Value("int64"))
    one_line_error(DataError, r"holds label -1 at row 0 \(2 such rows\), outside the classes 0\.\.2$",
                   lambda: hf_config(negative, tmp_path))


@needs_extra
def test_images_of_different_sizes_or_out_of_range_pixels_are_one_line(tmp_path):
    from datasets import Array2D, ClassLabel, Dataset, Features

    images, labels = quadrant_images(4)
    mixed = [*images[:3], np.zeros((9, 8), dtype=np.uint8)]
    folder = tmp_path / "mixed"
    folder.mkdir()
    hf_dataset(mixed, labels).to_parquet(str(folder / "train.parquet"))
    config = hf_config(folder, tmp_path, ("partition.num_clients", 1))  # the first image gives the shape
    one_line_error(DataError, r"differ in shape \(\(8, 8\) and \(9, 8\)", lambda: Experiment(config).data())
    bright = tmp_path / "bright"
    bright.mkdir()
    features = Features({"image": Array2D((8, 8), "float32"), "label": ClassLabel(num_classes=4)})
    Dataset.from_dict({"image": list(images.astype(np.float32)), "label": labels.tolist()},
                      features=features).to_parquet(str(bright / "train.parquet"))
    config = hf_config(bright, tmp_path, ("partition.num_clients", 1))
    one_line_error(DataError, r"holds float32 pixels from 0\.0 to .*: expected integers 0\.\.255 or floats in \[0, 1\]$",
                   lambda: Experiment(config).data())


@needs_extra
def test_a_hub_name_offline_is_one_line(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    one_line_error(ConfigError, r"^dataset.path: 'ylecun/mnist' is no local file or folder .* and the Hugging Face "
                                r"Hub did not give it \(.*OfflineModeIsEnabled.*\); offline, give the folder",
                   lambda: hf_config("ylecun/mnist", tmp_path))


# ---- partition.name: flwr_datasets -----------------------------------------------------------------------


def flwr_config(partitioner, args=None, *overrides):
    config, _ = load_config(None, [("model.name", "mlp_digits"), ("partition.name", "flwr_datasets"),
                                   ("partition.partitioner", partitioner), ("partition.args", args or {}),
                                   ("partition.num_clients", 10), *overrides])
    return config


def clients_samples(partition) -> list[set[int]]:
    return [set(np.concatenate([train, test]).tolist()) for train, test in zip(partition.train_indices, partition.test_indices)]


def library_partitions(partitioner, labels) -> list[set[int]]:
    """What the library gives on the same labels, outside this project."""
    from datasets import Dataset

    partitioner.dataset = Dataset.from_dict({"label": labels, "row": np.arange(len(labels))})
    return [set(partitioner.load_partition(k)["row"]) for k in range(partitioner.num_partitions)]


@needs_extra
@pytest.mark.parametrize("seed_in_args", [False, True], ids=["run-seed", "args-seed"])
def test_dirichlet_gives_the_librarys_partitions_for_the_same_seed(seed_in_args):
    from flwr_datasets.partitioner import DirichletPartitioner

    args = {"alpha": 0.5} | ({"seed": 42} if seed_in_args else {})
    config = flwr_config("DirichletPartitioner", args, ("seed", 7))
    pool, partition = Experiment(config).data()
    expected = library_partitions(DirichletPartitioner(num_partitions=10, partition_by="label", alpha=0.5,
                                                       seed=42 if seed_in_args else 7), pool.labels)
    assert clients_samples(partition) == expected
    assert partition.true_clusters.tolist() == [0] * 10  # no true clusters: one group


@needs_extra
def test_pathological_gives_the_librarys_partitions_for_the_same_seed():
    from flwr_datasets.partitioner import PathologicalPartitioner

    args = {"num_classes_per_partition": 2, "class_assignment_mode": "first-deterministic"}
    pool, partition = Experiment(flwr_config("PathologicalPartitioner", args, ("seed", 3))).data()
    expected = library_partitions(PathologicalPartitioner(num_partitions=10, partition_by="label", seed=3, **args),
                                  pool.labels)
    assert clients_samples(partition) == expected
    assert all(len(set(pool.labels[list(samples)])) <= 2 for samples in expected)


@needs_extra
def test_a_seedless_partitioner_cuts_a_pool_shuffled_with_the_runs_seed():
    """IidPartitioner cuts contiguous slices: here of the pool shuffled by the seed, so seeds differ."""
    first = clients_samples(Experiment(flwr_config("IidPartitioner", None, ("seed", 1))).data()[1])
    again = clients_samples(Experiment(flwr_config("IidPartitioner", None, ("seed", 1))).data()[1])
    other = clients_samples(Experiment(flwr_config("IidPartitioner", None, ("seed", 2))).data()[1])
    assert first == again and first != other
    assert sorted(first[0]) != list(range(min(first[0]), min(first[0]) + len(first[0])))  # not a slice of the pool


@needs_extra
def test_flwr_datasets_mistakes_and_the_librarys_errors_are_one_line_naming_the_option():
    one_line_error(ConfigError, r"^partition.partitioner: unknown Flower Datasets partitioner 'Dirichlet' \(did you "
                                r"mean 'DirichletPartitioner'\?\); available: ", lambda: flwr_config("Dirichlet"))
    one_line_error(ConfigError, r"^partition.partitioner: VerticalEvenPartitioner splits columns",
                   lambda: flwr_config("VerticalEvenPartitioner"))
    one_line_error(ConfigError, r"^partition.args.alpha: DirichletPartitioner needs it$", lambda: flwr_config("DirichletPartitioner"))
    one_line_error(ConfigError, r"^partition.args.alfa: not an argument of DirichletPartitioner \(did you mean 'alpha'\?\)",
                   lambda: flwr_config("DirichletPartitioner", {"alfa": 0.5}))
    one_line_error(ConfigError, r"^partition.args.num_partitions: is partition.num_clients: set that instead$",
                   lambda: flwr_config("IidPartitioner", {"num_partitions": 4}))
    one_line_error(ConfigError, r"^partition.args.seed: must be an integer, got None: an unseeded partition differs",
                   lambda: flwr_config("DirichletPartitioner", {"alpha": 0.5, "seed": None}))
    # the library's own errors: too few samples for min_partition_size, a dropped class, a wrong count
    too_few = flwr_config("DirichletPartitioner", {"alpha": 0.01, "min_partition_size": 150})
    one_line_error(ConfigError, r"^partition.args.alpha: DirichletPartitioner: The max number of attempts \(10\) was "
                                r"reached", lambda: Experiment(too_few).data())
    dropped = flwr_config("PathologicalPartitioner", {"num_classes_per_partition": 1}, ("partition.num_clients", 6))
    one_line_error(ConfigError, r"^partition.args.class_assignment_mode: PathologicalPartitioner placed no sample of "
                                r"classes .* \(\d+ of 1797 samples placed\): set it to first-deterministic",
                   lambda: Experiment(dropped).data())
    sizes = flwr_config("SizePartitioner", {"partition_sizes": [100, 200, 300]})
    one_line_error(ConfigError, r"^partition.num_clients: SizePartitioner made 3 partitions from its arguments, for 10 "
                                r"clients: set partition.num_clients to 3$", lambda: Experiment(sizes).data())


@needs_extra
def test_a_flwr_datasets_run_trains_and_its_summary_says_the_scores_do_not_apply(tmp_path):
    config = flwr_config("DirichletPartitioner", {"alpha": 1.0}, ("partition.num_clients", 4), ("rounds", 2),
                         ("strategy.name", "fedavg"), ("partition.samples_per_client", 60))
    run_in_process(config, tmp_path)
    summary = read_summary(tmp_path)
    assert summary["finished"] and summary["true_clusters"] == [0, 0, 0, 0]
    assert "(one true group: purity, ARI and NMI do not apply)" in format_summary(summary, tmp_path)
    _, partition = Experiment(config).data()
    assert all(len(train) + len(test) == 60 for train, test in zip(partition.train_indices, partition.test_indices))
