"""Durable local store: verified manifests, content-addressed chunks, the current weights.

Layout under the data dir::

    manifests/<digest>.json          signed manifests as received (digest = Manifest.digest)
    chunks/<sha256>                  chunk bytes, named by their SHA-256
    weights/<file-sha256>.safetensors  the accepted weights
    state.json                       {"version", "state_hash", "weights", "weights_sha256"}

Crash safety: every file is written through ``atomic`` (temp file, fsync, rename, fsync dir),
so a crash at any instant leaves each file old or new, never half-written. The accepted state
switches in one atomic step: the new weights file is written first under its own name, then
``state.json`` is replaced to point at it, then the old weights file is removed. On open the
store checks itself: it removes temp files, chunks whose bytes do not match their name,
manifests that do not parse or match their name, and weights files that state.json does not
name; it verifies the weights file against state.json. Chunks read from disk are re-hashed, so
a chunk corrupted on disk is dropped, never served; recently stored or served chunks are kept,
verified, in a bounded in-memory LRU (``memory_cache_bytes``), so relaying costs no disk read.

The store trusts its caller to have verified manifests (``manifest.verify``) before putting
them; it re-parses them on open but does not re-check signatures.
"""

from __future__ import annotations

import collections
import hashlib
import json
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
    memory_cache_bytes: int = 256 * 2**20  # recently stored or served chunks, kept verified
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
        self.chunk_dir = root / "chunks"
        self.manifest_dir = root / "manifests"
        self.weights_dir = root / "weights"
        self.state_path = root / "state.json"
        self._manifests: dict[str, tuple[Manifest, bytes]] = {}
        self._chunks: set[str] = set()  # hashes of the chunk files present (and verified)
        self._hot: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # LRU
        self._hot_bytes = 0
        self.state: AcceptedState | None = None
        self.dropped: list[str] = []  # what the last self-check removed, for logs and tests

    @classmethod
    def open(cls, root: str | os.PathLike[str], limits: StoreLimits = StoreLimits()) -> Store:
        store = cls(Path(root), limits)
        for d in (store.root, store.chunk_dir, store.manifest_dir, store.weights_dir):
            d.mkdir(parents=True, exist_ok=True)
        store._check()
        return store

    # ------------------------------------------------------------ self-check

    def _drop(self, path: Path, why: str) -> None:
        path.unlink(missing_ok=True)
        if path.parent == self.chunk_dir:
            self._chunks.discard(path.name)
            hot = self._hot.pop(path.name, None)
            self._hot_bytes -= len(hot) if hot is not None else 0
        self.dropped.append(f"{path.relative_to(self.root)}: {why}")

    def _check(self) -> None:
        for d in (self.root, self.chunk_dir, self.manifest_dir, self.weights_dir):
            for p in d.iterdir():
                if _is_temp(p):
                    self._drop(p, "partial write")
        for p in self.chunk_dir.iterdir():
            if chunk_hash(p.read_bytes()) != p.name:
                self._drop(p, "content does not match its hash")
            else:
                self._chunks.add(p.name)
        for p in self.manifest_dir.iterdir():
            self._load_manifest(p)
        self.state = self._load_state()
        for p in self.weights_dir.iterdir():
            if self.state is None or p != self.state.weights:
                self._drop(p, "not the accepted weights")

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
        self._manifests[manifest.digest] = (manifest, data)

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

    def chunk_path(self, digest: str) -> Path:
        if not _HEX64.fullmatch(digest):
            raise ValueError(f"not a chunk hash: {digest[:80]!r}")
        return self.chunk_dir / digest

    def put_chunk(self, data: bytes | memoryview, digest: str | None = None) -> str:
        """Store a chunk under its hash (idempotent); returns the hash. Pass ``digest`` only
        when the caller has just computed it from these very bytes (saves a second hash)."""
        digest = digest or chunk_hash(data)
        path = self.chunk_path(digest)
        if digest not in self._chunks:
            # No fsync: chunks are re-hashed on open and on every read from disk, so a chunk
            # torn by a power loss is dropped, never served; skipping ~1-5 ms per chunk matters.
            data = bytes(data)
            atomic_write_bytes(path, data, durable=False)
            self._chunks.add(digest)
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

    def has_chunk(self, digest: str) -> bool:
        return digest in self._chunks

    def get_chunk(self, digest: str) -> bytes | None:
        """The chunk's bytes, verified; a chunk corrupted on disk is dropped, not served."""
        hot = self._hot.get(digest)
        if hot is not None:
            self._hot.move_to_end(digest)
            return hot
        path = self.chunk_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._chunks.discard(digest)
            return None
        if chunk_hash(data) != digest:
            self._drop(path, "corrupted on disk")
            return None
        self._remember(digest, data)
        return data

    def chunk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.chunk_dir.iterdir() if not _is_temp(p))

    # ------------------------------------------------------------ manifests

    def put_manifest(self, manifest: Manifest, data: bytes) -> None:
        """Keep a verified manifest (its exact signed bytes, so it can be served onward)."""
        atomic_write_bytes(self.manifest_dir / f"{manifest.digest}.json", data)
        self._manifests[manifest.digest] = (manifest, data)

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

    def payload(self, manifest: Manifest) -> bytes | None:
        """The reassembled payload if every chunk is present and verifies."""
        parts = [self.get_chunk(c) for c in manifest.chunks]
        if any(p is None for p in parts):
            return None
        return b"".join(p for p in parts if p is not None)

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
        """Digests of manifests catch-up still needs: the newest anchor and every later one."""
        snaps = [m for m in self.manifests() if m.kind == SNAPSHOT and self.has_payload(m)]
        floor = max((m.version for m in snaps), default=0)
        return {m.digest for m in self.manifests() if m.version >= floor}

    def evict(self) -> list[str]:
        """Drop chunks until under ``max_chunk_bytes``: first chunks no manifest names, then
        whole unprotected artifacts, oldest version first. Returns the dropped chunk hashes."""
        budget, used = self.limits.max_chunk_bytes, self.chunk_bytes()
        if used <= budget:
            return []
        protected = self.protected()
        keep = {c for d in protected for c in self._manifests[d][0].chunks}
        named = {c for m in self.manifests() for c in m.chunks}
        order = [p.name for p in self.chunk_dir.iterdir() if p.name not in named]
        for m in self.manifests():
            if m.digest not in protected:
                order += [c for c in m.chunks if c not in keep]
        dropped = []
        for digest in dict.fromkeys(order):
            if used <= budget:
                break
            path = self.chunk_dir / digest
            if path.exists():
                used -= path.stat().st_size
                self._drop(path, "evicted (cache budget)")
                dropped.append(digest)
        return dropped
