"""What code made a run: the package's version, the commit of the checkout it was imported from, and
Flower's version; recorded in each run's ``summary.json`` (``software``) beside the numeric platform,
so that a number in a table names the code that computed it."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import fedcluster_flwr

NOT_A_CHECKOUT = "not a git checkout"


def package_version() -> str:
    """The installed distribution's version: pyproject.toml's ``version``, the one place it is written."""
    try:
        return version("fedcluster-flwr")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed: pip install -e .)"


def code_version(package_dir: Path | None = None) -> str:
    """The short commit of the git checkout that ``package_dir`` (default: the imported
    ``fedcluster_flwr``) is tracked in, with ``+changes`` when a file under it differs from that
    commit; :data:`NOT_A_CHECKOUT` where it is not tracked by git (an installed wheel, even one
    inside some repository's virtual environment) or git is missing."""
    package = (package_dir or Path(fedcluster_flwr.__file__).parent).resolve()

    def git(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *command], cwd=package, capture_output=True, text=True, check=False)

    try:
        tracked = git("ls-files", "--error-unmatch", "--", ".")
        if tracked.returncode != 0 or not tracked.stdout.strip():
            return NOT_A_CHECKOUT
        commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        changed = git("status", "--porcelain", "--", ".").stdout.strip()
    except OSError:  # no git on this machine
        return NOT_A_CHECKOUT
    return (commit or "unknown") + ("+changes" if changed else "")


@lru_cache(maxsize=1)
def software() -> dict[str, str]:
    """This process's code, for a run's summary: computed once (a run's code does not change under it)."""
    import flwr

    return {"fedcluster_flwr": package_version(), "code": code_version(), "flwr": flwr.__version__}
