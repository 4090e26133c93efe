"""Writing result files: whole or not at all, readable by whoever the umask allows.

Below the results, the tracker and the runner (each writes run files), and importing none of them.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


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


def atomic_write(path: Path, data: bytes | str) -> None:
    """``path`` holds ``data`` or its former content, never a part: written aside, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = mkstemp_public(path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, mode) as handle:
        handle.write(data)
    os.replace(tmp, path)
