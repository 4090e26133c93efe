"""Shared test helpers: the project root and the default config."""

from __future__ import annotations

from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "conf" / "default.yaml"



def pytest_report_header(config):
    """Say how the behaviour-preservation fixture is compared on this machine."""
    from test_behaviour_preserved import comparison_mode

    return f"behaviour fixture: {comparison_mode()[1]}"
