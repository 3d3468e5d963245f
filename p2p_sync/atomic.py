"""Atomic file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader (or a process restarted after a crash at any instant) sees the old file or the new
one, never a mix: rename within one filesystem is atomic, and the fsyncs make the new bytes
durable before the name points at them.

The writer gets the temp file ``mkstemp`` opened, never a second ``open`` of its name: that
second open (``"wb"``: ``O_TRUNC`` on the empty file) made ext4 flag the file as replaced by
truncation (``auto_da_alloc``) and start writing all of it back on close. The journal commit
of the next fsync, by any process on the disk, then waited for that writeback: a 50-byte fsync
took 0.37 s after 480 MB of such files on this machine (0.001 s without the reopen), and
``make demo``'s first patch paid it in the trainer's store step.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_with(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], None], durable: bool = True
) -> None:
    """Call ``write(f)`` on the open temp file to produce it, then move it to ``path``
    atomically.

    ``durable=False`` skips the fsyncs: still all-or-nothing if the process dies, but after a
    power loss the file may be empty. Only for files that are verified on every read anyway.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``path`` atomically."""
    atomic_write_with(path, lambda f: f.write(data), durable)
