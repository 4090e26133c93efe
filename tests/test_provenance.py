"""A run names the code that computed it: summary.json's ``software`` and the table commands'
``machine.json`` attempts carry the checkout's commit (``+changes`` when its files differ)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import flwr
import pytest

from conftest import DEFAULT_CONFIG, ROOT
from fedcluster_flwr.config.load import load_config, parse_override
from fedcluster_flwr.results.provenance import NOT_A_CHECKOUT, code_version, package_version

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *command: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A repository holding a package folder ``pkg`` at one commit."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    return repo


@needs_git
def test_a_clean_checkout_is_named_by_its_commit_and_a_changed_one_says_so(checkout):
    package = checkout / "pkg"
    commit = git(checkout, "rev-parse", "--short", "HEAD")
    assert code_version(package) == commit
    (package / "__init__.py").write_text("VALUE = 2\n")
    assert code_version(package) == commit + "+changes"
    (package / "__init__.py").write_text("VALUE = 1\n")
    (package / "extra.py").write_text("NEW = 1\n")  # an untracked module changes what imports
    assert code_version(package) == commit + "+changes"


@needs_git
def test_changes_outside_the_package_do_not_mark_it(checkout):
    (checkout / "notes.md").write_text("a note beside the package\n")
    assert code_version(checkout / "pkg") == git(checkout, "rev-parse", "--short", "HEAD")


@needs_git
def test_a_folder_git_does_not_track_is_not_a_checkout(checkout, tmp_path):
    """An installed copy inside some repository's virtual environment (an ignored, untracked folder)
    must not borrow that repository's commit."""
    installed = checkout / ".venv" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("VALUE = 1\n")
    (checkout / ".gitignore").write_text(".venv/\n")
    assert code_version(installed) == NOT_A_CHECKOUT
    elsewhere = tmp_path / "plain" / "pkg"
    elsewhere.mkdir(parents=True)
    assert code_version(elsewhere) == NOT_A_CHECKOUT


def test_a_runs_summary_names_its_code(tmp_path):
    from fedcluster_flwr.apps.server_app import run_in_process
    from fedcluster_flwr.results.run_files import read_summary

    overrides = ("strategy.name=fedavg", "rounds=1", "partition.num_clients=4", "partition.num_groups=2",
                 "client.epochs=1", "seed=0")
    run_in_process(load_config(DEFAULT_CONFIG, [parse_override(o) for o in overrides])[0], tmp_path / "run")
    software = read_summary(tmp_path / "run")["software"]
    assert software == {"fedcluster_flwr": package_version(), "code": code_version(), "flwr": flwr.__version__}
    assert software["code"]  # a commit, a commit with +changes, or NOT_A_CHECKOUT: never empty


def test_each_table_attempt_names_its_code_and_cpu(tmp_path, monkeypatch):
    """machine.json gets one attempt per stretch of a run, each with the code that ran it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import tables

    tables.record_attempt(tmp_path, "inprocess", 12.34, 0)
    tables.record_attempt(tmp_path, "batched", 5.0, 3)
    attempts = json.loads((tmp_path / "machine.json").read_text())["attempts"]
    assert [(a["engine"], a["seconds"], a["resumed_from_round"]) for a in attempts] == [
        ("inprocess", 12.3, 0), ("batched", 5.0, 3)]
    assert all(a["code"] == code_version() and a["cpu_model"] for a in attempts)
