"""Durable local store: verified manifests, their payloads' chunks, a checkpoint and a log.

Layout under the data dir::

    manifests/<digest>.json          signed manifests as received (digest = Manifest.digest)
    packs/<manifest digest>          that manifest's payload, each chunk at its offset
                                     (chunk_index * chunk_size); sparse while downloading
    weights/v<version>-<hash>.safetensors  the checkpoint's full weights
    checkpoint.json                  {"version", "state_hash", "weights"}
    log.jsonl                        one line per accepted version past the checkpoint:
                                     {"version", "state_hash", "manifest"}
    format.json                      {"state_hash": 2}: how the recorded hashes were made
    lock                             the running node's pid, ``flock``ed while it runs

The accepted state is a database's: a **checkpoint plus a log**. The verified artifacts in the
packs are the log's contents; ``log.jsonl`` records, per version, the state it reached and the
artifact that got it there (a few dozen bytes, fsynced). Full weights are written only at a
checkpoint (every few versions, and at clean shutdown), so a version costs disk writes in
proportion to its patch, not to the model. Recovery (``p2p_sync.store.restore``) loads the
checkpoint, or the newest logged snapshot, and re-applies the logged patches, checking every
step against its signed state hash. Eviction never drops a pack the log names.

Why one pack file per manifest and not one file per chunk: on ext4, creating a file costs
far more than writing its 256 KiB (inode allocation, directory entry, rename): with eight
rollouts on one disk, per-chunk files took over half of all CPU time in the loopback swarm
benchmark. A pack is one file written with ``pwrite`` at each chunk's offset; a completed
pack is the payload itself.

Crash safety: manifests, checkpoint weights and ``checkpoint.json`` are written through
``atomic`` (temp file, fsync, rename, fsync dir), so a crash at any instant leaves each old or
new, never half-written. A checkpoint switches in one step: the new weights file is written
first under its own name, then ``checkpoint.json`` is replaced to point at it, then the old
file is removed and the log is rewritten without the records it covers. A log append is one
``write`` + fsync; a line torn by a crash is dropped on open. Chunks are not fsynced: a pack
slot is trusted only after its bytes hash to the name the signed manifest gives it, on open
and on every read from disk, so a slot torn by a crash (or never written: packs are sparse)
is simply absent, and replay re-fetches it. On open the store checks itself: it removes temp
files, manifests that do not parse or match their name, packs no manifest names, and weights
files the checkpoint does not name; it re-hashes every pack slot. The checkpoint's weights
are verified when loaded (against the signed state hash), not on open: opening stays O(1) in
the model size. Recently stored or served chunks are kept, verified, in a bounded in-memory
LRU (``memory_cache_bytes``), so relaying costs no disk read. A node's own payloads of its
newest version (``put_payload``: the trainer's head patch and catch-up spans) are served from
the very bytes it built, whatever their size: every peer fetches them first, and an LRU a little
smaller than the head patch misses on every chunk (each miss evicts a chunk not yet served).

One node per data dir: a node opens its store ``exclusive`` (``fcntl.flock`` on ``lock``,
which holds its pid), so a second node started on the same dir fails at once with
:class:`DataDirInUseError` naming the holder, instead of sharing its libp2p identity and
writing into its log. The OS drops the lock when the process dies, however it dies.

A full disk (ENOSPC, or a quota) is :class:`StoreFullError`, logged once a minute at most:
what was being written is not kept (a chunk is not marked held, a manifest not learned, a
version not logged) and everything written before stays, so the caller tries again later
and resumes once there is room. A short ``pwrite`` is finished, never left as a torn slot.

Bounded by versions and files as well as bytes (``StoreLimits``): eviction keeps what replay
needs (the replay base and the log after it: the log is cut to start at an anchor that became
the replay base, as a checkpoint cuts it), what newcomers need (the newest anchor and every
later artifact) and, for peers catching up with patches, the artifacts of the last
``max_versions`` versions; older ones go whole (manifest and pack), oldest first, and so do
the oldest beyond ``max_files``.

The store trusts its caller to have verified manifests (``trusted.TrustedSet``) and chunks
(``chunks.verify_chunk``) before putting them; it re-parses manifests on open, and its owner
re-checks their signatures through the same gate (``drop_refused``).

Threads: one owner, a lock. A node calls its store from the event loop (chunks in and out,
manifests, the log), from worker threads (applying a payload, writing a checkpoint,
re-verifying a pack) and from the libp2p thread (``has_manifest``). Every public method holds
``Store._lock`` (re-entrant) while it reads or changes the in-memory indexes or the files they
describe; bulk I/O runs outside it (hashing a mapped payload, writing checkpoint weights, a
trainer's pack) or takes it one chunk at a time (re-verifying a pack), so the event loop never
waits for more than one chunk's worth of work.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import json
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Concatenate, ParamSpec, TypeVar

from p2p_sync import jsonbounds
from p2p_sync.atomic import atomic_write_bytes, atomic_write_with, fsync_dir
from p2p_sync.errors import (  # noqa: F401 (re-exported)
    DataDirInUseError,
    ManifestError,
    StoreError,
    StoreFormatError,
    StoreFullError,
)
from p2p_sync.protocol.ratelimit import RepeatedLine
from p2p_sync.trust.chunks import chunk_hash
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, ManifestLimits, parse

_HEX64 = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger("p2psync.store")


# The state hash definition the recorded hashes follow (p2p_sync.weights.statehash; 1 was XXH3).
STATE_HASH_FORMAT = 2
MAX_DROPS_NOTED = 256  # entries of Store.dropped kept
FULL_NOTED_EVERY_S = 60.0  # a full disk is logged at most this often (every write fails)
LOCK_NAME = "lock"  # in the data dir: the running node's pid, flocked while it runs
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(frozen=True)
class StoreLimits:
    """Bounds of the local cache. What replay needs (the replay base and the log after it)
    and what newcomers need (the newest anchor and every later artifact) stay whatever the
    bounds; everything else goes oldest first once past any of them."""

    max_gb: float = 4.0  # chunk packs kept on disk (the newest anchor and its chain stay)
    # artifacts kept behind the head for peers catching up with patches (older ones: the
    # anchor); at least the longest catch-up span (publish.catchup_spans, 16 by default)
    max_versions: int = 32
    max_files: int = 1024  # manifests and packs kept (a small patch is two files a version)
    checkpoint_every: int = 10  # full weights every N versions (else one log line each)
    memory_cache_bytes: int = 32 * 2**20  # recently stored or served chunks, kept verified
    full_retry_s: float = 5.0  # a node paused by a full disk tries again this often

    @property
    def max_chunk_bytes(self) -> int:
        return int(self.max_gb * 1e9)


@dataclass(frozen=True)
class AcceptedState:
    """An accepted version: its signed state hash and the artifact that led to it (None for a
    checkpoint the log no longer covers)."""

    version: int
    state_hash: str
    manifest: str | None


@dataclass(frozen=True)
class HaveMark:
    """Where a have-map listing stood (``Store.held_since``): the store's count of changes
    other than arrivals, and how many arrivals it had then; ``whole``: that answer was the
    whole map."""

    epoch: int
    at: int
    whole: bool


@dataclass(frozen=True)
class Checkpoint:
    """Full weights of one version on disk; verified against ``state_hash`` when loaded."""

    version: int
    state_hash: str
    weights: Path


def _log_line(rec: AcceptedState) -> bytes:
    doc = {"version": rec.version, "state_hash": rec.state_hash, "manifest": rec.manifest}
    return json.dumps(doc).encode() + b"\n"


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[Store, _P], _R]) -> Callable[Concatenate[Store, _P], _R]:
    """Run ``method`` holding the store's lock (see the module docstring: one owner)."""

    @functools.wraps(method)
    def run(self: Store, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class Store:
    """One node's durable state. Create with :meth:`open`."""

    def __init__(self, root: Path, limits: StoreLimits) -> None:
        self.root, self.limits = root, limits
        self.pack_dir = root / "packs"
        self.manifest_dir = root / "manifests"
        self.weights_dir = root / "weights"
        self.checkpoint_path = root / "checkpoint.json"
        self.format_path = root / "format.json"
        self.log_path = root / "log.jsonl"
        self._manifests: dict[str, tuple[Manifest, bytes]] = {}
        self._where: dict[str, list[tuple[str, int]]] = {}  # chunk hash -> (manifest, index)
        self._valid: dict[str, set[int]] = {}  # manifest digest -> slots verified in its pack
        # have-maps' growth since the last change of any other kind (``held_since``): the
        # indices each manifest gained by ``put_chunk``, in order, and that change's count
        self._arrived: dict[str, list[int]] = {}
        self._epoch = 0
        self._hot: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # LRU
        self._hot_bytes = 0
        self._own: dict[str, tuple[Manifest, bytes]] = {}  # own payloads, newest version only
        self.checkpoint: Checkpoint | None = None
        self.log: list[AcceptedState] = []  # records past the checkpoint, oldest first
        # what was removed and why (self-checks, eviction), the newest few, for logs and tests
        self.dropped: list[str] = []
        self.refused_writes = 0  # writes a full disk refused (StoreFullError)
        self._full_line = RepeatedLine(FULL_NOTED_EVERY_S)  # their log line, once a minute
        self._lock_fd: int | None = None  # the data dir's lock, while this store holds it
        self._lock = threading.RLock()  # the one owner of everything above (module docstring)

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        limits: StoreLimits = StoreLimits(),
        exclusive: bool = False,
    ) -> Store:
        """Open (creating) the data dir and check it. ``exclusive``: a node's store, locked
        until :meth:`close` or the process ends (:class:`DataDirInUseError` while another
        holds it); taken before the self-check, which removes files."""
        store = cls(Path(root), limits)
        store.root.mkdir(parents=True, exist_ok=True)
        if exclusive:
            store._take_lock()
        try:
            store._check_format()
            for d in (store.pack_dir, store.manifest_dir, store.weights_dir):
                d.mkdir(parents=True, exist_ok=True)
            store._check()
        except BaseException:
            store.close()
            raise
        return store

    def _take_lock(self) -> None:
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

    def close(self) -> None:
        """Release the data dir's lock (a no-op for a store not opened ``exclusive``)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Turn a full disk's OSError while writing ``what`` into StoreFullError, logged once
        a minute at most (every write fails until there is room: one line says it). Every
        write into the data dir goes through it: the store's own, and the trainer's anchor
        file, written beside the packs before it becomes one."""
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

    def _check_format(self) -> None:
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

    # ------------------------------------------------------------ self-check

    def _drop(self, path: Path, why: str) -> None:
        path.unlink(missing_ok=True)
        if path.parent == self.pack_dir:
            self._forget_pack(path.name)
        self._note_drop(f"{path.relative_to(self.root)}: {why}")

    def _note_drop(self, what: str) -> None:
        self._have_changed()
        self.dropped.append(what)
        del self.dropped[:-MAX_DROPS_NOTED]  # a long run evicts every version

    def _have_changed(self) -> None:
        """Some have-map changed otherwise than by a chunk arriving (a pack dropped, a slot
        rotted, a manifest or a whole payload added): ``held_since`` answers whole lists."""
        self._epoch += 1
        self._arrived.clear()

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
        self.checkpoint = self._load_checkpoint()
        self.log = self._load_log()
        for p in self.weights_dir.iterdir():
            if self.checkpoint is None or p != self.checkpoint.weights:
                self._drop(p, "not the checkpoint")

    def verify_pack(self, m: Manifest) -> bool:
        """Re-hash every slot of ``m``'s pack from disk, reading block by block (not mapped: a
        multi-GB snapshot then never enters this process's memory); True if all match."""
        try:
            self._verify_pack(m)
        except FileNotFoundError:
            with self._lock:
                self._valid.pop(m.digest, None)
                self._have_changed()
        with self._lock:
            return len(self._valid.get(m.digest, ())) == len(m.chunks)

    def _verify_pack(self, m: Manifest) -> None:
        """Re-hash every slot of ``m``'s pack: the slots that match are the chunks we hold.
        The lock is taken per slot, so chunks keep flowing while a large pack is checked."""
        with open(self.pack_path(m.digest), "rb") as f:
            for i, want in enumerate(m.chunks):
                with self._lock:
                    f.seek(i * m.chunk_size)
                    data = f.read(m.chunk_length(i))
                    if chunk_hash(data) == want:
                        self._valid.setdefault(m.digest, set()).add(i)
                        self._have_changed()
                    elif data.strip(b"\0"):  # not a hole never written: rotted or torn bytes
                        self._invalidate(m.digest, i, "does not match its hash")

    @_locked
    def _invalidate(self, mdigest: str, index: int, why: str) -> None:
        """Slot ``index`` of a pack no longer counts as held (its bytes failed their hash)."""
        self._valid.get(mdigest, set()).discard(index)
        self._note_drop(f"packs/{mdigest} chunk {index}: {why}")

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

    # ------------------------------------------------------------ chunks

    def pack_path(self, manifest_digest: str) -> Path:
        if not _HEX64.fullmatch(manifest_digest):
            raise ValueError(f"not a manifest digest: {manifest_digest[:80]!r}")
        return self.pack_dir / manifest_digest

    def _locate(self, digest: str) -> list[tuple[str, int]]:
        return self._where.get(digest, [])

    def _write_slot(self, m: Manifest, offset: int, data: bytes | memoryview) -> None:
        with self.writing(f"a chunk of {m.digest[:16]}"):
            self._pwrite(self.pack_path(m.digest), offset, data)

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
        """Store a whole payload (the trainer's own, hashed moments ago for ``manifest``) as
        its pack, in one write. Call before :meth:`put_manifest`: a manifest on disk then
        always has its pack, and a pack left by a crash before it is dropped on open."""
        if len(payload) != manifest.payload_size:
            raise ValueError(
                f"payload is {len(payload)} bytes, manifest says {manifest.payload_size}"
            )
        try:
            self._write_slot(manifest, 0, payload)  # a pack nobody names yet: no lock needed
        except StoreFullError:
            if manifest.digest not in self._valid:  # what it holds of it goes: room back
                self.pack_path(manifest.digest).unlink(missing_ok=True)
            raise
        with self._lock:
            self._valid[manifest.digest] = set(range(len(manifest.chunks)))
            self._index(manifest)
            self._have_changed()
            self._keep_own(manifest, bytes(payload))  # no copy of ``bytes``; served next

    def _keep_own(self, manifest: Manifest, payload: bytes) -> None:
        """Serve ``payload`` from memory until a newer version's own payload arrives (the
        caller, who built it, usually holds it anyway: no copy is made)."""
        for digest, (m, _) in list(self._own.items()):
            if m.version < manifest.version:
                del self._own[digest]
        self._own[manifest.digest] = (manifest, payload)

    def _own_chunk(self, digest: str) -> bytes | None:
        for mdigest, index in self._where.get(digest, ()):
            own = self._own.get(mdigest)
            if own is not None and index in self._valid.get(mdigest, ()):
                return own[1][self._slot(own[0], index)]
        return None

    def put_pack_file(self, manifest: Manifest, path: Path) -> None:
        """Adopt a payload file written (and hashed, for ``manifest``) by this node as its pack,
        by rename: a multi-GB snapshot is never copied. Same order rule as ``put_payload``."""
        if os.stat(path).st_size != manifest.payload_size:
            raise ValueError(f"{path} is not {manifest.payload_size} bytes")
        with self._lock, self.writing(f"the pack of {manifest.digest[:16]}"):
            try:
                os.replace(path, self.pack_path(manifest.digest))
            except OSError:
                path.unlink(missing_ok=True)  # adopted or not, it is the store's now
                raise
        with self._lock:
            self._valid[manifest.digest] = set(range(len(manifest.chunks)))
            self._index(manifest)
            self._have_changed()

    @_locked
    def put_chunk(self, data: bytes | memoryview, digest: str | None = None) -> str:
        """Store a verified chunk of a known manifest (idempotent); returns its hash. Pass
        ``digest`` only when the caller has just computed it from these very bytes. A chunk
        that several manifests name is written into the newest one's pack, at every slot
        that names it there: a payload with repeated chunks (constant-initialised tensors)
        is then complete once each distinct chunk arrived."""
        digest = digest or chunk_hash(data)
        where = self._locate(digest)
        if not where:
            raise StoreError(f"no known manifest names chunk {digest}")
        if not self.has_chunk(digest):
            data = bytes(data)
            mdigest = max(where, key=lambda w: self._manifests[w[0]][0].version)[0]
            m = self._manifests[mdigest][0]
            for index in (i for d, i in where if d == mdigest):
                self._write_slot(m, self._slot(m, index).start, data)
                self._valid.setdefault(mdigest, set()).add(index)
            for d, i in where:  # held now in every manifest that names it
                self._arrived.setdefault(d, []).append(i)
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

    @_locked
    def has_chunk(self, digest: str) -> bool:
        return self._holds(digest)

    def _holds(self, digest: str) -> bool:
        """Whether some pack holds chunk ``digest`` (the caller holds the lock)."""
        return any(i in self._valid.get(d, ()) for d, i in self._where.get(digest, ()))

    @_locked
    def have_indices(self, manifest: Manifest) -> list[int]:
        """Indices of ``manifest``'s chunks held here (in its own pack or another's). A node
        lists this once per chunk that lands while it downloads (its have-map news), so each
        missing chunk is tested without taking the lock again (``has_chunk`` per chunk made
        the listing 1.9x slower: 0.54 ms against 0.28 for 1,526 chunks, half held)."""
        valid = self._valid.get(manifest.digest, set())
        if len(valid) == len(manifest.chunks):
            return list(range(len(manifest.chunks)))
        holds = self._holds
        return [i for i, c in enumerate(manifest.chunks) if i in valid or holds(c)]

    @_locked
    def held_since(self, manifest: Manifest, mark: HaveMark | None) -> tuple[HaveMark, list[int]]:
        """How ``manifest``'s have-map grew since ``mark`` (from an earlier call; None: never
        asked), and the mark to ask from next: the indices that arrived since, in arrival
        order, and ``mark.whole`` False; or, when the map may have changed otherwise (a drop,
        a manifest or a whole payload added) or ``mark`` is None, :meth:`have_indices` and
        ``whole`` True. A node lists its have-maps after every chunk that lands; a whole
        listing each time made a version cost O(chunks^2): 0.54 s of CPU per rollout for
        1,536 chunks (``benchmarks/have_listing.py``)."""
        arrived = self._arrived.get(manifest.digest, [])
        if mark is not None and mark.epoch == self._epoch and mark.at <= len(arrived):
            return HaveMark(self._epoch, len(arrived), False), arrived[mark.at :]
        return HaveMark(self._epoch, len(arrived), True), self.have_indices(manifest)

    @_locked
    def get_chunk(self, digest: str) -> bytes | None:
        """The chunk's bytes, verified; a slot corrupted on disk is dropped, never served."""
        hot = self._hot.get(digest)
        if hot is not None:
            self._hot.move_to_end(digest)
            return hot
        own = self._own_chunk(digest)
        if own is not None:
            return own
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

    @_locked
    def chunk_bytes(self) -> int:
        """Bytes of verified chunks held on disk."""
        total = 0
        for mdigest, valid in self._valid.items():
            m = self._manifests[mdigest][0] if mdigest in self._manifests else None
            total += sum(m.chunk_length(i) for i in valid) if m else 0
        return total

    # ------------------------------------------------------------ manifests

    @_locked
    def put_manifest(self, manifest: Manifest, data: bytes) -> None:
        """Keep a verified manifest (its exact signed bytes, so it can be served onward). On a
        full disk a pack stored for it first (``put_payload``) goes at once, as on open: a
        trainer's anchor is a model's worth of the space the disk lacks."""
        try:
            with self.writing(f"manifest {manifest.digest[:16]}"):
                atomic_write_bytes(self.manifest_dir / f"{manifest.digest}.json", data)
        except StoreFullError:
            if manifest.digest not in self._manifests:
                self._forget_unnamed(manifest)
            raise
        self._register(manifest, data)

    def _forget_unnamed(self, manifest: Manifest) -> None:
        """Drop the pack of ``manifest``, which no stored manifest names, and its index."""
        if self.pack_path(manifest.digest).exists():
            self._drop(self.pack_path(manifest.digest), "its manifest found the disk full")
        self._valid.pop(manifest.digest, None)
        self._unindex(manifest)

    def _register(self, manifest: Manifest, data: bytes) -> None:
        self._manifests[manifest.digest] = (manifest, data)
        self._index(manifest)

    def _index(self, manifest: Manifest) -> None:
        self._have_changed()  # its have-map starts with whatever other packs hold
        for i, c in enumerate(manifest.chunks):
            where = self._where.setdefault(c, [])
            if (manifest.digest, i) not in where:
                where.append((manifest.digest, i))

    @_locked
    def drop_refused(self, admit: Callable[[bytes], object]) -> list[tuple[str, str]]:
        """Forget every manifest (and its pack) that ``admit`` refuses by raising ManifestError:
        the owner's trust gate (``TrustedSet.admit_stored``) at restart, as the store cannot
        check signatures itself. Returns (digest, why) of each one dropped."""
        dropped = []
        for digest, (_, data) in list(self._manifests.items()):
            try:
                admit(data)
            except ManifestError as exc:
                self._drop_manifest(digest, f"refused by the trust gate ({exc})")
                dropped.append((digest, str(exc)))
        return dropped

    def _drop_manifest(self, digest: str, why: str) -> None:
        if self.pack_path(digest).exists():
            self._drop(self.pack_path(digest), why)
        manifest, _ = self._manifests.pop(digest)
        self._unindex(manifest)
        self._drop(self.manifest_dir / f"{digest}.json", why)

    def _unindex(self, manifest: Manifest) -> None:
        for c in manifest.chunks:
            where = [w for w in self._where.get(c, []) if w[0] != manifest.digest]
            if where:
                self._where[c] = where
            else:
                self._where.pop(c, None)

    @_locked
    def manifests(self) -> list[Manifest]:
        return sorted((m for m, _ in self._manifests.values()), key=lambda m: (m.version, m.kind))

    @_locked
    def has_manifest(self, digest: str) -> bool:
        return digest in self._manifests

    @_locked
    def manifest_count(self) -> int:
        return len(self._manifests)

    @_locked
    def manifest(self, digest: str) -> Manifest | None:
        entry = self._manifests.get(digest)
        return entry[0] if entry else None

    @_locked
    def manifest_bytes(self, digest: str) -> bytes | None:
        entry = self._manifests.get(digest)
        return entry[1] if entry else None

    @_locked
    def has_payload(self, manifest: Manifest) -> bool:
        return all(self.has_chunk(c) for c in manifest.chunks)

    def payload(self, manifest: Manifest) -> memoryview | None:
        """The payload if every chunk is present and verifies, else None. A complete pack is
        mapped read-only and re-hashed slot by slot: no copy of the payload is made (a fresh
        copy of a 100 MB payload costs more CPU, in page faults, than hashing it). Safe to
        call from a worker thread (it reads the in-memory cache but does not reorder it)."""
        with self._lock:
            complete = len(self._valid.get(manifest.digest, ())) == len(manifest.chunks)
            own = self._own.get(manifest.digest) if complete else None
            if own is not None:
                return memoryview(own[1])
            view = self._map_pack(manifest) if complete else None
        if view is not None and self._all_slots_match(manifest, view):  # hashing: no lock
            return view
        with self._lock:
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

    # ------------------------------------------------------------ accepted state: checkpoint + log

    @property
    def state(self) -> AcceptedState | None:
        """The accepted head: the newest log record, else the checkpoint."""
        with self._lock:
            return self._head()

    def _head(self) -> AcceptedState | None:
        if self.log:
            return self.log[-1]
        c = self.checkpoint
        return AcceptedState(c.version, c.state_hash, None) if c else None

    @_locked
    def state_at(self, version: int) -> str | None:
        """The state hash this node accepted at ``version``, while the checkpoint or the log
        still records it (the trust gate admits an anchor of that very state as a record)."""
        c = self.checkpoint
        if c is not None and c.version == version:
            return c.state_hash
        return next((r.state_hash for r in self.log if r.version == version), None)

    @_locked
    def record(self, version: int, state_hash: str, manifest_digest: str) -> None:
        """Append (version, state, artifact) to the log, durably: the weights now hold
        ``version``, reached by applying that verified artifact to the previous state. One small
        fsynced line per version; the weights themselves are written only at checkpoints."""
        head = self.state
        if head is not None and version <= head.version:
            raise StoreError(f"refusing to replace v{head.version} with older v{version}")
        if manifest_digest not in self._manifests:
            raise StoreError(f"no known manifest {manifest_digest} to log for v{version}")
        rec = AcceptedState(version, state_hash, manifest_digest)
        with self.writing(f"the log record of v{version}"):
            self._append_log(_log_line(rec))
        self.log.append(rec)

    def _append_log(self, line: bytes) -> None:
        """One ``write`` + fsync. A write that fails part-way (a full disk) is cut back off,
        so the next record starts a line of its own; a line torn by a crash is dropped on
        open."""
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)

    def set_checkpoint(
        self, version: int, state_hash: str, write: Callable[[BinaryIO], None]
    ) -> None:
        """Make the weights of ``version`` the checkpoint, atomically; ``write(f)`` writes the
        safetensors file into the open file ``f`` (``weights_io.write_to``). The new file is
        written under its own name first, then ``checkpoint.json`` is replaced to point at it,
        then the old file and the log records it covers go: a crash at any instant leaves the
        old checkpoint or the new one."""
        if self.checkpoint is not None and version < self.checkpoint.version:
            raise StoreError(
                f"refusing to replace checkpoint v{self.checkpoint.version} with older v{version}"
            )
        final = self.weights_dir / f"v{version}-{state_hash[:32]}.safetensors"
        with self.writing(f"the checkpoint of v{version}"):
            atomic_write_with(final, write)  # the full weights, a new file: no lock needed
        doc = {"version": version, "state_hash": state_hash, "weights": final.name}
        with self._lock:
            try:
                with self.writing("checkpoint.json"):
                    atomic_write_bytes(self.checkpoint_path, json.dumps(doc).encode())
            except StoreFullError:
                final.unlink(missing_ok=True)  # the old checkpoint and its log stay
                raise
            old, self.checkpoint = self.checkpoint, Checkpoint(version, state_hash, final)
            if old is not None and old.weights != final:
                old.weights.unlink(missing_ok=True)
            kept = [r for r in self.log if r.version > version]
            try:
                self._rewrite_log(kept)
            except StoreFullError:  # the file's older records are skipped on open (the floor)
                self.log = kept

    @_locked
    def drop_checkpoint(self, why: str) -> None:
        """Forget a checkpoint whose weights failed their hash: the node starts over from an
        anchor (re-fetched), never from unverified weights."""
        if self.checkpoint is None:
            return
        self.checkpoint_path.unlink(missing_ok=True)
        fsync_dir(self.root)
        self._drop(self.checkpoint.weights, why)
        self.checkpoint = None

    @_locked
    def drop_artifact(self, digest: str, why: str) -> None:
        """Forget a manifest and its pack (an anchor that failed verification on load)."""
        if digest in self._manifests:
            self._drop_manifest(digest, why)

    @_locked
    def truncate_log(self, version: int, why: str) -> None:
        """Drop the record of ``version`` and every later one (a logged artifact failed on
        replay): the node re-fetches from the last state it can rebuild."""
        kept = [r for r in self.log if r.version < version]
        if len(kept) != len(self.log):
            self._note_drop(f"log from v{version}: {why}")
            self._rewrite_log(kept)

    def _rewrite_log(self, records: list[AcceptedState]) -> None:
        with self.writing("the log"):
            atomic_write_bytes(self.log_path, b"".join(_log_line(r) for r in records))
        self.log = list(records)

    @_locked
    def checkpoint_due(self, every: int) -> bool:
        """True when the head is ``every`` or more versions past the base replay starts from,
        or nothing can rebuild it: time to write the full weights again."""
        head = self.state
        if head is None:
            return False
        base, _ = self.replay_chain()
        return base is None or head.version - base.version >= every

    @_locked
    def replay_chain(self) -> tuple[Checkpoint | Manifest | None, list[Manifest]]:
        """What rebuilds the accepted weights: a base (the checkpoint, or the newest snapshot
        whose payload is held of a logged state: the logged artifact itself, or an anchor of
        the same version and state stored after the record, as a trainer builds it behind its
        head) and the logged patches after it, in order."""
        base: Checkpoint | Manifest | None = self.checkpoint
        start = 0
        anchors = {
            (m.version, m.target_state): m
            for m, _ in self._manifests.values()
            if m.kind == SNAPSHOT
        }
        for i, rec in enumerate(self.log):
            m = self.manifest(rec.manifest) if rec.manifest else None
            if m is None or m.kind != SNAPSHOT:
                m = anchors.get((rec.version, rec.state_hash))
            if m is not None and self.has_payload(m):
                base, start = m, i + 1
        chain = []
        for rec in self.log[start:]:
            m = self.manifest(rec.manifest) if rec.manifest else None
            if m is None:
                break
            chain.append(m)
        return base, chain

    def _load_checkpoint(self) -> Checkpoint | None:
        path = self.checkpoint_path
        if not path.exists():
            return None
        try:
            doc = jsonbounds.loads(path.read_bytes())
            ckpt = Checkpoint(
                int(doc["version"]), str(doc["state_hash"]), self.weights_dir / str(doc["weights"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{path}: unreadable checkpoint ({exc})") from None
        if not ckpt.weights.is_file():
            self._drop(path, f"names missing weights {ckpt.weights.name}")
            return None
        return ckpt

    def _load_log(self) -> list[AcceptedState]:
        """The log's records past the checkpoint. A torn last line (a crash mid-append) and
        anything naming an unknown manifest end the log there; the file is rewritten clean."""
        if not self.log_path.exists():
            return []
        floor = self.checkpoint.version if self.checkpoint else -1
        *complete, torn = self.log_path.read_bytes().split(b"\n")  # records end with "\n"
        records: list[AcceptedState] = []
        clean = not torn
        for line in complete:
            rec = self._parse_record(line)
            if rec is not None and rec.version <= floor:
                continue  # covered by the checkpoint (a rewrite a full disk refused)
            if (
                rec is None
                or rec.manifest not in self._manifests
                or (records and rec.version <= records[-1].version)
            ):
                self._note_drop(f"log: unreadable record after {len(records)}")
                clean = False
                break
            records.append(rec)
        if not clean:
            self._rewrite_log(records)
        return records

    def _parse_record(self, line: bytes) -> AcceptedState | None:
        try:
            doc = jsonbounds.loads(line)
            rec = AcceptedState(int(doc["version"]), str(doc["state_hash"]), str(doc["manifest"]))
        except (ValueError, KeyError, TypeError):
            return None
        return rec

    # ------------------------------------------------------------ eviction

    @_locked
    def protected(self) -> set[str]:
        """Digests of manifests still needed: what replay needs (every artifact the log names,
        and the anchor beside the log it starts from: a trainer's), and for catch-up the newest
        anchor and every later one. The newest anchor known, held or not: a rollout that follows
        patches never fetches anchors, and a newcomer starts from the newest anchor anyway (the
        trainer holds it)."""
        snaps = [m for m in self.manifests() if m.kind == SNAPSHOT]
        floor = max((m.version for m in snaps), default=0)
        needed = {r.manifest for r in self.log if r.manifest is not None}
        base, _ = self.replay_chain()
        if isinstance(base, Manifest):
            needed.add(base.digest)
        return needed | {m.digest for m in self.manifests() if m.version >= floor}

    @_locked
    def evict(self) -> list[str]:
        """Keep the store within its bounds, never touching :meth:`protected`: cut the log to
        start at its replay base (``_compact_log``); forget whole artifacts more than
        ``max_versions`` behind the head, and the oldest while more than ``max_files``
        manifests and packs are kept (``_evict_history``); drop whole packs, oldest version
        first, until the chunks held are under ``max_chunk_bytes``; then forget the
        unprotected manifests this node is past and holds no chunk of (evicted, or never
        fetched: catch-ups it did not need; no download is in flight for a version below the
        head). Those serve no peer and rebuild nothing, and a rollout hears a few per version:
        kept, its index, its ``/manifests`` list and this method's own scan would grow with
        every version of a run. Returns the digests of the manifests whose packs were dropped
        for the byte budget (the history's routine drops are only noted in ``dropped``)."""
        self._compact_log()
        protected = self.protected()
        self._evict_history(protected)
        dropped = self._evict_packs(protected)
        head = self._head()
        past = [m for m in self.manifests() if head is not None and m.version < head.version]
        for m in past:
            if m.digest not in protected and not self._valid.get(m.digest):
                self._drop_manifest(m.digest, "past and not held")
        return dropped

    def _compact_log(self) -> None:
        """Start the log at the anchor replay starts from when that anchor is past the
        checkpoint (a trainer's anchors are its checkpoints), as a checkpoint cuts it: the
        records before it rebuild nothing, and the artifacts they name may then go. Without
        this a trainer's log, and everything it names, grew with every version. On a full
        disk the cut waits for a later call (the log still names them all: all stay)."""
        base, _ = self.replay_chain()
        if not isinstance(base, Manifest):
            return
        start = next(i for i, r in enumerate(self.log) if r.version == base.version)
        if start:
            with contextlib.suppress(StoreFullError):
                self._rewrite_log(self.log[start:])

    def _evict_history(self, protected: set[str]) -> None:
        """Forget whole unprotected artifacts (manifest and pack) of versions below the head,
        oldest first: those more than ``max_versions`` behind it, then more while over
        ``max_files`` manifests and packs."""
        head = self._head()
        if head is None:
            return
        files = len(self._manifests) + sum(1 for _ in self.pack_dir.iterdir())
        for m in self.manifests():  # oldest first
            too_old = head.version - m.version > self.limits.max_versions
            if m.version >= head.version or (not too_old and files <= self.limits.max_files):
                break
            if m.digest in protected:
                continue
            files -= 1 + self.pack_path(m.digest).exists()
            why = f"more than {self.limits.max_versions} versions behind" if too_old else None
            self._drop_manifest(m.digest, f"evicted ({why or 'over max_files'})")

    def _evict_packs(self, protected: set[str]) -> list[str]:
        budget, used = self.limits.max_chunk_bytes, self.chunk_bytes()
        if used <= budget:
            return []
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
        self._own.pop(mdigest, None)
        if entry is not None:
            for c in entry[0].chunks:
                if not self.has_chunk(c):
                    self._forget_hot(c)
