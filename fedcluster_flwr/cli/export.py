"""``fedcluster export-partitions``: each simulated client's data written as a device's data folder
(:mod:`fedcluster_flwr.data.device` reads it), so that a real SuperNode replays that client."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from ..config.load import config_to_dict
from ..config.sections import ExperimentConfig
from ..data.device import CLIENT_ID, CLUSTER_ID, DATA_DIR, MANIFEST_FILE, NPZ_FILE, SPLITS
from ..data.sources import normalization
from ..experiment import Experiment


def config_hash(config_dict: Mapping[str, Any]) -> str:
    """SHA-256 of the resolved config (canonical JSON): which experiment an export belongs to."""
    text = json.dumps(config_dict, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def export_partitions(config: ExperimentConfig, out_dir: Path | str, images: bool = False) -> dict[str, Any]:
    """Write each simulated client's data, exactly the tensors that client trains and evaluates
    on (after its partition's transforms: rotation, label swap), to ``out_dir/client_<i>/data.npz``
    (with ``images``: also a PNG tree ``train/<label>/*.png``, 8-bit, so not bit-exact), plus
    ``manifest.json`` (client id, true cluster, the SuperNode's node config, the config hash)
    and the resolved ``config.yaml``. Returns the manifest."""
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    plain = config_to_dict(config)
    experiment = Experiment(config)
    pool, partition = experiment.data()
    mean, std = normalization(pool.mean, pool.std, config.dataset.scaling)  # what the model inputs were made with
    clients = []
    for pid in range(config.partition.num_clients):
        folder = out / f"client_{pid}"
        folder.mkdir(exist_ok=True)
        data = experiment.client_data(pid)
        arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
        if data.x_val is not None and data.y_val is not None:
            arrays |= {"x_val": data.x_val, "y_val": data.y_val}
        np.savez(folder / NPZ_FILE, **{key: value.numpy() for key, value in arrays.items()})
        if images:
            _write_png_tree(folder, arrays, mean, std)
        true_cluster = int(partition.true_clusters[pid])
        clients.append({
            "client_id": pid,
            "true_cluster": true_cluster,
            "dir": folder.name,
            "train_examples": len(data.y_train),
            "test_examples": len(data.y_test),
            "node_config": f"{DATA_DIR}='{folder}' {CLIENT_ID}={pid} {CLUSTER_ID}={true_cluster}",
        })
    manifest = {
        "config_hash": config_hash(plain),
        "dataset": config.dataset.name,
        "input_shape": list(config.input_shape),
        "num_classes": config.num_classes,
        "num_clients": config.partition.num_clients,
        "format": NPZ_FILE + (" and train/test/<label>/*.png" if images else ""),
        "clients": clients,
    }
    (out / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _write_png_tree(folder: Path, arrays: Mapping[str, torch.Tensor], mean: tuple[float, ...], std: tuple[float, ...]) -> None:
    """8-bit PNGs of model inputs (undoing their normalisation by ``mean``/``std``): for devices that read images."""
    from PIL import Image

    shift = torch.tensor(mean).view(1, -1, 1, 1)
    spread = torch.tensor(std).view(1, -1, 1, 1)
    for split in SPLITS:
        if f"x_{split}" not in arrays:
            continue
        pixels = ((arrays[f"x_{split}"] * spread + shift).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
        for index, (image, label) in enumerate(zip(pixels, arrays[f"y_{split}"].tolist())):
            target = folder / split / str(label)
            target.mkdir(parents=True, exist_ok=True)
            mode = "L" if image.shape[0] == 1 else "RGB"
            Image.fromarray(image[0] if mode == "L" else image.transpose(1, 2, 0), mode).save(target / f"{index:05d}.png")
