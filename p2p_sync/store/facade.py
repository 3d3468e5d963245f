"""``Store``: the one object the rest of the code holds for a node's durable state.

It opens and checks the data dir and hands each call to the part that owns it (the manifest
index, the chunk packs, the checkpoint + log, the eviction policy), holding one lock.

Threads: one owner, a lock. A node calls its store from the event loop (chunks in and out,
manifests, the log), from worker threads (applying a payload, writing a checkpoint,
re-verifying a pack) and from the libp2p thread (``has_manifest``). Every public method holds
``Store._lock`` (re-entrant) while it reads or changes the in-memory indexes or the files they
describe; bulk I/O runs outside it (hashing a mapped payload, writing checkpoint weights, a
trainer's pack) or takes it one chunk at a time (re-verifying a pack), so the event loop never
waits for more than one chunk's worth of work.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Concatenate, ParamSpec, TypeVar

from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.errors import ManifestError, StoreFullError
from p2p_sync.store import evict as policy
from p2p_sync.store.cache import ChunkCache
from p2p_sync.store.datadir import DataDir
from p2p_sync.store.havemap import HaveMark
from p2p_sync.store.limits import StoreLimits
from p2p_sync.store.log import AcceptedLog, AcceptedState, Checkpoint
from p2p_sync.store.manifests import ManifestIndex
from p2p_sync.store.packs import Packs
from p2p_sync.trust.manifest import Manifest

MAX_DROPS_NOTED = 256  # entries of Store.dropped kept

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
        self.data_dir = data = DataDir(root)
        self.pack_dir, self.manifest_dir = data.pack_dir, data.manifest_dir
        self.weights_dir, self.log_path = data.weights_dir, data.log_path
        self.checkpoint_path, self.format_path = data.checkpoint_path, data.format_path
        # what was removed and why (self-checks, eviction), the newest few, for logs and tests
        self.dropped: list[str] = []
        self._lock = threading.RLock()  # the one owner of everything here (module docstring)
        self._index = ManifestIndex(self.manifest_dir)
        cache = ChunkCache(limits.memory_cache_bytes)
        self._packs = Packs(data, self._index, cache, self._lock, self._note_drop)
        self._log = AcceptedLog(data, self._lock, self._index.__contains__, self._note_drop)

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
            store.data_dir.take_lock()
        try:
            store.data_dir.check_format()
            store.data_dir.make_dirs()
            store._check()
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        """Release the data dir's lock (a no-op for a store not opened ``exclusive``)."""
        self.data_dir.release_lock()

    def writing(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn a full disk's OSError while writing ``what`` into StoreFullError, logged once
        a minute at most. Every write into the data dir goes through it: the store's own, and
        the trainer's anchor file, written beside the packs before it becomes one."""
        return self.data_dir.writing(what)

    @property
    def refused_writes(self) -> int:
        """Writes a full disk refused (StoreFullError)."""
        return self.data_dir.refused_writes

    # ------------------------------------------------------------ self-check and drops

    def _check(self) -> None:
        """Remove temp files, manifests that do not parse or match their name, packs no
        manifest names and weights the checkpoint does not name; re-hash every pack slot."""
        for p in list(self.data_dir.temp_files()):
            self._drop(p, "partial write")
        for p in self.manifest_dir.iterdir():
            why = self._index.load(p)
            if why is None:
                self._packs.news.changed()
            else:
                self._drop(p, why)
        for p in self.pack_dir.iterdir():
            if p.name not in self._index:
                self._drop(p, "no manifest names this pack")
            else:
                self._packs.verify_slots(self._index.of(p.name))
        self._log.load()
        for p in self.weights_dir.iterdir():
            if self.checkpoint is None or p != self.checkpoint.weights:
                self._drop(p, "not the checkpoint")

    def _drop(self, path: Path, why: str) -> None:
        path.unlink(missing_ok=True)
        if path.parent == self.pack_dir:
            self._packs.forget(path.name)
        self._note_drop(f"{path.relative_to(self.root)}: {why}")

    def _note_drop(self, what: str) -> None:
        self._packs.news.changed()
        self.dropped.append(what)
        del self.dropped[:-MAX_DROPS_NOTED]  # a long run evicts every version

    def _drop_manifest(self, digest: str, why: str) -> None:
        if self.pack_path(digest).exists():
            self._drop(self.pack_path(digest), why)
        self._index.pop(digest)
        self._drop(self._index.path(digest), why)

    @_locked
    def drop_refused(self, admit: Callable[[bytes], object]) -> list[tuple[str, str]]:
        """Forget every manifest (and its pack) that ``admit`` refuses by raising ManifestError:
        the owner's trust gate (``TrustedSet.admit_stored``) at restart, as the store cannot
        check signatures itself. Returns (digest, why) of each one dropped."""
        dropped = []
        for digest, (_, data) in list(self._index.entries.items()):
            try:
                admit(data)
            except ManifestError as exc:
                self._drop_manifest(digest, f"refused by the trust gate ({exc})")
                dropped.append((digest, str(exc)))
        return dropped

    @_locked
    def drop_artifact(self, digest: str, why: str) -> None:
        """Forget a manifest and its pack (an anchor that failed verification on load)."""
        if digest in self._index:
            self._drop_manifest(digest, why)

    # ------------------------------------------------------------ chunks and packs

    def pack_path(self, manifest_digest: str) -> Path:
        return self._packs.path(manifest_digest)

    def verify_pack(self, m: Manifest) -> bool:
        """Re-hash every slot of ``m``'s pack from disk, reading block by block (not mapped: a
        multi-GB snapshot then never enters this process's memory); True if all match."""
        return self._packs.verify(m)

    def put_payload(self, manifest: Manifest, payload: bytes) -> None:
        """Store a whole payload (the trainer's own, hashed moments ago for ``manifest``) as
        its pack, in one write, served from memory while it is this node's newest. Call
        before :meth:`put_manifest`: a manifest on disk then always has its pack, and a pack
        left by a crash before it is dropped on open."""
        self._packs.put_payload(manifest, payload)

    def put_pack_file(self, manifest: Manifest, path: Path) -> None:
        """Adopt a payload file written (and hashed, for ``manifest``) by this node as its pack,
        by rename: a multi-GB snapshot is never copied. Same order rule as ``put_payload``."""
        self._packs.put_pack_file(manifest, path)

    @_locked
    def put_chunk(self, data: bytes | memoryview, digest: str | None = None) -> str:
        """Store a verified chunk of a known manifest (idempotent); returns its hash. Pass
        ``digest`` only when the caller has just computed it from these very bytes. A chunk
        that several manifests name is written into the newest one's pack, at every slot
        that names it there: a payload with repeated chunks (constant-initialised tensors)
        is then complete once each distinct chunk arrived."""
        return self._packs.put_chunk(data, digest)

    @_locked
    def has_chunk(self, digest: str) -> bool:
        return self._packs.holds(digest)

    @_locked
    def have_indices(self, manifest: Manifest) -> list[int]:
        """Indices of ``manifest``'s chunks held here (in its own pack or another's). A node
        lists this once per chunk that lands while it downloads (its have-map news), so each
        missing chunk is tested without taking the lock again."""
        return self._packs.have_indices(manifest)

    @_locked
    def held_since(self, manifest: Manifest, mark: HaveMark | None) -> tuple[HaveMark, list[int]]:
        """How ``manifest``'s have-map grew since ``mark`` (from an earlier call; None: never
        asked), and the mark to ask from next: the indices that arrived since, in arrival
        order, and ``mark.whole`` False; or, when the map may have changed otherwise (a drop,
        a manifest or a whole payload added) or ``mark`` is None, :meth:`have_indices` and
        ``whole`` True."""
        return self._packs.held_since(manifest, mark)

    @_locked
    def get_chunk(self, digest: str) -> bytes | None:
        """The chunk's bytes, verified; a slot corrupted on disk is dropped, never served."""
        return self._packs.get_chunk(digest)

    @_locked
    def chunk_bytes(self) -> int:
        """Bytes of verified chunks held on disk."""
        return self._packs.chunk_bytes()

    @_locked
    def has_payload(self, manifest: Manifest) -> bool:
        return all(self._packs.holds(c) for c in manifest.chunks)

    def payload(self, manifest: Manifest) -> memoryview | None:
        """The payload if every chunk is present and verifies, else None. A complete pack is
        mapped read-only and re-hashed slot by slot: no copy of the payload is made (a fresh
        copy of a large payload costs more CPU, in page faults, than hashing it). Safe to
        call from a worker thread (it reads the in-memory cache but does not reorder it)."""
        return self._packs.payload(manifest)

    # ------------------------------------------------------------ manifests

    @_locked
    def put_manifest(self, manifest: Manifest, data: bytes) -> None:
        """Keep a verified manifest (its exact signed bytes, so it can be served onward). On a
        full disk a pack stored for it first (``put_payload``) goes at once, as on open: a
        trainer's anchor is a model's worth of the space the disk lacks."""
        try:
            with self.writing(f"manifest {manifest.digest[:16]}"):
                atomic_write_bytes(self._index.path(manifest.digest), data)
        except StoreFullError:
            if manifest.digest not in self._index:
                self._forget_unnamed(manifest)
            raise
        self._packs.news.changed()
        self._index.register(manifest, data)

    def _forget_unnamed(self, manifest: Manifest) -> None:
        """Drop the pack of ``manifest``, which no stored manifest names, and its index."""
        if self.pack_path(manifest.digest).exists():
            self._drop(self.pack_path(manifest.digest), "its manifest found the disk full")
        self._packs.valid.pop(manifest.digest, None)
        self._index.unindex(manifest)

    @_locked
    def manifests(self) -> list[Manifest]:
        return self._index.sorted()

    @_locked
    def has_manifest(self, digest: str) -> bool:
        return digest in self._index

    @_locked
    def manifest_count(self) -> int:
        return len(self._index)

    @_locked
    def manifest(self, digest: str) -> Manifest | None:
        return self._index.get(digest)

    @_locked
    def manifest_bytes(self, digest: str) -> bytes | None:
        return self._index.data(digest)

    # ------------------------------------------------------------ accepted state: checkpoint + log

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self._log.checkpoint

    @property
    def log(self) -> list[AcceptedState]:
        """The records past the checkpoint, oldest first."""
        return self._log.records

    @property
    def state(self) -> AcceptedState | None:
        """The accepted head: the newest log record, else the checkpoint."""
        with self._lock:
            return self._log.head()

    @_locked
    def state_at(self, version: int) -> str | None:
        """The state hash this node accepted at ``version``, while the checkpoint or the log
        still records it (the trust gate admits an anchor of that very state as a record)."""
        return self._log.state_at(version)

    @_locked
    def record(self, version: int, state_hash: str, manifest_digest: str) -> None:
        """Append (version, state, artifact) to the log, durably: the weights now hold
        ``version``, reached by applying that verified artifact to the previous state. One small
        fsynced line per version; the weights themselves are written only at checkpoints."""
        self._log.record(version, state_hash, manifest_digest)

    def set_checkpoint(
        self, version: int, state_hash: str, write: Callable[[BinaryIO], None]
    ) -> None:
        """Make the weights of ``version`` the checkpoint, atomically; ``write(f)`` writes the
        safetensors file into the open file ``f`` (``weights_io.write_to``). The new file is
        written under its own name first, then ``checkpoint.json`` is replaced to point at it,
        then the old file and the log records it covers go: a crash at any instant leaves the
        old checkpoint or the new one."""
        self._log.set_checkpoint(version, state_hash, write)

    @_locked
    def drop_checkpoint(self, why: str) -> None:
        """Forget a checkpoint whose weights failed their hash: the node starts over from an
        anchor (re-fetched), never from unverified weights."""
        self._log.drop_checkpoint(why)

    @_locked
    def truncate_log(self, version: int, why: str) -> None:
        """Drop the record of ``version`` and every later one (a logged artifact failed on
        replay): the node re-fetches from the last state it can rebuild."""
        self._log.truncate(version, why)

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
        return self._log.replay_chain(self._index, self.has_payload)

    # ------------------------------------------------------------ eviction

    @_locked
    def protected(self) -> set[str]:
        """Digests of manifests still needed: what replay needs (every artifact the log names,
        and the anchor beside the log it starts from: a trainer's), and for catch-up the newest
        anchor and every later one. The newest anchor known, held or not: a rollout that follows
        patches never fetches anchors, and a newcomer starts from the newest anchor anyway (the
        trainer holds it)."""
        base, _ = self.replay_chain()
        return policy.protected(self.manifests(), self.log, base)

    @_locked
    def evict(self) -> list[str]:
        """Keep the store within its bounds (``evict``), never touching :meth:`protected`: cut
        the log to start at its replay base when that is an anchor past the checkpoint (a
        trainer's anchors are its checkpoints: the records before it rebuild nothing); forget
        whole artifacts too far behind the head or past ``max_files``; drop whole packs, oldest
        version first, while over ``max_chunk_bytes``; then forget the unprotected manifests
        this node is past and holds no chunk of (evicted, or catch-ups it did not need): kept,
        they would grow the index and ``/manifests`` with every version of a run. Returns the
        digests of the manifests whose packs were dropped for the byte budget."""
        base, _ = self.replay_chain()
        if isinstance(base, Manifest):
            self._log.cut_before(base.version)
        keep = self.protected()
        head = self._log.head()
        if head is not None:
            files = len(self._index) + sum(1 for _ in self.pack_dir.iterdir())
            manifests, has_pack = self.manifests(), self._has_pack
            for digest, why in policy.history(
                manifests, head.version, files, self.limits, keep, has_pack
            ):
                self._drop_manifest(digest, why)
        return self._evict_packs(keep)

    def _has_pack(self, digest: str) -> bool:
        return self.pack_path(digest).exists()

    def _evict_packs(self, keep: set[str]) -> list[str]:
        """Drop packs over the byte budget, then forget what is past and not held."""
        manifests, valid = self.manifests(), self._packs.valid
        used, budget = self._packs.chunk_bytes(), self.limits.max_chunk_bytes
        dropped = policy.packs_over_budget(manifests, valid, used, budget, keep)
        for digest in dropped:
            self._drop(self.pack_path(digest), "evicted (cache budget)")
        head = self._log.head()
        at = head.version if head is not None else None
        for digest in policy.past_and_not_held(self.manifests(), at, valid, keep):
            self._drop_manifest(digest, "past and not held")
        return dropped
