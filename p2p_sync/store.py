"""Durable local store: verified manifests, their payloads' chunks, the current weights.

Layout under the data dir::

    manifests/<digest>.json          signed manifests as received (digest = Manifest.digest)
    packs/<manifest digest>          that manifest's payload, each chunk at its offset
                                     (chunk_index * chunk_size); sparse while downloading
    weights/<file-sha256>.safetensors  the accepted weights
    state.json                       {"version", "state_hash", "weights", "weights_sha256"}

Why one pack file per manifest and not one file per chunk: on ext4, creating a file costs
far more than writing its 256 KiB (inode allocation, directory entry, rename): with eight
rollouts on one disk, per-chunk files took over half of all CPU time in the loopback swarm
benchmark. A pack is one file written with ``pwrite`` at each chunk's offset; a completed
pack is the payload itself.

Crash safety: manifests, weights and state are written through ``atomic`` (temp file, fsync,
rename, fsync dir), so a crash at any instant leaves each old or new, never half-written. The
accepted state switches in one atomic step: the new weights file is written first under its
own name, then ``state.json`` is replaced to point at it, then the old weights file is
removed. Chunks are not fsynced: a pack slot is trusted only after its bytes hash to the name
the signed manifest gives it, on open and on every read from disk, so a slot torn by a crash
(or never written: packs are sparse) is simply absent. On open the store checks itself: it
removes temp files, manifests that do not parse or match their name, packs no manifest names,
and weights files that state.json does not name; it re-hashes every pack slot and verifies the
weights file against state.json. Recently stored or served chunks are kept, verified, in a
bounded in-memory LRU (``memory_cache_bytes``), so relaying costs no disk read.

The store trusts its caller to have verified manifests (``manifest.verify``) and chunks
(``chunks.verify_chunk``) before putting them; it re-parses manifests on open but does not
re-check signatures.
"""

from __future__ import annotations

import collections
import hashlib
import json
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2p_sync.atomic import atomic_write_bytes, atomic_write_with, fsync_dir
from p2p_sync.chunks import chunk_hash
from p2p_sync.errors import ManifestError, P2PSyncError
from p2p_sync.manifest import SNAPSHOT, Manifest, ManifestLimits, parse

_HEX64 = re.compile(r"[0-9a-f]{64}")


class StoreError(P2PSyncError):
    """The data dir cannot be used (unreadable, or its state is inconsistent)."""


@dataclass(frozen=True)
class StoreLimits:
    """Bounds of the local cache."""

    max_chunk_bytes: int = 4 * 2**30
    memory_cache_bytes: int = 32 * 2**20  # recently stored or served chunks, kept verified
    verify_weights_on_open: bool = True


@dataclass(frozen=True)
class AcceptedState:
    version: int
    state_hash: str
    weights: Path
    weights_sha256: str


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


class Store:
    """One node's durable state. Create with :meth:`open`."""

    def __init__(self, root: Path, limits: StoreLimits) -> None:
        self.root, self.limits = root, limits
        self.pack_dir = root / "packs"
        self.manifest_dir = root / "manifests"
        self.weights_dir = root / "weights"
        self.state_path = root / "state.json"
        self._manifests: dict[str, tuple[Manifest, bytes]] = {}
        self._where: dict[str, list[tuple[str, int]]] = {}  # chunk hash -> (manifest, index)
        self._valid: dict[str, set[int]] = {}  # manifest digest -> slots verified in its pack
        self._hot: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # LRU
        self._hot_bytes = 0
        self.state: AcceptedState | None = None
        self.dropped: list[str] = []  # what the last self-check removed, for logs and tests

    @classmethod
    def open(cls, root: str | os.PathLike[str], limits: StoreLimits = StoreLimits()) -> Store:
        store = cls(Path(root), limits)
        for d in (store.root, store.pack_dir, store.manifest_dir, store.weights_dir):
            d.mkdir(parents=True, exist_ok=True)
        store._check()
        return store

    # ------------------------------------------------------------ self-check

    def _drop(self, path: Path, why: str) -> None:
        path.unlink(missing_ok=True)
        if path.parent == self.pack_dir:
            self._forget_pack(path.name)
        self.dropped.append(f"{path.relative_to(self.root)}: {why}")

    def _check(self) -> None:
        for d in (self.root, self.pack_dir, self.manifest_dir, self.weights_dir):
            for p in d.iterdir():
                if _is_temp(p):
                    self._drop(p, "partial write")
        for p in self.manifest_dir.iterdir():
            self._load_manifest(p)
        for p in self.pack_dir.iterdir():
            entry = self._manifests.get(p.name)
            if entry is None:
                self._drop(p, "no manifest names this pack")
            else:
                self._verify_pack(entry[0])
        self.state = self._load_state()
        for p in self.weights_dir.iterdir():
            if self.state is None or p != self.state.weights:
                self._drop(p, "not the accepted weights")

    def _verify_pack(self, m: Manifest) -> None:
        """Re-hash every slot of ``m``'s pack: the slots that match are the chunks we hold."""
        valid = self._valid.setdefault(m.digest, set())
        with open(self.pack_path(m.digest), "rb") as f:
            for i, want in enumerate(m.chunks):
                data = f.read(m.chunk_length(i))
                if chunk_hash(data) == want:
                    valid.add(i)
                elif data.strip(b"\0"):  # not a hole never written: bytes that rotted or tore
                    self._invalidate(m.digest, i, "does not match its hash")

    def _invalidate(self, mdigest: str, index: int, why: str) -> None:
        """Slot ``index`` of a pack no longer counts as held (its bytes failed their hash)."""
        self._valid.get(mdigest, set()).discard(index)
        self.dropped.append(f"packs/{mdigest} chunk {index}: {why}")

    @staticmethod
    def _slot(m: Manifest, index: int) -> slice:
        start = index * m.chunk_size
        return slice(start, start + m.chunk_length(index))

    def _load_manifest(self, path: Path) -> None:
        data = path.read_bytes()
        try:
            manifest, _ = parse(data, ManifestLimits(max_manifest_bytes=len(data) + 1))
        except ManifestError as exc:
            self._drop(path, f"unreadable manifest ({exc})")
            return
        if path.name != f"{manifest.digest}.json":
            self._drop(path, "name does not match its digest")
            return
        self._register(manifest, data)

    def _load_state(self) -> AcceptedState | None:
        if not self.state_path.exists():
            return None
        try:
            doc = json.loads(self.state_path.read_bytes())
            state = AcceptedState(
                int(doc["version"]), str(doc["state_hash"]),
                self.weights_dir / str(doc["weights"]), str(doc["weights_sha256"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{self.state_path}: unreadable accepted state ({exc})") from None
        if not state.weights.exists():
            raise StoreError(f"{self.state_path}: names missing weights {state.weights.name}")
        if (
            self.limits.verify_weights_on_open
            and _file_sha256(state.weights) != state.weights_sha256
        ):
            raise StoreError(f"{state.weights}: weights file is corrupt (hash mismatch)")
        return state

    # ------------------------------------------------------------ chunks

    def pack_path(self, manifest_digest: str) -> Path:
        if not _HEX64.fullmatch(manifest_digest):
            raise ValueError(f"not a manifest digest: {manifest_digest[:80]!r}")
        return self.pack_dir / manifest_digest

    def _locate(self, digest: str) -> list[tuple[str, int]]:
        return self._where.get(digest, [])

    def _write_slot(self, m: Manifest, offset: int, data: bytes | memoryview) -> None:
        fd = os.open(self.pack_path(m.digest), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def put_payload(self, manifest: Manifest, payload: bytes) -> None:
        """Store a whole payload (the trainer's own, hashed moments ago for ``manifest``) as
        its pack, in one write. Call before :meth:`put_manifest`: a manifest on disk then
        always has its pack, and a pack left by a crash before it is dropped on open."""
        if len(payload) != manifest.payload_size:
            raise ValueError(f"payload is {len(payload)} bytes, manifest says "
                             f"{manifest.payload_size}")  # fmt: skip
        self._write_slot(manifest, 0, payload)
        self._valid[manifest.digest] = set(range(len(manifest.chunks)))
        self._index(manifest)
        view = memoryview(payload)
        for i, c in enumerate(manifest.chunks):  # the seed serves these next: keep them hot
            self._remember(c, bytes(view[self._slot(manifest, i)]))

    def put_chunk(self, data: bytes | memoryview, digest: str | None = None) -> str:
        """Store a verified chunk of a known manifest (idempotent); returns its hash. Pass
        ``digest`` only when the caller has just computed it from these very bytes. A chunk
        that several manifests name is written once, into the newest one's pack."""
        digest = digest or chunk_hash(data)
        where = self._locate(digest)
        if not where:
            raise StoreError(f"no known manifest names chunk {digest}")
        if not self.has_chunk(digest):
            data = bytes(data)
            mdigest, index = max(where, key=lambda w: self._manifests[w[0]][0].version)
            m = self._manifests[mdigest][0]
            self._write_slot(m, self._slot(m, index).start, data)
            self._valid.setdefault(mdigest, set()).add(index)
            self._remember(digest, data)
        return digest

    def _remember(self, digest: str, data: bytes) -> None:
        """Keep a verified chunk in memory: relaying it then costs no disk read and no re-hash
        (a relay serves what it just received), and memory cannot rot like a disk can."""
        if digest in self._hot or len(data) > self.limits.memory_cache_bytes:
            return
        self._hot[digest] = data
        self._hot_bytes += len(data)
        while self._hot_bytes > self.limits.memory_cache_bytes:
            _, old = self._hot.popitem(last=False)
            self._hot_bytes -= len(old)

    def _forget_hot(self, digest: str) -> None:
        hot = self._hot.pop(digest, None)
        self._hot_bytes -= len(hot) if hot is not None else 0

    def has_chunk(self, digest: str) -> bool:
        return any(i in self._valid.get(d, ()) for d, i in self._locate(digest))

    def have_indices(self, manifest: Manifest) -> list[int]:
        """Indices of ``manifest``'s chunks held here (in its own pack or another's)."""
        valid = self._valid.get(manifest.digest, set())
        if len(valid) == len(manifest.chunks):
            return list(range(len(manifest.chunks)))
        return [i for i, c in enumerate(manifest.chunks) if i in valid or self.has_chunk(c)]

    def get_chunk(self, digest: str) -> bytes | None:
        """The chunk's bytes, verified; a slot corrupted on disk is dropped, never served."""
        hot = self._hot.get(digest)
        if hot is not None:
            self._hot.move_to_end(digest)
            return hot
        data = self._peek(digest)
        if data is not None:
            self._remember(digest, data)
        return data

    def _read_slot(self, mdigest: str, index: int, digest: str) -> bytes | None:
        m = self._manifests[mdigest][0]
        slot = self._slot(m, index)
        try:
            with open(self.pack_path(mdigest), "rb") as f:
                f.seek(slot.start)
                data = f.read(slot.stop - slot.start)
        except FileNotFoundError:
            data = b""
        if chunk_hash(data) != digest:
            self._invalidate(mdigest, index, "corrupted on disk")
            return None
        return data

    def chunk_bytes(self) -> int:
        """Bytes of verified chunks held on disk."""
        total = 0
        for mdigest, valid in self._valid.items():
            m = self._manifests[mdigest][0] if mdigest in self._manifests else None
            total += sum(m.chunk_length(i) for i in valid) if m else 0
        return total

    # ------------------------------------------------------------ manifests

    def put_manifest(self, manifest: Manifest, data: bytes) -> None:
        """Keep a verified manifest (its exact signed bytes, so it can be served onward)."""
        atomic_write_bytes(self.manifest_dir / f"{manifest.digest}.json", data)
        self._register(manifest, data)

    def _register(self, manifest: Manifest, data: bytes) -> None:
        self._manifests[manifest.digest] = (manifest, data)
        self._index(manifest)

    def _index(self, manifest: Manifest) -> None:
        for i, c in enumerate(manifest.chunks):
            where = self._where.setdefault(c, [])
            if (manifest.digest, i) not in where:
                where.append((manifest.digest, i))

    def manifests(self) -> list[Manifest]:
        return sorted((m for m, _ in self._manifests.values()), key=lambda m: (m.version, m.kind))

    def has_manifest(self, digest: str) -> bool:
        return digest in self._manifests

    def manifest_count(self) -> int:
        return len(self._manifests)

    def manifest(self, digest: str) -> Manifest | None:
        entry = self._manifests.get(digest)
        return entry[0] if entry else None

    def manifest_bytes(self, digest: str) -> bytes | None:
        entry = self._manifests.get(digest)
        return entry[1] if entry else None

    def has_payload(self, manifest: Manifest) -> bool:
        return all(self.has_chunk(c) for c in manifest.chunks)

    def payload(self, manifest: Manifest) -> memoryview | None:
        """The payload if every chunk is present and verifies, else None. A complete pack is
        mapped read-only and re-hashed slot by slot: no copy of the payload is made (a fresh
        copy of a 100 MB payload costs more CPU, in page faults, than hashing it). Safe to
        call from a worker thread (it reads the in-memory cache but does not reorder it)."""
        if len(self._valid.get(manifest.digest, ())) == len(manifest.chunks):
            view = self._map_pack(manifest)
            if view is not None and self._all_slots_match(manifest, view):
                return view
        hot = [self._hot.get(c) for c in manifest.chunks]
        parts = [h or self._peek(c) for h, c in zip(hot, manifest.chunks, strict=True)]
        if any(p is None for p in parts):
            return None
        return memoryview(b"".join(p for p in parts if p is not None))

    def _map_pack(self, m: Manifest) -> memoryview | None:
        try:
            with open(self.pack_path(m.digest), "rb") as f:
                if os.fstat(f.fileno()).st_size < m.payload_size:
                    return None
                mapped = mmap.mmap(f.fileno(), m.payload_size, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            return None
        return memoryview(mapped)  # packs are never truncated in place: the map stays valid

    def _all_slots_match(self, m: Manifest, view: memoryview) -> bool:
        ok = True
        for i, c in enumerate(m.chunks):
            if chunk_hash(view[self._slot(m, i)]) != c:
                self._invalidate(m.digest, i, "corrupted on disk")
                ok = False
        return ok

    def _peek(self, digest: str) -> bytes | None:
        """Read a chunk from any valid pack slot, verified, without touching the cache."""
        for mdigest, index in self._locate(digest):
            if index in self._valid.get(mdigest, ()):
                data = self._read_slot(mdigest, index, digest)
                if data is not None:
                    return data
        return None

    # ------------------------------------------------------------ accepted weights

    def set_weights(self, version: int, state_hash: str, write: Callable[[Path], None]) -> None:
        """Make (version, weights) the accepted state, atomically; ``write(path)`` writes the
        safetensors file. Refuses to go back to an older version."""
        if self.state is not None and version < self.state.version:
            raise StoreError(f"refusing to replace v{self.state.version} with older v{version}")
        tmp_name = self.weights_dir / f"incoming-{version}.safetensors"
        atomic_write_with(tmp_name, write)
        digest = _file_sha256(tmp_name)
        final = self.weights_dir / f"{digest}.safetensors"
        os.replace(tmp_name, final)
        fsync_dir(self.weights_dir)
        doc = {"version": version, "state_hash": state_hash, "weights": final.name,
               "weights_sha256": digest}  # fmt: skip
        atomic_write_bytes(self.state_path, json.dumps(doc).encode())
        old, self.state = self.state, AcceptedState(version, state_hash, final, digest)
        if old is not None and old.weights != final:
            old.weights.unlink(missing_ok=True)

    # ------------------------------------------------------------ eviction

    def protected(self) -> set[str]:
        """Digests of manifests catch-up still needs: the newest anchor and every later one.
        The newest anchor known, held or not: a rollout that follows patches never fetches
        anchors, and a newcomer starts from the newest anchor anyway (the trainer holds it)."""
        snaps = [m for m in self.manifests() if m.kind == SNAPSHOT]
        floor = max((m.version for m in snaps), default=0)
        return {m.digest for m in self.manifests() if m.version >= floor}

    def evict(self) -> list[str]:
        """Drop whole packs of unprotected artifacts, oldest version first, until the chunks
        held are under ``max_chunk_bytes``. Returns the digests of the manifests dropped."""
        budget, used = self.limits.max_chunk_bytes, self.chunk_bytes()
        if used <= budget:
            return []
        protected = self.protected()
        dropped = []
        for m in self.manifests():
            if used <= budget:
                break
            valid = self._valid.get(m.digest)
            if m.digest not in protected and valid:
                used -= sum(m.chunk_length(i) for i in valid)
                self._drop(self.pack_path(m.digest), "evicted (cache budget)")
                dropped.append(m.digest)
        return dropped

    def _forget_pack(self, mdigest: str) -> None:
        entry = self._manifests.get(mdigest)
        self._valid.pop(mdigest, None)
        if entry is not None:
            for c in entry[0].chunks:
                if not self.has_chunk(c):
                    self._forget_hot(c)
