"""Shared test helpers: the project root and the default config. Flower's telemetry and its update
check, and Ray's usage statistics, are off for every test and every process a test starts (flwr,
the SuperLink, SuperNodes, SuperExec, Ray): set here, before anything imports flwr (Flower reads
FLWR_TELEMETRY_ENABLED once, when flwr.supercore.telemetry is imported; FLWR_DISABLE_UPDATE_CHECK
when each program starts)."""

from __future__ import annotations

import os

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from pathlib import Path  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "conf" / "default.yaml"



def pytest_report_header(config):
    """Say where the behaviour-preservation fixture was recorded."""
    from trajectories import load_fixture

    from fedcluster_flwr.numerics import describe_platform, is_portable

    platform = load_fixture()["platform"]
    how = "portable numerics: bit for bit on x86-64 CPUs with AVX2" if is_portable(platform) else "this platform only"
    return f"behaviour fixture: recorded on {describe_platform(platform)} ({how}); each test names its mode"
