"""Helpers the test modules share (no test imports from another test module)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from conftest import DEFAULT_CONFIG
from fedcluster_flwr.config import config_to_dict, load_config


def rows_without_timing(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``rounds.jsonl`` rows without their wall-clock ``seconds``."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]


def assert_same_state(got: Any, expected: Any, path: str = "state", skip: Sequence[str] = ()) -> None:
    """Two state trees (dicts, lists, arrays, scalars) are equal bit for bit (NaN equals NaN);
    keys named in ``skip`` are not compared."""
    if isinstance(expected, Mapping):
        assert isinstance(got, Mapping), f"{path}: {type(got).__name__}, expected a mapping"
        assert set(got) == set(expected), f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, expected))}"
        for key in expected:
            if key not in skip:
                assert_same_state(got[key], expected[key], f"{path}.{key}", skip)
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got).__name__}, expected an array"
        assert got.dtype == expected.dtype and got.shape == expected.shape, f"{path}: {got.dtype}{got.shape}"
        assert np.array_equal(got, expected, equal_nan=got.dtype.kind == "f"), f"{path}: values differ"
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), f"{path}: {got!r} != {expected!r}"
        for k, (a, b) in enumerate(zip(got, expected)):
            assert_same_state(a, b, f"{path}[{k}]", skip)
    elif isinstance(expected, float) and np.isnan(expected):
        assert isinstance(got, float) and np.isnan(got), f"{path}: {got!r}, expected NaN"
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def finished_looking_run(run_dir: Path, done: int = 3) -> Path:
    """A run directory as `fedcluster run --stop-after 3` leaves it (checkpoint at round ``done``),
    with placeholder files where only their presence matters."""
    config, _ = load_config(DEFAULT_CONFIG, [])
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    (run_dir / "checkpoint" / "state.json").write_text(json.dumps({"format": 2, "round": done, "strategy": {}}))
    (run_dir / "checkpoint" / "models.npz").write_bytes(b"models")
    (run_dir / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(1, done + 1)))
    (run_dir / "accuracy.png").write_bytes(b"png")
    return run_dir
