"""Writing a run directory as the rounds go by: resolved config, per-round metrics, summary,
plots, checkpoints, artifacts; and a branch's copy of another run.

Layout (the results contract)::

    <run>/config.yaml        resolved experiment config
    <run>/rounds.jsonl       one JSON object per round
    <run>/summary.json       final values; rewritten every round ("finished": false until the end)
    <run>/accuracy.png, clients_over_target.png, dendrogram.png (FL+HC)
    <run>/checkpoint/        state.json + models.npz (its arrays) of the latest checkpoint
    <run>/*.npy, *.png       the strategy's artifacts (linkage.npy, relevance.npy, similarity.npy, ...)
    <run>/branch.json        a branch only: the run and round it continues, and the changed options
    <run>/tracking.json      with ``tracking:`` set: the tracker's run id, reopened on resume
    <run>/tensorboard/       with ``tracking: tensorboard``: the event files
    <run>/.claimed           which process started the run (pid, host, time): its claim on the folder

Each file is written atomically (temp file + rename), so an interrupted run never
leaves a truncated file behind; the checkpoint's two files carry their round, so a
run stopped between writing them is detected when resuming.

A run folder holds one run: a fresh run (or a branch) first claims its folder by creating
``.claimed`` with ``O_CREAT | O_EXCL``, which of two processes started together exactly one
can do; the other is refused with a :class:`RunFolderTaken` naming the folder before it has
written anything. The claim stays: a folder once claimed is a used folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from .checkpoints import checkpoint_round, write_checkpoint
from .files import atomic_write, written_aside
from ..plots import plot_rounds
from .run_files import RoundRow, read_rounds, run_folder_entries
from ..declarations.schema import ConfigError
from .tracking import TRACKING_FILE, Tracker, branch_record, check_tracking, open_tracker


def json_ready(value: Any) -> Any:
    """Plain JSON types; NaN/inf become null so the files are strict JSON."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_ready(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(value) else float(value)
    return value


CLAIM_FILE = ".claimed"


class RunFolderTaken(ConfigError):
    """A run folder already holds a run, or another run claimed it first (one line, naming it;
    under ``key``, the option that gave the folder, if given)."""

    def __init__(self, run_dir: Path, message: str, key: str = "") -> None:
        self.run_dir = run_dir
        self.reason = message
        if key:
            super().__init__(key, f"{run_dir} {message}")
        else:
            super().__init__(str(run_dir), message)


def _claimant(run_dir: Path) -> dict[str, Any]:
    try:
        claim = json.loads((run_dir / CLAIM_FILE).read_text())
    except (OSError, ValueError):
        return {}  # being written by its claimant this very moment, or damaged: not ours either way
    return claim if isinstance(claim, dict) else {}


def release_unused_claim(run_dir: Path) -> None:
    """Give up this process's claim of ``run_dir`` if the run wrote nothing else (stopped while
    starting): the same command can then start it again. The folder goes too if it is empty."""
    claim = Path(run_dir) / CLAIM_FILE
    mine = _claimant(Path(run_dir))
    if claim.is_file() and not _holds_run_files(Path(run_dir)) and mine.get("host") == socket.gethostname() \
            and mine.get("pid") == os.getpid():
        claim.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            Path(run_dir).rmdir()


def claim_run_dir(run_dir: Path, key: str = "") -> None:
    """Make the new or empty folder ``run_dir`` this run's, atomically (see the module docstring).
    A claim made by this process or by its parent (``fedcluster run`` claims the folder before it
    starts the process that runs the rounds) is this run's own. Raises :class:`RunFolderTaken` (on
    ``key``, the option that named the folder) if the folder holds files or another run claimed
    it; nothing is written then."""
    run_dir = Path(run_dir)
    claim = run_dir / CLAIM_FILE
    if claim.is_file() and not _holds_run_files(run_dir):
        mine = _claimant(run_dir)
        if mine.get("host") == socket.gethostname() and mine.get("pid") in (os.getpid(), os.getppid()):
            return
    check_run_dir_free(run_dir, key)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        check_run_dir_free(run_dir, key)  # raises, saying what the run that claimed it first has written
        raise RunFolderTaken(run_dir, _taken_message(run_dir), key) from None
    except OSError as err:  # unwritable, a file on the way: nothing was written
        raise RunFolderTaken(run_dir, f"cannot be created or written ({err.strerror or err}); give another directory",
                             key) from None
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                     "started": datetime.now().isoformat(timespec="seconds")}) + "\n")
    except OSError as err:  # a full disk: the claim goes, the folder stays free
        claim.unlink(missing_ok=True)
        raise RunFolderTaken(run_dir, f"cannot be written ({err.strerror or err}); free space or give another directory",
                             key) from None


_HELD: set[Path] = set()  # the run folders this process holds (see ``holding``)


@contextlib.contextmanager
def holding(run_dir: Path, key: str = "") -> Iterator[None]:
    """This process's exclusive hold on the existing folder ``run_dir`` while it runs or continues the
    run there: a second ``fedcluster run``/``resume`` of the same folder meanwhile is refused in one
    line (:class:`RunFolderTaken`) instead of writing beside it. An advisory lock on the folder itself
    (no file is added), which the operating system drops when the process ends, however it ends.
    Nested holds of one folder in one process are one hold."""
    folder = Path(run_dir).resolve()
    if folder in _HELD:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderTaken(run_dir, "is in use: another fedcluster process is running or continuing the run "
                                 "there; wait for it to end (or stop it), then try again", key) from None
        _HELD.add(folder)
        try:
            yield
        finally:
            _HELD.discard(folder)
    finally:
        os.close(fd)


def in_use_elsewhere(run_dir: Path) -> str | None:
    """Whether another process runs the run in ``run_dir`` or is starting it: why (for a log line),
    or None. In use: another process holds the folder (:func:`holding`), or the folder has no
    checkpoint yet and its claim names a live process on this host other than this one (a run
    starting: claimed, loading its data, not yet held). Nothing is written or kept held, so a
    caller that goes on must still take the folder (its ``holding`` or claim decides a race).
    A claim from another host cannot be checked and does not count."""
    folder = Path(run_dir)
    if not folder.is_dir() or folder.resolve() in _HELD:
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "another process is running it"
    finally:
        os.close(fd)  # closing the descriptor drops a lock taken just now
    who = _claimant(folder)
    if checkpoint_round(folder) is None and who.get("pid") != os.getpid() and _claimant_alive(who):
        return f"pid {who['pid']} claimed it at {who.get('started')} and is starting it"
    return None


def check_run_dir_free(run_dir: Path, key: str = "") -> None:
    """``run_dir`` can hold a new run: it is new, or an empty folder nobody claimed; else a
    :class:`RunFolderTaken` saying what is there (nothing is written)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderTaken(run_dir, "is a file, expected a folder; give a new directory", key)
    if _holds_run_files(run_dir):
        raise RunFolderTaken(run_dir, "already holds files; give a new directory (results are never overwritten)", key)
    if (run_dir / CLAIM_FILE).is_file():
        raise RunFolderTaken(run_dir, _taken_message(run_dir), key)


def _holds_run_files(run_dir: Path) -> bool:
    return run_dir.is_dir() and any(p.name != CLAIM_FILE for p in run_dir.iterdir())


def _taken_message(run_dir: Path) -> str:
    who = _claimant(run_dir)
    by = f" (pid {who['pid']} on {who.get('host')}, since {who.get('started')})" if "pid" in who else ""
    if _claimant_alive(who) is False:
        return (f"was claimed by a run{by} that has ended without writing anything else (stopped while starting); "
                f"give a new directory, or delete {run_dir / CLAIM_FILE} to use this one")
    return (f"claimed by another run{by}; give a new directory (a folder holds one run: of two runs started "
            "with one output folder, the first to claim it runs)")


def _claimant_alive(who: Mapping[str, Any]) -> bool | None:
    """Whether the process of a claim (:func:`_claimant`) still runs; None where that cannot be told
    (a claim from another host, or without a pid)."""
    if who.get("host") != socket.gethostname() or not isinstance(who.get("pid"), int):
        return None
    return _alive(who["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid we can ask about: assume it runs
    return True


def run_dir_name(strategy: str, dataset: str, partition: str) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return f"{stamp}_{strategy}_{dataset}_{partition}"


class RunRecorder:
    """Writes a run's results contract as the rounds go by."""

    def __init__(
        self, run_dir: Path, on_round: Callable[[RoundRow], None] | None = None, config: Mapping[str, Any] | None = None,
        phase_words: Mapping[str, str] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.phase_words = phase_words  # phase name -> words for the plots' legend (plots.phase_words)
        self.on_round = on_round
        self.config = config or {}  # the resolved config, as plain data: its ``tracking`` is opened
        self.rows: list[RoundRow] = []
        self.tracker: Tracker | None = None  # `tracking:` (fedcluster_flwr.results.tracking), opened by start/resume

    def start(self, resolved_config: Mapping[str, Any]) -> None:
        """Begin a run in an empty (or new) directory, claimed for it (:func:`claim_run_dir`);
        never overwrite an earlier run, never share a folder with another."""
        check_tracking(str(resolved_config.get("tracking") or "none"))  # a missing package: nothing written
        claim_run_dir(self.run_dir)
        atomic_write(self.run_dir / "config.yaml", yaml.safe_dump(dict(resolved_config), sort_keys=False))
        atomic_write(self.run_dir / "rounds.jsonl", "")
        self.write_summary({"finished": False, "completed_rounds": 0})
        self.config = resolved_config
        self.tracker = open_tracker(self.run_dir, resolved_config, 0)

    def resume(self, completed_round: int) -> None:
        """Continue a run after ``completed_round``: keep the rows up to it, drop later ones."""
        self.rows = [row for row in read_rounds(self.run_dir) if row["round"] <= completed_round]
        atomic_write(self.run_dir / "rounds.jsonl", "".join(json.dumps(row) + "\n" for row in self.rows))
        self.tracker = open_tracker(self.run_dir, self.config, completed_round)

    def log_round(self, row: RoundRow) -> None:
        row = json_ready(row)
        self.rows.append(row)
        # One unbuffered write, one system call: a run killed mid-round never leaves half a row
        # (a buffered file writes a row longer than its 8 KiB buffer in pieces).
        with open(self.run_dir / "rounds.jsonl", "ab", buffering=0) as handle:
            handle.write((json.dumps(row) + "\n").encode())
        if self.tracker is not None:  # after the file: a tracker never holds up or loses a row
            self.tracker.log_round(row)
        if self.on_round is not None:
            self.on_round(row)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        summary = json_ready(summary)
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.tracker is not None:
            self.tracker.log_summary(summary)

    def save_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """``checkpoint/state.json`` and ``checkpoint/models.npz``: the tree ``checkpoint`` (dicts,
        lists, JSON scalars and arrays; see :func:`~fedcluster_flwr.results.checkpoints.load_checkpoint`)
        with every array moved to the ``.npz``. Both files carry ``checkpoint["round"]``, so a torn
        pair is detected; ``state.json`` is tied to this run's row of that round."""
        write_checkpoint(self.run_dir / "checkpoint", checkpoint, self.rows)

    def write_artifacts(self, artifacts: Mapping[str, Any]) -> None:
        """Files a strategy describes, by name: arrays as ``.npy``, figures drawn to their path."""
        for name, artifact in artifacts.items():
            path = self.run_dir / name
            if isinstance(artifact, np.ndarray):
                with written_aside(path, "wb") as handle:
                    np.save(handle, artifact)
            else:
                artifact(path)

    def plot(self, target_accuracy: float, title: str, phase_words: Mapping[str, str] | None = None) -> None:
        """``accuracy.png`` and ``clients_over_target.png`` of the rounds so far (:func:`plot_rounds`);
        ``phase_words`` (phase name -> words) names the phases in the legend, by default the
        recorder's own (given when it was made)."""
        words = self.phase_words if phase_words is None else phase_words
        plot_rounds(self.rows, self.run_dir, target_accuracy, title, phase_words=words)


BRANCH_FILE = "branch.json"


# What a branch does not copy of its source: plots, a saved update matrix, hidden files (the claim),
# and the source's tracker run, which is its own (the branch gets a link to it instead).
NOT_COPIED = ("*.png", "updates.npy", ".*", TRACKING_FILE)


def branch_run(
    source: Path, target: Path, resolved_config: Mapping[str, Any], completed_round: int, overrides: Sequence[str]
) -> None:
    """Start run ``target`` as a copy of run ``source`` at its checkpoint (``completed_round``),
    with ``resolved_config`` (the source's, with ``overrides`` applied).

    ``branch.json`` records where the branch came from; ``rounds.jsonl`` is cut back to the
    checkpoint when the branch resumes. Plots and a saved update matrix are not copied. Only the
    source's files and folders are copied, as :func:`run_folder_entries` checked them (a link out
    of the source, a loop or a FIFO is an error naming it, raised before ``target`` is claimed).
    """
    entries = [e for e in run_folder_entries(source) if not any(fnmatch(part, pattern) for part in e.parts
                                                                for pattern in NOT_COPIED)]
    claim_run_dir(target)
    for entry in entries:  # folders come before what they hold
        if (source / entry).is_dir():
            (target / entry).mkdir(exist_ok=True)
        else:
            shutil.copy2(source / entry, target / entry)
    if (link := branch_record(source, completed_round)) is not None:
        atomic_write(target / TRACKING_FILE, json.dumps(link, indent=2) + "\n")
    atomic_write(target / "config.yaml", yaml.safe_dump(dict(resolved_config), sort_keys=False))
    atomic_write(target / "summary.json", json.dumps({"finished": False, "completed_rounds": completed_round}) + "\n")
    earlier = source / BRANCH_FILE
    provenance = {
        "source": str(source),
        "round": completed_round,
        "overrides": list(overrides),
        "source_branch": json.loads(earlier.read_text()) if earlier.is_file() else None,
    }
    atomic_write(target / BRANCH_FILE, json.dumps(provenance, indent=2) + "\n")
