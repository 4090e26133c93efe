"""Project wiring: README commands vs CI, the Flower app's run config and FAB contents."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config import load_config
from fedcluster_flwr.experiment import config_from_run_config, overrides_from_run_config
from fedcluster_flwr.schema import ConfigError


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines()]


def test_ci_runs_exactly_the_readme_test_command():
    test_command = next(line for line in readme_commands() if "pytest" in line)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_starts_with_the_main_job_then_the_tests():
    first, second = readme_commands()[:2]
    assert first.endswith("fedcluster run conf/default.yaml") and "pip install torch==" in first
    assert second.endswith("python -m pytest") and '".[test]"' in second


def app_run_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        table = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]

    def flatten(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(flatten(table))


def test_default_run_config_is_the_default_yaml():
    assert config_from_run_config(app_run_config()) == load_config(DEFAULT_CONFIG)[0]


@pytest.mark.parametrize("name", ["label_swap", "pathological", "iid", "recommended"])
def test_flhc_conf_files_hold_the_papers_setting(name):
    """Briggs et al.: 100 clients x 600 training samples, CNN, batch 10, 3 epochs, lr 0.1, 50 rounds, cf 0.2, n 10."""
    config, _ = load_config(ROOT / "conf" / f"flhc_mnist_{name}.yaml")
    partition, options = config.partition, config.strategy.options
    assert (config.dataset.name, config.model.name, config.strategy.name) == ("mnist", "cnn_briggs", "flhc")
    assert partition.num_clients == 100
    assert round(partition.samples_per_client * (1 - partition.test_fraction)) == 600
    assert (config.client.batch_size, config.client.epochs, config.client.lr, config.rounds) == (10, 3, 0.1, 50)
    assert (options.client_fraction, options.rounds_before_clustering) == (0.2, 10)
    assert options.threshold is not None and config.target_accuracy == 0.99
    if name == "recommended":
        assert (options.distance, options.linkage) == ("l1", "complete")


SAMPLE_VALUES = {
    "seed": 3, "rounds": 4, "target_accuracy": 0.8, "output_dir": "/tmp/x", "dataset.name": "mnist",
    "dataset.data_dir": "/data", "partition.name": "iid", "partition.num_clients": 10, "model.name": "mlp3",
    "client.epochs": 2, "client.batch_size": 8, "client.lr": 0.1, "strategy.name": "fedavg",
    "strategy.client_fraction": 0.5,
}


def test_every_run_config_key_is_a_valid_override():
    run_config = app_run_config()
    overridable = set(run_config) - {"config", "set"}
    assert overridable == set(SAMPLE_VALUES), "update SAMPLE_VALUES with the new pyproject keys"
    run_config.update(SAMPLE_VALUES, set="strategy.client_fraction=0.25 client.momentum=0.9")
    config = config_from_run_config(run_config)
    assert config.rounds == 4 and config.dataset.name == "mnist" and config.model.name == "mlp3"
    assert config.strategy.options.client_fraction == 0.25  # `set` comes last and wins
    assert config.client.momentum == 0.9


def test_run_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="strategy.linkage"):
        config_from_run_config({**app_run_config(), "set": "strategy.linkage=ward strategy.distance=cosine"})
    assert overrides_from_run_config({"config": "x", "set": "", "rounds": ""}) == []


def test_fab_carries_the_configs(tmp_path):
    flwr = Path(sys.executable).with_name("flwr")  # the CLI installed beside this interpreter
    result = subprocess.run([str(flwr), "build", "--app", str(ROOT)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (fab,) = tmp_path.glob("*.fab")
    names = set(zipfile.ZipFile(fab).namelist())
    assert "conf/default.yaml" in names
    assert "fedcluster_flwr/server_app.py" in names and "fedcluster_flwr/client_app.py" in names
    assert not any(name.startswith((".venv/", "outputs/", "benchmarks/", "tests/")) for name in names)
