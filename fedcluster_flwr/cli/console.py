"""``fedcluster``, the console script: stop signals handled from its first instant, then the commands.

    fedcluster run CONFIG [--set KEY=VALUE]... [--out DIR] [--dry-run]
    fedcluster compare | resume | plot | export-partitions ...   (fedcluster --help)

The commands (:mod:`fedcluster_flwr.cli.commands`) import torch, Flower and the strategies: seconds
during which a Ctrl-C would otherwise end in a ``KeyboardInterrupt`` traceback and a SIGTERM
without a word. So this module imports nothing but the standard library, and :func:`main` handles
SIGINT, SIGTERM and SIGHUP before it imports the commands: a stop signal at any instant ends
``fedcluster`` with one line and the shell's code for it, 128 + the signal (130, 143, 129), the
codes of a stopped run (:class:`fedcluster_flwr.runner.Interrupted`, whose handlers take over while
a run goes on). Only the interpreter's own start, before this module, is not covered.

Importing the package turns Flower's telemetry (``FLWR_TELEMETRY_ENABLED=0``) and update check
(``FLWR_DISABLE_UPDATE_CHECK=1``) and Ray's usage statistics (``RAY_USAGE_STATS_ENABLED=0``) off for
fedcluster and the processes it starts, unless the environment sets them (``fedcluster_flwr/__init__.py``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal outside a run: raised by :func:`main`'s handler wherever the program is, as
    Python's own Ctrl-C is (a KeyboardInterrupt, so that code which cleans up after one does)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedcluster`` with ``argv`` (default: the command line); return its exit code."""
    previous = _handle_stop_signals()
    try:
        try:
            from .commands import main as run_command  # torch, Flower, the strategies: seconds
        except KeyboardInterrupt as stop:
            return _stopped(stop, "while starting; nothing was run")
        try:
            return run_command(argv)
        except KeyboardInterrupt as stop:  # a run in progress is the runner's (Interrupted): none was
            return _stopped(stop, "outside a run (none was interrupted); nothing is left running")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _handle_stop_signals() -> dict[int, object]:
    """Make the first stop signal raise :class:`Stopped` (later ones, while it unwinds, are
    ignored: a second Ctrl-C must not interrupt the message of the first); return the handlers it
    replaced. Only the main thread may install handlers; elsewhere none is."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    armed = [True]

    def stop(signum: int, frame: object) -> None:
        if armed[0]:
            armed[0] = False
            raise Stopped(signum)

    return {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}


def _stopped(stop: KeyboardInterrupt, what: str) -> int:
    signum = getattr(stop, "signum", signal.SIGINT)  # Python's own Ctrl-C where no handler was installed
    print(f"{signal.Signals(signum).name}: fedcluster stopped {what}", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
