"""Clustered and personalized federated learning on non-IID data, as Flower strategies.

Flower sends anonymous usage events (``flwr.supercore.telemetry``: from ``run_simulation``, the
SuperLink and the SuperNode) unless ``FLWR_TELEMETRY_ENABLED=0``, and its programs (``flwr``,
``flower-superlink``, ``flower-supernode``, ``flower-superexec``) ask Flower's server for a newer
release (``flwr.supercore.update_check``) unless ``FLWR_DISABLE_UPDATE_CHECK=1``; Ray reports usage
statistics to ``usage-stats.ray.io`` a minute after it starts unless ``RAY_USAGE_STATS_ENABLED=0``
(its probe of the cloud metadata addresses at its start no setting turns off: docs/how-to/flwr-run.md).
Importing this package sets the three defaults for this process and the processes it starts (Ray's
workers, the engine process), before any Flower or Ray module reads them, unless the environment
already sets them: nothing leaves the machine unless the user asks (README, docs/how-to/deploy.md).
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
