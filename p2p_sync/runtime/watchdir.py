"""The trainer's ``--watch`` directory: a spool of ``*.safetensors`` files, each published once.

A training job that is not a Python program of ours writes its checkpoints elsewhere and
renames them in; the trainer publishes each as the next version. Files it cannot publish are
moved aside (``rejected/``), and the names published are kept in the data dir, so a restart
publishes nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.errors import LayoutMismatchError, StoreFullError, WeightsFileError
from p2p_sync.runtime.trainer import Publisher
from p2p_sync.store import Store

log = logging.getLogger("p2psync.trainer")


REJECTED = "rejected"  # where --watch moves the files it cannot publish, inside the watch dir


@dataclass(frozen=True)
class Listed:
    """A ``*.safetensors`` name in the watch dir, as listed: size and mtime -1 where it could
    not be stat'ed (gone, or a dangling link: opening it says which)."""

    path: Path
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> Listed:
        try:
            st = path.lstat()
        except OSError:
            return cls(path, -1, -1)
        return cls(path, st.st_size, st.st_mtime_ns)


def to_try(listed: list[Listed], published: set[str], refused: set[Listed]) -> list[Path]:
    """The files to publish now, oldest first (by mtime, then name): neither published (by
    name) nor refused and left in place unchanged (by name, size and mtime)."""
    fresh = [e for e in listed if e.path.name not in published and e not in refused]
    return [e.path for e in sorted(fresh, key=lambda e: (e.mtime_ns, e.path.name))]


def aside(directory: Path, name: str, taken: Callable[[Path], bool], tries: int = 1000) -> Path:
    """Where a refused file goes: ``directory/rejected/name``, or ``name.1``, ``name.2``...
    when an earlier one holds the name (the last try is overwritten)."""
    folder = directory / REJECTED
    for n in range(tries):
        dest = folder / (name if n == 0 else f"{name}.{n}")
        if not taken(dest):
            return dest
    return dest


class Spool:
    """The ``--watch`` dir as a spool: files renamed in are published once, in order; one
    that cannot be (``refuse``) is moved aside to ``rejected/``. Names published are kept in
    the data dir (``watched.txt``), so a restart does not publish them again."""

    def __init__(self, directory: Path, store: Store) -> None:
        self.directory, self.store = directory, store
        seen_path = self.seen_path = store.root / "watched.txt"
        self.published = set(seen_path.read_text().split("\n")) if seen_path.exists() else set()
        self.refused: set[Listed] = set()  # refused but could not be moved: not retried as is

    def fresh(self) -> list[Path]:
        listed = [Listed.of(p) for p in self.directory.glob("*.safetensors")]
        return to_try(listed, self.published, self.refused)

    def done(self, path: Path) -> None:
        """``path`` is published: remembered at once, written down as soon as the disk lets
        (a full one is the store's one log line; the list is written again with the next)."""
        self.published.add(path.name)
        with contextlib.suppress(StoreFullError), self.store.writing("the watch list"):
            atomic_write_bytes(self.seen_path, "\n".join(sorted(self.published)).encode())

    def refuse(self, path: Path, problem: Exception) -> str:
        """Move ``path`` aside; the log line: the file, the problem, and where it went."""
        what = str(problem) if path.name in str(problem) else f"{path}: {problem}"
        listed = Listed.of(path)
        try:
            (self.directory / REJECTED).mkdir(exist_ok=True)
            dest = aside(self.directory, path.name, os.path.lexists)
            os.rename(path, dest)
        except FileNotFoundError:
            return f"{what}; not published (the file is gone)"
        except OSError as exc:
            self.refused.add(listed)
            return f"{what}; not published, left in place (cannot move it aside: {exc.strerror})"
        return f"{what}; not published, moved to {dest}"


async def watch(
    publisher: Publisher, directory: Path, stop: asyncio.Event, interval: float = 0.2
) -> None:
    """Publish every ``*.safetensors`` that appears in ``directory``, in order of appearance.

    Files must appear by rename (written elsewhere, then moved in), so a file is never read half
    written. Names already published are remembered in the data dir across restarts.

    A file that cannot be published (cut short or not safetensors, another layout or dtype than
    v0, unreadable, a directory or a pipe) costs one log line naming it and the problem, and is
    moved to ``directory/rejected/``; the trainer keeps serving and publishes the next file.
    Moved rather than left in place: the watch dir is a spool, an operator finds every refused
    file in one place, and none is read again at each restart. One that cannot be moved stays,
    remembered by name, size and mtime until the process ends. Other failures (the store's
    disk) are the node's, not the file's: a full one (``StoreFullError``) pauses the watch
    until there is room, then the same file is published; the others stop the trainer.
    """
    spool = Spool(directory, publisher.node.store)
    while not stop.is_set():
        await _publish_fresh(publisher, spool, stop)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


async def _publish_fresh(publisher: Publisher, spool: Spool, stop: asyncio.Event) -> None:
    """Publish the files in the spool now, in order, until one waits for room on the disk."""
    for path in spool.fresh():
        try:
            await publisher.publish_file(path)
        except StoreFullError:  # logged by the store: this file again once there is room
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), publisher.node.cfg.store.full_retry_s)
            return
        except (WeightsFileError, LayoutMismatchError) as exc:
            log.warning("watch: %s", spool.refuse(path, exc))
            continue
        spool.done(path)
