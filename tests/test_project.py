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
from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.apps.run_config import config_from_run_config, overrides_from_run_config
from fedcluster_flwr.declarations.schema import ConfigError


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines()]


def test_ci_runs_exactly_the_readme_test_command():
    test_command = next(line for line in readme_commands() if "pytest" in line)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_the_readme_command_runs_the_fast_tier_and_ci_runs_the_slow_tier_after_it():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        addopts = tomllib.load(handle)["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow'" in addopts  # `python -m pytest` is the fast tier
    test_command = next(line for line in readme_commands() if "pytest" in line)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines.index("python -m pytest -m slow") > ci_lines.index(test_command)


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
    "client.epochs": 2, "client.batch_size": 8, "client.lr": 0.1, "strategy.name": "ifca",
    "strategy.client_fraction": 0.5, "strategy.num_clusters": 3,
}


def test_every_run_config_key_is_a_valid_override():
    run_config = app_run_config()
    overridable = set(run_config) - {"config", "set"}
    assert overridable == set(SAMPLE_VALUES), "update SAMPLE_VALUES with the new pyproject keys"
    run_config.update(SAMPLE_VALUES, set="strategy.client_fraction=0.25 client.momentum=0.9")
    config = config_from_run_config(run_config)
    assert config.rounds == 4 and config.dataset.name == "mnist" and config.model.name == "mlp3"
    assert config.strategy.options.client_fraction == 0.25  # `set` comes last and wins
    assert config.strategy.options.num_clusters == 3
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
    assert "fedcluster_flwr/apps/server_app.py" in names and "fedcluster_flwr/apps/client_app.py" in names
    assert not any(name.startswith((".venv/", "outputs/", "benchmarks/", "tests/")) for name in names)


def test_fab_is_format_1_with_the_license_and_the_package(tmp_path):
    """Flower checks format 1's metadata (licence file, target version within the flwr pin) when it
    builds; the FAB then carries LICENSE next to the package."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    app = project["tool"]["flwr"]["app"]
    assert app["fab-format-version"] == 1 and project["project"]["license"] == {"file": "LICENSE"}
    assert "LICENSE" in app["fab-include"]
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    flwr = Path(sys.executable).with_name("flwr")
    result = subprocess.run([str(flwr), "build", "--app", str(ROOT)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (fab,) = tmp_path.glob("*.fab")
    with zipfile.ZipFile(fab) as bundle:
        names = set(bundle.namelist())
        assert bundle.read("LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert {"fedcluster_flwr/__init__.py", "fedcluster_flwr/cli/console.py", "conf/default.yaml"} <= names


def test_flwr_refuses_format_1_without_the_license_file_so_format_1_is_what_applies(tmp_path):
    """Without format 1 Flower would silently apply format 0 (FLOWER_NOTES): an app whose licence is
    inline text must be refused, or the checks above prove nothing."""
    app = tmp_path / "app"
    app.mkdir()
    text = (ROOT / "pyproject.toml").read_text().replace('license = { file = "LICENSE" }', 'license = { text = "Apache-2.0" }')
    assert text != (ROOT / "pyproject.toml").read_text()
    (app / "pyproject.toml").write_text(text)
    (app / "LICENSE").write_text((ROOT / "LICENSE").read_text())
    for folder in ("fedcluster_flwr", "conf"):
        (app / folder).symlink_to(ROOT / folder)
    flwr = Path(sys.executable).with_name("flwr")
    result = subprocess.run([str(flwr), "build", "--app", str(app)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "fab-format-version = 1 requires [project].license" in result.stdout + result.stderr


def test_a_wheel_builds_and_passes_twine_check(tmp_path):
    """The wheel PyPI would get, with LICENSE in its metadata, and metadata twine accepts. Built with
    the installed backend (--no-isolation: no download in a test; the test extra pins it as
    [build-system] does). About 3 s, so not slow."""
    for module in ("build", "twine", "hatchling"):
        pytest.importorskip(module, reason=f"the test extra installs {module}: pip install -e '.[test]'")
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = tmp_path.glob("fedcluster_flwr-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "fedcluster_flwr/cli/console.py" in names and not any(n.startswith("tests/") for n in names)
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and "PASSED" in checked.stdout, checked.stdout + checked.stderr
