"""A ``flwr run``'s run config -> the experiment config (the Flower adapter both apps use).

Under ``flwr run`` both apps rebuild the experiment config from the run config: ``config`` names
the YAML (relative to the app's root, then the working directory), ``set`` carries any dotted
overrides, and the other keys (pyproject.toml's ``[tool.flwr.app.config]``: the keys declared
``RUN_CONFIG``, :mod:`fedcluster_flwr.declarations.roles`) are overrides of their own; an empty string
keeps the YAML's value.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config.load import load_config, parse_override
from ..config.sections import ExperimentConfig
from ..experiment import Experiment
from ..declarations.schema import ConfigError

APP_ROOT = Path(__file__).resolve().parents[2]  # the project root (or the installed FAB): above fedcluster_flwr/apps/
RUN_CONFIG_FILE_KEY = "config"
RUN_CONFIG_SET_KEY = "set"


def resolve_config_path(path: str) -> Path:
    """Absolute paths as they are; relative ones against the app root, then the cwd."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (APP_ROOT, Path.cwd()):
        if (base / candidate).exists():  # a folder too: load_config then says it is not a file
            return base / candidate
    raise ConfigError("config", f"file not found: {path} (looked in {APP_ROOT} and {Path.cwd()})")


def overrides_from_run_config(run_config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Dotted overrides carried by a Flower run config; empty strings mean 'keep the YAML'."""
    overrides = [
        (key, value)
        for key, value in sorted(run_config.items())
        if key not in (RUN_CONFIG_FILE_KEY, RUN_CONFIG_SET_KEY) and value != ""
    ]
    overrides += [parse_override(item) for item in shlex.split(str(run_config.get(RUN_CONFIG_SET_KEY, "")))]
    return overrides


@functools.lru_cache(maxsize=8)
def _config_from_items(items: tuple[tuple[str, Any], ...]) -> tuple[ExperimentConfig, tuple[str, ...]]:
    run_config = dict(items)
    path = resolve_config_path(str(run_config.get(RUN_CONFIG_FILE_KEY, "conf/default.yaml")))
    config, notes = load_config(path, overrides_from_run_config(run_config), strict=True)
    return config, tuple(notes)


def config_from_run_config(run_config: Mapping[str, Any]) -> ExperimentConfig:
    """The experiment config of a ``flwr run`` (cached: the ClientApp reads it with every message)."""
    return _config_from_items(tuple(sorted(run_config.items())))[0]


@functools.lru_cache(maxsize=8)
def _experiment_from_items(items: tuple[tuple[str, Any], ...]) -> Experiment:
    return Experiment(_config_from_items(items)[0])


def experiment_from_run_config(run_config: Mapping[str, Any]) -> Experiment:
    """The experiment of a ``flwr run``, one per run config in a process (the ClientApp asks with
    every message)."""
    return _experiment_from_items(tuple(sorted(run_config.items())))


def run_config_notes(run_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The notes and warnings reading that config gave (ignored keys, fewer clients than groups)."""
    return _config_from_items(tuple(sorted(run_config.items())))[1]
