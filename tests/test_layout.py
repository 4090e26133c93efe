"""The package's layout rules (docs/development.md, "Code layout"), checked on the source: no import
circles, no file over 450 lines, Flower only where it belongs and only its current API, a strategy's
setup holding only the algorithm's inputs."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from conftest import ROOT
from fedcluster_flwr.algorithms.base import StrategySetup

PACKAGE = ROOT / "fedcluster_flwr"
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """The modules a file imports, anywhere in it (functions and ``if TYPE_CHECKING:`` included: a
    reader follows those arrows too), as absolute names."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import tasks`
    return found


def import_edges() -> tuple[list[str], set[tuple[str, str]]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {(name, target) for name, path in modules.items() for target in imported_modules(path)
             if target in modules and target != name
             # A package's __init__ that re-exports its modules is the package, not a circle with them.
             and not target.startswith(name + ".")}
    return sorted(modules), edges


def test_no_import_circles():
    names, edges = import_edges()
    index = {name: k for k, name in enumerate(names)}
    rows, cols = zip(*((index[a], index[b]) for a, b in edges))
    graph = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(names), len(names)))
    _, labels = connected_components(graph, directed=True, connection="strong")
    circles = [sorted(n for n, label in zip(names, labels) if label == c) for c in set(labels)]
    circles = [c for c in circles if len(c) > 1]
    assert not circles, f"import circles: {circles}"


IMPORT_FREE_PACKAGES = ("config", "declarations", "results", "cli")  # import their modules, not the package


@pytest.mark.parametrize("package", IMPORT_FREE_PACKAGES)
def test_the_folders_re_export_nothing(package):
    """A folder's ``__init__`` imports nothing: its modules are imported by their own names, so that
    importing one (the console script's ``cli.console``, before any heavy import) loads no other."""
    assert not {m for m in imported_modules(PACKAGE / package / "__init__.py") if m.startswith("fedcluster_flwr")}


def test_the_command_line_is_the_top_and_the_results_sit_below_the_run():
    """``cli/`` (the console script, its commands, export, the generated pages) is imported by nothing
    in the package; ``results/`` (what a run leaves: written as the rounds go by, read back) imports
    nothing of what runs it: the CLI, the runner and its process, the apps, the engines, the experiment."""
    def within(module: str, *packages: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    modules = {module_name(p): imported_modules(p) for p in PACKAGE.rglob("*.py")}
    into_cli = {name for name, imported in modules.items()
                if not within(name, "fedcluster_flwr.cli") and any(within(m, "fedcluster_flwr.cli") for m in imported)}
    assert not into_cli
    above = ("fedcluster_flwr.cli", "fedcluster_flwr.runner", "fedcluster_flwr.run_process", "fedcluster_flwr.apps",
             "fedcluster_flwr.engines", "fedcluster_flwr.experiment")
    upward = {name: sorted(m for m in imported if within(m, *above)) for name, imported in modules.items()
              if within(name, "fedcluster_flwr.results")}
    assert not {name: up for name, up in upward.items() if up}


def test_no_file_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


FLOWER_FREE = [
    "fedcluster_flwr/training.py", "fedcluster_flwr/aggregation.py", "fedcluster_flwr/clustering.py",
    "fedcluster_flwr/l1_kernel.py", "fedcluster_flwr/features.py", "fedcluster_flwr/models.py",
    "fedcluster_flwr/registry.py", "fedcluster_flwr/types.py",
    "fedcluster_flwr/engines/stacked.py", "fedcluster_flwr/engines/batched.py",
    *sorted(str(p.relative_to(ROOT)) for p in PACKAGE.glob("algorithms/*/math.py")),
    *sorted(str(p.relative_to(ROOT)) for p in PACKAGE.glob("algorithms/*/tasks.py")),
    "fedcluster_flwr/algorithms/base/selection.py",
]


@pytest.mark.parametrize("path", FLOWER_FREE)
def test_paper_math_training_aggregation_clustering_and_the_batched_engine_import_no_flwr(path):
    assert not {m for m in imported_modules(ROOT / path) if m.split(".")[0] == "flwr"}


def test_a_strategy_setup_holds_only_the_algorithms_inputs():
    fields = {f.name for f in dataclasses.fields(StrategySetup)}
    run_infrastructure = {"recorder", "checkpoint_every", "stop_round", "title", "target_accuracy",
                          "numeric_platform", "wait_for_clients_s", "timeout_s", "join_round"}
    assert not fields & run_infrastructure
    assert {"initial_weights", "num_clients", "rounds", "seed"} <= fields


def test_no_strategy_writes_files_or_sees_the_round_log():
    for path in PACKAGE.glob("algorithms/**/*.py"):
        imported = imported_modules(path)
        assert "fedcluster_flwr.results.round_log" not in imported, path
        assert "fedcluster_flwr.results.files" not in imported, path
        if path.name != "plots.py":  # a figure is drawn to the path the results side gives it
            assert ".write_text(" not in path.read_text() and ".savefig(" not in path.read_text(), path


# ---- Flower's current API only: nothing from its legacy components -----------------------------------

# Flower 1.42 keeps its legacy API (NumPyClient/Client, the Strategy of configure_fit, FitIns/FitRes/
# Parameters, ServerAppComponents, client_fn apps) as "deprecated legacy components" (flwr/compat,
# re-exported by flwr.client, flwr.server and flwr.common). The package speaks the Message API only.
LEGACY_MODULES = ("flwr.compat", "flwr.client", "flwr.server", "flwr.simulation.legacy_app")
# What may still come from those places: Flower's simulation engine's message loop that
# flower_patches speeds up (an internal of the runtime, not a legacy API).
LEGACY_EXCEPTIONS = {"fedcluster_flwr/flower_patches.py": ("flwr.server.superlink.fleet.vce",)}
# flwr.common is also the legacy spelling of the message types; from it, only the log and constants.
FROM_FLWR_COMMON = {"flwr.common", "flwr.common.log", "flwr.common.logger", "flwr.common.logger.FLOWER_LOGGER",
                    "flwr.common.constant", "flwr.common.constant.SUPERLINK_NODE_ID", "flwr.common.constant.ErrorCode"}


def test_the_package_imports_nothing_from_flowers_legacy_api():
    """Walks every module's imports (functions and TYPE_CHECKING blocks included)."""
    sources = sorted(PACKAGE.rglob("*.py"))
    found = {}
    for path in sources:
        where = str(path.relative_to(ROOT))
        allowed = LEGACY_EXCEPTIONS.get(where, ())
        legacy = sorted(
            m for m in imported_modules(path)
            if any(m == prefix or m.startswith(prefix + ".") for prefix in LEGACY_MODULES)
            and not any(m == ok or m.startswith(ok + ".") for ok in allowed)
            or m.startswith("flwr.common") and m not in FROM_FLWR_COMMON
        )
        if legacy:
            found[where] = legacy
    assert len(sources) > 50 and not found, f"legacy Flower imports: {found}"


def test_no_filter_hides_flowers_deprecation_notices():
    """Flower says DEPRECATED FEATURE where the package still uses one (run_simulation, docs/how-to/flwr-run.md):
    the notice is shown, not filtered."""
    assert not [p for p in PACKAGE.rglob("*.py") if "DEPRECATED" in p.read_text()]


def test_a_fedcluster_run_loads_no_superlink_code():
    """The engine process (fedcluster run's Ray, inprocess and batched routes) does not import Flower's
    SuperLink, which loads SQLAlchemy: ~0.8 s of every run's start-up on a 2-core machine (issue #52's
    timing found it; only the `flwr run` route's check of its grid needs the SuperLink's InMemoryGrid)."""
    probe = ("import sys, fedcluster_flwr.run_process, fedcluster_flwr.apps.server_app, "
             "fedcluster_flwr.apps.client_app, fedcluster_flwr.engines.inprocess; "
             "print(sorted(m for m in sys.modules if m.startswith(('flwr.superlink', 'sqlalchemy'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
