"""Datasets (loaded once per process) and partitioners with true cluster ids."""

from .datasets import DATASETS, DataError, DatasetFacts, DatasetPool, load_pool, resolve_data_dir
from .partition_options import cluster_names
from .partitions import PARTITIONERS, ClientTransform, Partition, make_partition
from . import flwr_partitions  # noqa: F401 - registers partition.name flwr_datasets

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "ClientTransform",
    "DataError",
    "DatasetFacts",
    "DatasetPool",
    "Partition",
    "cluster_names",
    "load_pool",
    "make_partition",
    "resolve_data_dir",
]
