"""The add-algorithm page's example of a local objective runs as written: its family, loaded from
outside the package by name, trains as the shipped FedProx on the inprocess and batched engines."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr import registry
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.apps.server_app import run_in_process

PAGE = ROOT / "docs" / "how-to" / "add-algorithm.md"


def example_files() -> dict[str, str]:
    """Each ``<!-- example: path -->`` block of the page, by path."""
    blocks = re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    return {path: code for path, code in blocks}


@pytest.mark.parametrize("engine", ["inprocess", "batched"])
def test_the_pages_objective_example_trains_as_fedprox(engine, tmp_path, monkeypatch):
    files = example_files()
    assert "fedcluster_example_prox/__init__.py" in files
    for path, code in files.items():
        (tmp_path / "src" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / path).write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("FEDCLUSTER_ALGORITHMS", "fedcluster_example_prox")
    common = ("rounds=2", "strategy.client_fraction=0.5", "strategy.mu=0.3", f"simulation.engine={engine}")
    runs = {}
    for name in ("example_prox", "fedprox"):
        config, _ = load_config(DEFAULT_CONFIG, [parse_override(o) for o in (f"strategy.name={name}", *common)])
        runs[name] = run_in_process(config, tmp_path / name)
    try:
        for a, b in zip(runs["fedprox"].models[0], runs["example_prox"].models[0]):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    finally:  # the other tests see the shipped families only
        registry.STRATEGIES.pop("example_prox", None)
        registry.OBJECTIVES.pop("example_proximal", None)
        registry._loaded.discard("fedcluster_example_prox")
        sys.modules.pop("fedcluster_example_prox", None)
