"""``python -m fedcluster_flwr.cli``: the ``fedcluster`` console script."""

import sys

from .console import main

sys.exit(main())
