"""The checkpoint format: ``checkpoint/state.json`` + ``checkpoint/models.npz``, written, read back
and checked, and whether a run directory can be resumed from it.

The two files carry their round, so a run stopped between writing them is detected when resuming;
``state.json`` carries a digest of its round's row in ``rounds.jsonl``, so a checkpoint copied in
from another run is told apart. Three files name the run's strategy: ``config.yaml``,
``state.json`` and ``summary.json`` (rewritten by the run after every round); where they
disagree, the one that differs from the two others is named (:func:`check_strategy_names`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .files import written_aside
from .run_files import DamagedRunError, RoundRow, read_rounds, read_summary


ROW_DIGEST = "row_digest"  # state.json: row_digest() of the checkpoint round's row in rounds.jsonl


def row_digest(row: Mapping[str, Any]) -> str:
    """A fingerprint of a round's row as ``rounds.jsonl`` holds it. Rows carry the round's wall
    seconds, so two runs (even of one config) practically never share one."""
    return hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()[:16]


CHECKPOINT_FORMAT = 2  # 1: before strategies had state_dict() (models by name + flat state); not readable
_ARRAY, _INT_KEYS = "__array__", "__int_keys__"


def _arrays_out(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` as JSON, each array replaced by a reference into ``arrays``; a dict with int
    keys (cluster ids, partition ids) is marked so that they come back as ints."""
    if isinstance(value, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {_ARRAY: key}
    if isinstance(value, Mapping):
        int_keys = bool(value) and all(isinstance(k, (int, np.integer)) for k in value)
        plain = {str(k): _arrays_out(v, arrays) for k, v in value.items()}
        return {_INT_KEYS: plain} if int_keys else plain
    if isinstance(value, (list, tuple)):
        return [_arrays_out(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _arrays_in(value: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if _ARRAY in value:
            return arrays[value[_ARRAY]]
        if _INT_KEYS in value:
            return {int(k): _arrays_in(v, arrays) for k, v in value[_INT_KEYS].items()}
        return {k: _arrays_in(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_arrays_in(v, arrays) for v in value]
    return value


def write_checkpoint(folder: Path, checkpoint: Mapping[str, Any], rows: Sequence[RoundRow]) -> None:
    """``folder/state.json`` and ``folder/models.npz``: the tree ``checkpoint`` (dicts, lists, JSON
    scalars and arrays; see :func:`load_checkpoint`) with every array moved to the ``.npz``. Both
    files carry ``checkpoint["round"]``, so a torn pair is detected; ``rows`` (the run's rows so
    far) give ``state.json`` the digest of its round's row."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    state = {"format": CHECKPOINT_FORMAT, **_arrays_out(checkpoint, arrays)}
    arrays["round"] = np.asarray(checkpoint["round"])
    logged = [row for row in rows if row["round"] == checkpoint["round"]]
    if logged:  # ties the checkpoint to this run's log: one copied in from another run is told apart
        state[ROW_DIGEST] = row_digest(logged[-1])
    # Nested, so that both are written before either replaces the last checkpoint: a run killed
    # now (kill -9, a stop signal) leaves a torn pair only if killed between the two renames,
    # microseconds rather than the time it takes to write them.
    with written_aside(folder / "models.npz", "wb") as models, written_aside(folder / "state.json") as state_file:
        np.savez(models, **arrays)
        state_file.write(json.dumps(state, indent=1) + "\n")


def read_checkpoint_state(run_dir: Path) -> dict[str, Any]:
    """``checkpoint/state.json`` of ``run_dir``, checked: a JSON object of this checkpoint format
    with an integer ``round`` and the ``strategy`` and ``log`` states (arrays still references)."""
    path = Path(run_dir) / "checkpoint" / "state.json"
    if not path.is_file():
        raise DamagedRunError(path, "not found: the run has no checkpoint to resume from")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise DamagedRunError(path, "is empty (the run was stopped while writing it, or the file was truncated)")
    try:
        state = json.loads(text)
    except json.JSONDecodeError as err:
        raise DamagedRunError(path, f"is not valid JSON ({err.msg}: line {err.lineno}, column {err.colno}): truncated or edited") from None
    if not isinstance(state, dict):
        raise DamagedRunError(path, f"must hold a JSON object, got {type(state).__name__}")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise DamagedRunError(
            path, f"has checkpoint format {state.get('format', 1)}; this version reads format {CHECKPOINT_FORMAT} "
            "only (resume it with the fedcluster version that wrote it)"
        )
    done = state.get("round")
    if isinstance(done, bool) or not isinstance(done, int) or done < 1:
        got = "none" if done is None else repr(done)
        raise DamagedRunError(path, f"lacks its round number (\"round\": a positive integer; got {got}): not a complete checkpoint")
    missing = [key for key in ("strategy", "log") if not isinstance(state.get(key), dict)]
    if missing:
        raise DamagedRunError(path, f"lacks the {' and '.join(missing)} state: not a complete checkpoint")
    return state


def _array_references(value: Any) -> list[str]:
    if isinstance(value, dict):
        if _ARRAY in value:
            return [value[_ARRAY]]
        return [key for v in value.values() for key in _array_references(v)]
    if isinstance(value, list):
        return [key for v in value for key in _array_references(v)]
    return []


def check_checkpoint_arrays(run_dir: Path, state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Check ``checkpoint/models.npz`` against its ``state.json`` without reading the arrays: a
    readable zip of the same round holding every array the state refers to. Returns each
    array's shape (from the ``.npy`` headers)."""
    import zipfile

    path = Path(run_dir) / "checkpoint" / "models.npz"
    if not path.is_file():
        raise DamagedRunError(path, "not found: the checkpoint's arrays are missing")
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, _ = read_header(member)
                shapes[info.filename.removesuffix(".npy")] = shape
            with archive.open("round.npy") as member:
                saved_round = int(np.lib.format.read_array(member))
    except KeyError:
        raise DamagedRunError(path, "holds no round: not a fedcluster checkpoint") from None
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise DamagedRunError(path, f"is truncated or corrupted ({' '.join(str(err).split()) or type(err).__name__})") from None
    if saved_round != state["round"]:
        raise DamagedRunError(
            path, f"is torn: models of round {saved_round}, {path.parent / 'state.json'} of round {state['round']} "
            "(the run stopped while writing them)"
        )
    missing = [key for key in _array_references(state) if key not in shapes]
    if missing:
        raise DamagedRunError(path, f"lacks {len(missing)} of the arrays state.json refers to (e.g. {missing[0]}): truncated or replaced")
    return shapes


def checkpoint_array_shape(run_dir: Path, state: Mapping[str, Any], name: str) -> tuple[int, ...] | None:
    """The shape of the strategy state's array ``name`` (e.g. ``assignment``, one entry per client)
    in the checkpoint, from its header; None where the state holds no such array."""
    reference = state["strategy"].get(name)
    if not isinstance(reference, dict) or _ARRAY not in reference:
        return None
    return check_checkpoint_arrays(run_dir, state).get(reference[_ARRAY])


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The checkpoint saved by :meth:`RunRecorder.save_checkpoint`: ``{"round", "strategy", "log"}``
    with its arrays back in place. A missing, truncated or mismatched file is a
    :class:`DamagedRunError` naming it."""
    folder = Path(run_dir) / "checkpoint"
    state = read_checkpoint_state(run_dir)
    check_checkpoint_arrays(run_dir, state)
    try:
        with np.load(folder / "models.npz") as saved:
            arrays = {key: saved[key] for key in saved.files}
    except (ValueError, OSError, EOFError) as err:  # a CRC or length error inside an entry
        raise DamagedRunError(folder / "models.npz", f"is corrupted ({' '.join(str(err).split())})") from None
    checkpoint = _arrays_in(state, arrays)
    del checkpoint["format"]
    checkpoint.pop(ROW_DIGEST, None)  # which run the file belongs to (check_resumable), not the run's state
    # Written before the round log became the runner's (#35), a checkpoint keeps the model selection
    # by validation loss in the log's state; it is the strategy's now (algorithms/base/model_selection.py).
    moved = checkpoint["log"].pop("best_validated", None)
    if moved:
        checkpoint["strategy"].setdefault("best_validated", moved)
    return checkpoint


def checkpoint_round(run_dir: Path) -> int | None:
    """The round of ``run_dir``'s checkpoint, or None if it has none that can be read (unchecked:
    for messages; :func:`read_checkpoint_state` checks)."""
    try:
        return int(json.loads((run_dir / "checkpoint" / "state.json").read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_resumable(run_dir: Path) -> dict[str, Any]:
    """Check a run directory before a resume or branch reads it (so that nothing fails once Ray
    has started): its checkpoint's two files, and a ``rounds.jsonl`` holding every round up to the
    checkpoint. Returns ``state.json`` (arrays as references); raises :class:`DamagedRunError`."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        holder = run_dir.parent
        hint = (f"resume the run that holds it: fedcluster resume {holder}" if (holder / "config.yaml").is_file()
                else "give the run's folder (the one holding config.yaml and checkpoint/)")
        raise DamagedRunError(run_dir, f"is a file, not a run directory: {hint}")
    if not run_dir.is_dir():
        raise DamagedRunError(run_dir, "no such run directory")
    if not (run_dir / "config.yaml").is_file():
        raise DamagedRunError(run_dir / "config.yaml", "not found: is this a fedcluster run directory?")
    state = read_checkpoint_state(run_dir)
    check_checkpoint_arrays(run_dir, state)
    rows = read_rounds(run_dir)
    logged = {row["round"] for row in rows}
    missing = [r for r in range(1, state["round"] + 1) if r not in logged]
    if missing:
        raise DamagedRunError(
            run_dir / "rounds.jsonl",
            f"lacks the rows of round{'s' if len(missing) > 1 else ''} {_ranges(missing)}; the checkpoint is at round {state['round']}",
        )
    check_checkpoint_belongs(run_dir, state, rows)
    return state


def check_checkpoint_belongs(run_dir: Path, state: Mapping[str, Any], rows: Sequence[RoundRow]) -> None:
    """The checkpoint must be this run's: its round's row in ``rounds.jsonl`` is the one it was
    saved with. Checked before the config is compared with the checkpoint, so that a checkpoint
    copied in from another run is named as the cause rather than this run's ``config.yaml``.
    Checkpoints written before the digest existed are not checked."""
    digest = state.get(ROW_DIGEST)
    if digest is None:
        return
    done = state["round"]
    row = [r for r in rows if r["round"] == done][-1]
    if row_digest(row) != digest:
        raise DamagedRunError(
            run_dir / "checkpoint",
            f"belongs to another run: its round {done} is not the round {done} that {run_dir / 'rounds.jsonl'} records "
            "(copied in from another run?); put this run's checkpoint/ back, or resume the run it came from",
        )


def check_strategy_names(run_dir: Path, state: Mapping[str, Any], configured: str, note: str = "") -> None:
    """``config.yaml``'s ``strategy.name`` (``configured``), the checkpoint's ``state.json`` and
    ``summary.json`` must name one strategy: a checkpoint is never continued under another
    strategy's name. Where they disagree, the file that differs from the two others is named (an
    edited ``state.json`` is blamed as such, not the ``config.yaml`` that agrees with the run's
    summary); where no two agree (a summary written before it named its strategy), both of the
    others are named. ``note`` follows the checkpoint's strategy (e.g. that it no longer exists)."""
    state_path, config_path = Path(run_dir) / "checkpoint" / "state.json", Path(run_dir) / "config.yaml"
    written_by = state["strategy"].get("strategy")
    try:
        recorded = read_summary(run_dir).get("strategy")
    except DamagedRunError:
        recorded = None
    if written_by is None or written_by == configured and recorded in (None, configured):
        return
    never = "a checkpoint is never continued under another strategy's name"
    if written_by == configured:
        raise DamagedRunError(
            Path(run_dir) / "summary.json", f"records that the run was {recorded}, but its config.yaml and checkpoint/state.json "
            f"name {configured}: both were edited (restore them), or summary.json was ({never})"
        )
    if recorded == written_by:
        raise DamagedRunError(
            config_path, f"strategy.name is {configured}, but the checkpoint was written by {written_by}{note}: "
            f"restore strategy.name: {written_by}, or start a new run (a branch cannot change the strategy either)"
        )
    if recorded == configured:
        raise DamagedRunError(
            state_path, f"names strategy {written_by}{note}, but the run's config.yaml and summary.json name {configured}: "
            f"the checkpoint was edited or comes from another run; put the run's own checkpoint/ back ({never})"
        )
    summary = f"summary.json names {recorded}" if isinstance(recorded, str) else "summary.json does not say which ran"
    raise DamagedRunError(
        config_path, f"strategy.name is {configured}, but {state_path} names {written_by}{note} and {summary}: "
        f"restore the edited file, or start a new run ({never})"
    )


def _ranges(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
