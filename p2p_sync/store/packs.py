"""Chunk packs: one file per manifest holding its payload, each chunk at its slot's offset.

Why one pack file per manifest and not one file per chunk: on ext4, creating a file costs far
more than writing its 256 KiB (inode allocation, directory entry, rename). A pack is one file
written with ``pwrite`` at each chunk's offset (``chunk_index * chunk_size``), sparse while
downloading; a completed pack is the payload itself.

Chunks are not fsynced: a pack slot is trusted only after its bytes hash to the name the
signed manifest gives it, on open and on every read from disk, so a slot torn by a crash (or
never written: packs are sparse) is simply absent, and replay re-fetches it. A short
``pwrite`` (a disk filling up) is finished, never left as a torn slot. The caller holds the
store's lock around every method here except those that say they take it themselves.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

from p2p_sync.errors import StoreError, StoreFullError
from p2p_sync.memory import release_pages
from p2p_sync.store.cache import ChunkCache
from p2p_sync.store.datadir import DataDir
from p2p_sync.store.havemap import HaveMark, HaveNews
from p2p_sync.store.manifests import ManifestIndex
from p2p_sync.trust.chunks import chunk_hash
from p2p_sync.trust.manifest import Manifest

_HEX64 = re.compile(r"[0-9a-f]{64}")


def slot(m: Manifest, index: int) -> slice:
    """The byte range of chunk ``index`` in ``m``'s payload (and pack)."""
    start = index * m.chunk_size
    return slice(start, start + m.chunk_length(index))


class Packs:
    """The pack files, which of their slots hold verified chunks, and the have-map news."""

    def __init__(
        self,
        data: DataDir,
        index: ManifestIndex,
        cache: ChunkCache,
        lock: threading.RLock,
        note_drop: Callable[[str], None],
    ) -> None:
        self.data, self.dir = data, data.pack_dir
        self.index, self.cache, self.lock = index, cache, lock
        self._note_drop = note_drop
        self.valid: dict[str, set[int]] = {}  # manifest digest -> slots verified in its pack
        self.news = HaveNews()

    def path(self, manifest_digest: str) -> Path:
        if not _HEX64.fullmatch(manifest_digest):
            raise ValueError(f"not a manifest digest: {manifest_digest[:80]!r}")
        return self.dir / manifest_digest

    def indexed(self, manifest: Manifest) -> None:
        """Index ``manifest``'s slots: its have-map starts with whatever other packs hold."""
        self.news.changed()
        self.index.index(manifest)

    # ------------------------------------------------------------ writing

    def _write_slot(self, m: Manifest, offset: int, data: bytes | memoryview) -> None:
        with self.data.writing(f"a chunk of {m.digest[:16]}"):
            self._pwrite(self.path(m.digest), offset, data)

    @staticmethod
    def _pwrite(path: Path, offset: int, data: bytes | memoryview) -> None:
        """``data`` into ``path`` at ``offset``, all of it: a write cut short (a disk filling
        up) goes on from where it stopped, so it ends whole or with the OSError."""
        view = memoryview(data).cast("B")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while view:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
        finally:
            os.close(fd)

    def put_payload(self, manifest: Manifest, payload: bytes) -> None:
        """A whole payload as its pack, in one write (takes the lock itself)."""
        if len(payload) != manifest.payload_size:
            raise ValueError(
                f"payload is {len(payload)} bytes, manifest says {manifest.payload_size}"
            )
        try:
            self._write_slot(manifest, 0, payload)  # a pack nobody names yet: no lock needed
        except StoreFullError:
            if manifest.digest not in self.valid:  # what it holds of it goes: room back
                self.path(manifest.digest).unlink(missing_ok=True)
            raise
        with self.lock:
            self.valid[manifest.digest] = set(range(len(manifest.chunks)))
            self.indexed(manifest)
            self.news.changed()
            self.cache.keep_own(manifest, bytes(payload))  # no copy of ``bytes``; served next

    def put_pack_file(self, manifest: Manifest, path: Path) -> None:
        """Adopt a payload file as its pack, by rename (takes the lock itself)."""
        if os.stat(path).st_size != manifest.payload_size:
            raise ValueError(f"{path} is not {manifest.payload_size} bytes")
        with self.lock, self.data.writing(f"the pack of {manifest.digest[:16]}"):
            try:
                os.replace(path, self.path(manifest.digest))
            except OSError:
                path.unlink(missing_ok=True)  # adopted or not, it is the store's now
                raise
        with self.lock:
            self.valid[manifest.digest] = set(range(len(manifest.chunks)))
            self.indexed(manifest)
            self.news.changed()

    def put_chunk(self, data: bytes | memoryview, digest: str | None = None) -> str:
        """A verified chunk into the newest naming manifest's pack, at every slot naming it
        there; returns its hash."""
        digest = digest or chunk_hash(data)
        where = self.index.locate(digest)
        if not where:
            raise StoreError(f"no known manifest names chunk {digest}")
        if not self.holds(digest):
            data = bytes(data)
            mdigest = max(where, key=lambda w: self.index.of(w[0]).version)[0]
            m = self.index.of(mdigest)
            for index in (i for d, i in where if d == mdigest):
                self._write_slot(m, slot(m, index).start, data)
                self.valid.setdefault(mdigest, set()).add(index)
            for d, i in where:  # held now in every manifest that names it
                self.news.arrive(d, i)
            self.cache.remember(digest, data)
        return digest

    # ------------------------------------------------------------ what is held

    def holds(self, digest: str) -> bool:
        """Whether some pack holds chunk ``digest``."""
        return any(i in self.valid.get(d, ()) for d, i in self.index.where.get(digest, ()))

    def have_indices(self, manifest: Manifest) -> list[int]:
        """Indices of ``manifest``'s chunks held here (in its own pack or another's)."""
        valid = self.valid.get(manifest.digest, set())
        if len(valid) == len(manifest.chunks):
            return list(range(len(manifest.chunks)))
        holds = self.holds
        return [i for i, c in enumerate(manifest.chunks) if i in valid or holds(c)]

    def held_since(self, manifest: Manifest, mark: HaveMark | None) -> tuple[HaveMark, list[int]]:
        return self.news.since(manifest.digest, mark, lambda: self.have_indices(manifest))

    def chunk_bytes(self) -> int:
        """Bytes of verified chunks held on disk."""
        total = 0
        for mdigest, valid in self.valid.items():
            m = self.index.get(mdigest)
            total += sum(m.chunk_length(i) for i in valid) if m else 0
        return total

    # ------------------------------------------------------------ reading

    def get_chunk(self, digest: str) -> bytes | None:
        """The chunk's bytes, verified: from memory, else from disk (then cached)."""
        hot = self.cache.get(digest)
        if hot is not None:
            return hot
        own = self._own_chunk(digest)
        if own is not None:
            return own
        data = self._peek(digest)
        if data is not None:
            self.cache.remember(digest, data)
        return data

    def _own_chunk(self, digest: str) -> bytes | None:
        for mdigest, index in self.index.where.get(digest, ()):
            own = self.cache.own(mdigest)
            if own is not None and index in self.valid.get(mdigest, ()):
                return own[1][slot(own[0], index)]
        return None

    def _peek(self, digest: str) -> bytes | None:
        """Read a chunk from any valid pack slot, verified, without touching the cache."""
        for mdigest, index in self.index.locate(digest):
            if index in self.valid.get(mdigest, ()):
                data = self._read_slot(mdigest, index, digest)
                if data is not None:
                    return data
        return None

    def _read_slot(self, mdigest: str, index: int, digest: str) -> bytes | None:
        span = slot(self.index.of(mdigest), index)
        try:
            with open(self.path(mdigest), "rb") as f:
                f.seek(span.start)
                data = f.read(span.stop - span.start)
        except FileNotFoundError:
            data = b""
        if chunk_hash(data) != digest:
            self.invalidate(mdigest, index, "corrupted on disk")
            return None
        return data

    def payload(self, manifest: Manifest) -> memoryview | None:
        """The payload if every chunk is present and verifies, else None (takes the lock
        itself; hashes a mapped pack outside it)."""
        with self.lock:
            complete = len(self.valid.get(manifest.digest, ())) == len(manifest.chunks)
            own = self.cache.own(manifest.digest) if complete else None
            if own is not None:
                return memoryview(own[1])
            view = self._map_pack(manifest) if complete else None
        if view is not None and self._all_slots_match(manifest, view):  # hashing: no lock
            return view
        with self.lock:
            hot = [self.cache.peek(c) for c in manifest.chunks]
            parts = [h or self._peek(c) for h, c in zip(hot, manifest.chunks, strict=True)]
        if any(p is None for p in parts):
            return None
        return memoryview(b"".join(p for p in parts if p is not None))

    def _map_pack(self, m: Manifest) -> memoryview | None:
        try:
            with open(self.path(m.digest), "rb") as f:
                if os.fstat(f.fileno()).st_size < m.payload_size:
                    return None
                mapped = mmap.mmap(f.fileno(), m.payload_size, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            return None
        return memoryview(mapped)  # packs are never truncated in place: the map stays valid

    def _all_slots_match(self, m: Manifest, view: memoryview) -> bool:
        """Whether every slot of the mapped pack ``view`` hashes right; each slot's pages are
        let go once hashed (``memory.release_pages``: a whole patch mapped at once stood in the
        RSS beside the model through its apply)."""
        ok = True
        for i, c in enumerate(m.chunks):
            span = slot(m, i)
            if chunk_hash(view[span]) != c:
                self.invalidate(m.digest, i, "corrupted on disk")
                ok = False
            release_pages(view, span.start, span.stop)
        return ok

    # ------------------------------------------------------------ verifying and forgetting

    def verify(self, m: Manifest) -> bool:
        """Re-hash every slot of ``m``'s pack from disk; True if all match (takes the lock
        itself, one slot at a time)."""
        try:
            self.verify_slots(m)
        except FileNotFoundError:
            with self.lock:
                self.valid.pop(m.digest, None)
                self.news.changed()
        with self.lock:
            return len(self.valid.get(m.digest, ())) == len(m.chunks)

    def verify_slots(self, m: Manifest) -> None:
        """Re-hash every slot of ``m``'s pack: the slots that match are the chunks we hold.
        The lock is taken per slot, so chunks keep flowing while a large pack is checked."""
        with open(self.path(m.digest), "rb") as f:
            for i, want in enumerate(m.chunks):
                with self.lock:
                    f.seek(i * m.chunk_size)
                    data = f.read(m.chunk_length(i))
                    if chunk_hash(data) == want:
                        self.valid.setdefault(m.digest, set()).add(i)
                        self.news.changed()
                    elif data.strip(b"\0"):  # not a hole never written: rotted or torn bytes
                        self.invalidate(m.digest, i, "does not match its hash")

    def invalidate(self, mdigest: str, index: int, why: str) -> None:
        """Slot ``index`` of a pack no longer counts as held (takes the lock itself)."""
        with self.lock:
            self.valid.get(mdigest, set()).discard(index)
            self._note_drop(f"packs/{mdigest} chunk {index}: {why}")

    def forget(self, mdigest: str) -> None:
        """Forget what pack ``mdigest`` held (its file is gone), and the cached chunks that
        no other pack holds."""
        entry = self.index.entries.get(mdigest)
        self.valid.pop(mdigest, None)
        self.cache.drop_own(mdigest)
        if entry is not None:
            for c in entry[0].chunks:
                if not self.holds(c):
                    self.cache.forget(c)
