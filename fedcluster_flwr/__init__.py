"""Clustered and personalized federated learning on non-IID data, as Flower strategies.

Flower sends anonymous usage events (``flwr.supercore.telemetry``: from ``run_simulation``, the
SuperLink and the SuperNode) unless ``FLWR_TELEMETRY_ENABLED=0``. Importing this package sets that
default for this process and the processes it starts (Ray's workers, the engine process), before
any Flower module reads it, unless the environment already sets it: nothing leaves the machine
unless the user asks (README, docs/how-to/deploy.md).
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
