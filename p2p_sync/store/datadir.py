"""The data dir itself: its paths, the lock that keeps it to one node, and the full-disk gate.

One node per data dir: a node opens its store ``exclusive`` (``fcntl.flock`` on ``lock``,
which holds its pid), so a second node started on the same dir fails at once with
:class:`DataDirInUseError` naming the holder, instead of sharing its libp2p identity and
writing into its log. The OS drops the lock when the process dies, however it dies.

A full disk (ENOSPC, or a quota) is :class:`StoreFullError`, logged once a minute at most:
what was being written is not kept and everything written before stays, so the caller tries
again later and resumes once there is room. ``format.json`` says how the recorded state hashes
were made: a dir written under another definition is refused, not misread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from p2p_sync import jsonbounds
from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.errors import DataDirInUseError, StoreError, StoreFormatError, StoreFullError
from p2p_sync.protocol.ratelimit import RepeatedLine

log = logging.getLogger("p2psync.store")

# The state hash definition the recorded hashes follow (p2p_sync.weights.statehash; 1 was XXH3).
STATE_HASH_FORMAT = 2
FULL_NOTED_EVERY_S = 60.0  # a full disk is logged at most this often (every write fails)
LOCK_NAME = "lock"  # in the data dir: the running node's pid, flocked while it runs
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_temp(path: Path) -> bool:
    """Whether ``path`` is an ``atomic`` write's temp file (left by a crash mid-write)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


class DataDir:
    """The paths of one data dir, its lock while held, and its count of refused writes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pack_dir = root / "packs"
        self.manifest_dir = root / "manifests"
        self.weights_dir = root / "weights"
        self.checkpoint_path = root / "checkpoint.json"
        self.format_path = root / "format.json"
        self.log_path = root / "log.jsonl"
        self.refused_writes = 0  # writes a full disk refused (StoreFullError)
        self._full_line = RepeatedLine(FULL_NOTED_EVERY_S)  # their log line, once a minute
        self._lock_fd: int | None = None  # the data dir's lock, while this store holds it

    def make_dirs(self) -> None:
        for d in (self.pack_dir, self.manifest_dir, self.weights_dir):
            d.mkdir(parents=True, exist_ok=True)

    def temp_files(self) -> Iterator[Path]:
        """Temp files left by writes a crash cut short, in the root and every subdir."""
        for d in (self.root, self.pack_dir, self.manifest_dir, self.weights_dir):
            for p in d.iterdir():
                if is_temp(p):
                    yield p

    def take_lock(self) -> None:
        """``flock`` the data dir's lock file and write our pid in it, or raise naming the
        pid of the node holding it."""
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUseError(
                f"data dir {self.root} is in use by another p2psync node (pid {holder}): "
                f"give each node its own --data-dir"
            ) from None
        self._lock_fd = fd
        with contextlib.suppress(OSError):  # a full disk: locked all the same, pid unsaid
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release_lock(self) -> None:
        """Release the data dir's lock (a no-op when not held)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Turn a full disk's OSError while writing ``what`` into StoreFullError, logged once
        a minute at most (every write fails until there is room: one line says it)."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            self.refused_writes += 1
            count = self._full_line.hit(time.monotonic())
            if count:
                log.error(
                    "data dir %s is full (%s): %s not written%s; nothing accepted is lost, and "
                    "the node goes on once there is room",
                    self.root,
                    exc.strerror or exc,
                    what,
                    f" (nor {count - 1} more since the last such line)" if count > 1 else "",
                )
            raise StoreFullError(f"{self.root}: disk full writing {what}") from None

    def check_format(self) -> None:
        """Refuse a data dir whose hashes follow another definition; mark a new one."""
        try:
            found = jsonbounds.loads(self.format_path.read_bytes()).get("state_hash")
        except FileNotFoundError:
            old = ("checkpoint.json", "state.json", "log.jsonl", "manifests")
            found = 1 if any((self.root / n).exists() for n in old) else None
        except (ValueError, AttributeError) as exc:
            raise StoreError(f"{self.format_path}: unreadable ({exc})") from None
        if found is None:
            with self.writing("format.json"):
                atomic_write_bytes(
                    self.format_path, json.dumps({"state_hash": STATE_HASH_FORMAT}).encode()
                )
        elif found != STATE_HASH_FORMAT:
            raise StoreFormatError(
                f"{self.root}: written with state hash format {found}; this p2psync uses "
                f"{STATE_HASH_FORMAT} and cannot verify it. Start with an empty data dir "
                f"(a rollout re-fetches from its peers; a trainer starts a new swarm)"
            )
