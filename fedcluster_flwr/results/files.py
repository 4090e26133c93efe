"""Writing result files: whole or not at all, readable by whoever the umask allows.

Below the recorder, the checkpoints, the tracker and the runner (each writes run files), and importing none of them.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def mkstemp_public(folder: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """A new temporary file in ``folder`` (descriptor, path) with the mode an ordinary file gets:
    0o666 less the umask (0644 under the usual 022), not ``tempfile.mkstemp``'s private 0600 —
    result files are renamed into place and meant to be read by others. The kernel applies the
    umask at creation, so nothing reads or changes it (the batched engine runs threads)."""
    for _ in range(100):
        path = os.path.join(folder, f"{prefix}{secrets.token_hex(8)}{suffix}")
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {prefix}*{suffix} in {folder}")


@contextmanager
def written_aside(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A handle (``mode`` "w" or "wb") on a new file beside ``path`` (in its folder, which must
    exist), renamed to ``path`` once the block ends without an error: ``path`` holds what the
    block wrote or its former content, never a part. For writers that stream (``np.save``)."""
    fd, tmp = mkstemp_public(path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, mode) as handle:
            yield handle
    except BaseException:
        os.unlink(tmp)  # a failed write leaves no hidden temporary file behind
        raise
    os.replace(tmp, path)


def atomic_write(path: Path, data: bytes | str) -> None:
    """``path`` holds ``data`` or its former content, never a part: written aside, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_aside(path, "wb" if isinstance(data, bytes) else "w") as handle:
        handle.write(data)


PROBE_BYTES = 4096  # a block: a full disk refuses it, a nearly full one may not (then the run says what it wrote)


def unwritable(folder: Path) -> str | None:
    """Why results cannot be written in ``folder`` (new or not), or None: a probe file written,
    synced and removed in the nearest folder of its path that exists. Run before anything starts,
    so that a read-only or full disk, or a file on the way, is one line instead of a failed run."""
    base = Path(folder)
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        return f"{base} is a file, not a folder"
    try:
        fd, probe = mkstemp_public(base, ".fedcluster-probe-")
    except OSError as err:
        return f"cannot create a file in {base} ({err.strerror or err})"
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    except OSError as err:
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        return f"{base} is full ({err.strerror})" if full else f"cannot write in {base} ({err.strerror or err})"
    finally:
        os.close(fd)
        os.unlink(probe)
    return None
