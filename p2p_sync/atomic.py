"""Atomic file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader (or a process restarted after a crash at any instant) sees the old file or the new
one, never a mix: rename within one filesystem is atomic, and the fsyncs make the new bytes
durable before the name points at them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_with(
    path: str | os.PathLike[str], write: Callable[[Path], None], durable: bool = True
) -> None:
    """Call ``write(tmp_path)`` to produce the file, then move it to ``path`` atomically.

    ``durable=False`` skips the fsyncs: still all-or-nothing if the process dies, but after a
    power loss the file may be empty. Only for files that are verified on every read anyway.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically."""
    atomic_write_with(path, lambda tmp: tmp.write_bytes(data), durable)
