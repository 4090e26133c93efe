"""A run directory read back: its rows, summary and config, and the error for a damaged one.

What a run directory holds (the results contract) is listed in :mod:`fedcluster_flwr.results.recorder`,
which writes it; everything here only reads. A missing, truncated or edited file is a
:class:`DamagedRunError` naming it, and so is an entry a run folder from elsewhere may hold but a
run never writes (a link out of the folder, a loop, a device, a FIFO: :func:`run_folder_entries`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ..declarations.schema import ConfigError

RoundRow = dict[str, Any]


class DamagedRunError(ConfigError):
    """A file of a run directory is missing, truncated or not what fedcluster writes; the message
    names the file and what is wrong with it (a user-facing error: one line, no traceback)."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(str(path), message)


def run_folder_entries(run_dir: Path) -> list[Path]:
    """Every folder and file of run directory ``run_dir`` (paths relative to it, a folder before
    what it holds), checked before anything of it is read or copied: a run folder received from
    someone else may hold what fedcluster never writes. Regular files and folders are what a run
    holds; a symbolic link is followed only where it stays inside the folder, to one of those. The
    first entry that is a link out of the folder (``/etc/hostname``, ``/dev/zero``: its contents
    would be copied or read), a link to nothing, a loop (``sub -> .``, ``loop -> loop``: a copy
    would never end), a device, a FIFO or a socket (a read may never end) is a
    :class:`DamagedRunError` naming it. Nothing is read, nothing is written."""
    root = Path(run_dir).resolve()
    entries: list[Path] = []

    def walk(folder: Path, inside: frozenset[Path]) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.is_symlink():
                _check_link(path, root)
            status = path.stat()  # a link's target, checked to be inside
            if stat.S_ISDIR(status.st_mode):
                real = path.resolve()
                if real in inside:  # a link to a folder that holds it: the walk (and a copy) would never end
                    raise DamagedRunError(path, f"is a symbolic link to {_shown(real, root)}, a folder that holds it: "
                                                "a loop; remove the link")
                entries.append(path.relative_to(run_dir))
                walk(path, inside | {real})
            elif stat.S_ISREG(status.st_mode):
                entries.append(path.relative_to(run_dir))
            else:
                raise DamagedRunError(path, f"is {_kind(status.st_mode)}, not a file a run writes (reading it may never "
                                            "end); remove it")

    walk(Path(run_dir), frozenset({root}))
    return entries


def _check_link(path: Path, root: Path) -> None:
    """A symbolic link in a run folder must lead, without a loop, to something inside the folder."""
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        raise DamagedRunError(path, f"is a symbolic link to nothing ({os.readlink(path)}); remove it") from None
    except (OSError, RuntimeError):  # ELOOP; Python 3.11's resolve raises RuntimeError for it
        raise DamagedRunError(path, f"is a symbolic link that loops ({os.readlink(path)}); remove it") from None
    if not target.is_relative_to(root):
        raise DamagedRunError(path, f"is a symbolic link out of the run folder (to {target}): a run folder holds its "
                                    "own files only; put the file itself there, or remove the link")


def _shown(real: Path, root: Path) -> str:
    return "the run folder itself" if real == root else str(real)


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (a named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "neither a file nor a folder"


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``summary.json`` of ``run_dir``: a JSON object (``"finished": true`` once the run ended)."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedRunError(path, "not found: the run's summary is missing") from None
    except (OSError, ValueError) as err:
        raise DamagedRunError(path, f"cannot be read as JSON ({' '.join(str(err).split())}): truncated or edited") from None
    if not isinstance(summary, dict):
        raise DamagedRunError(path, f"must hold a JSON object, got {type(summary).__name__}")
    return summary


def format_summary(summary: Mapping[str, Any], run_dir: Path) -> str:
    """A finished run's summary as `fedcluster run` (and a `flwr run` at its end) prints it."""
    def pct(value: Any) -> str:
        return "n/a" if value is None else f"{100 * value:.1f} %"

    reached = summary.get("rounds_to_target")
    over = "n/a" if summary.get("pct_clients_over_target") is None else f"{summary['pct_clients_over_target']:.1f} %"
    target = summary.get("target_accuracy")
    def by_cluster(key: str) -> str:
        clusters = summary.get(key) or {}
        text = "  ".join(f"{k}: {pct(v)}" for k, v in list(clusters.items())[:12])
        return text + (f"  ... ({len(clusters)} clusters)" if len(clusters) > 12 else "")

    scores = ", ".join(
        f"{name} {summary[key]:.2f}" for key, name in (("purity", "purity"), ("ari", "ARI"), ("nmi", "NMI"))
        if summary.get(key) is not None
    )
    if one_true_group(summary):
        scores = "one true group: purity, ARI and NMI do not apply"
    lines = [
        f"  mean client accuracy   {pct(summary.get('mean_client_accuracy'))} "
        f"(best {pct(summary.get('best_mean_client_accuracy'))})",
        f"  clients over target    {over} (target {target:g}; the mean "
        f"{f'reached it at round {reached}' if reached else 'never reached the target'})",
        f"  clusters               {summary.get('num_clusters')} ({scores})",
        f"  per-cluster accuracy   {by_cluster('per_cluster_accuracy')}",
        f"  per true cluster       {by_cluster('per_true_cluster_accuracy')}",
        f"  communication          up {summary['bytes_up'] / 1e6:.1f} MB, down {summary['bytes_down'] / 1e6:.1f} MB",
        f"  failures               {summary['fit_failures']} failed fits, {summary['rejected_updates']} rejected updates",
        f"  wall time              {summary['wall_seconds']:.1f} s",
        f"  results                {run_dir}",
    ]
    collapsed = summary.get("clients_no_better_than_majority") or []
    if collapsed:  # a run whose models collapsed is a different result from one that learned less
        lines.append(f"  warning                {len(collapsed)} of {len(summary.get('client_accuracy') or {})} "
                     "clients no better than always answering their most common test label (what a collapsed "
                     "model scores): clients_no_better_than_majority in summary.json")
    lines += [f"  warning                {warning}" for warning in summary.get("warnings") or ()]  # the algorithm's
    return "\n".join(lines)


def one_true_group(summary: Mapping[str, Any]) -> bool:
    """Whether every client of the run is in the same true cluster (iid, dirichlet, flwr_datasets'
    partitioners): scores of the clustering against one group measure nothing (ARI is 1 for one
    cluster found and 0 for any other number, whatever the clients' data)."""
    true = summary.get("true_clusters") or []
    return len(true) > 1 and None not in true and len(set(true)) == 1


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """A run's ``config.yaml`` as plain data (for plots and tables: no validation)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise DamagedRunError(path, "not found: is this a fedcluster run directory?")
    try:
        config = yaml.safe_load(path.read_text(errors="replace"))
    except yaml.YAMLError as err:
        raise DamagedRunError(path, f"is not valid YAML ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(config, dict) or not isinstance(config.get("strategy"), dict):
        raise DamagedRunError(path, "holds no strategy section: not a fedcluster run's config")
    return config


def read_rounds(run_dir: Path) -> list[RoundRow]:
    """The rows of ``rounds.jsonl``. A last line cut short (the run was killed while appending it)
    is left out; any other line that is not a JSON object with a round number is an error."""
    path = Path(run_dir) / "rounds.jsonl"
    if not path.is_file():
        raise DamagedRunError(path, "not found: the run's per-round log is missing")
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break  # the row being appended when the run was killed; its round is redone on resume
            raise DamagedRunError(path, f"line {number} is not valid JSON: truncated or edited") from None
        if not isinstance(row, dict) or isinstance(row.get("round"), bool) or not isinstance(row.get("round"), int):
            raise DamagedRunError(path, f"line {number} is not a round's row (a JSON object with an integer \"round\")")
        rows.append(row)
    return rows


def run_curves(run_dirs: Sequence[Path]) -> list[tuple[str, dict[str, Any], list[RoundRow]]]:
    """Each run's folder name, resolved config and rows: what a comparison plot draws
    (:func:`fedcluster_flwr.plots.plot_comparison`)."""
    return [(Path(d).name, read_run_config(d), read_rounds(d)) for d in run_dirs]
