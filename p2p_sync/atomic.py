"""Atomic file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader (or a process restarted after a crash at any instant) sees the old file or the new
one, never a mix: rename within one filesystem is atomic, and the fsyncs make the new bytes
durable before the name points at them.

The writer gets the temp file ``mkstemp`` opened, never a second ``open`` of its name: a reopen
with ``O_TRUNC`` makes ext4 treat the file as replaced by truncation (``auto_da_alloc``) and
write all of it back on close, which stalls the next fsync of any process on that disk.
"""

from __future__ import annotations

import os
import secrets
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


def _temp_beside(target: Path, mode: int | None) -> tuple[int, Path]:
    """An open, new temp file beside ``target``: private (0600, ``mkstemp``'s) when ``mode`` is
    None, else created with ``mode`` so that the process umask applies, as for any file a
    program writes for others to read."""
    if mode is None:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        return fd, Path(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name beside {target}")


def atomic_write_with(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], None],
    durable: bool = True,
    mode: int | None = None,
) -> None:
    """Call ``write(f)`` on the open temp file to produce it, then move it to ``path``
    atomically.

    ``durable=False`` skips the fsyncs: still all-or-nothing if the process dies, but after a
    power loss the file may be empty. Only for files that are verified on every read anyway.
    ``mode``: None keeps the file private (0600); else the umask applies to it (0o666: files an
    engine running as another user reads).
    """
    target = Path(path)
    fd, tmp = _temp_beside(target, mode)
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
