"""The accepted state, as a database keeps it: a checkpoint plus a log.

``log.jsonl`` records, per version past the checkpoint, the state it reached and the verified
artifact that got it there (a few dozen bytes, fsynced), so a version costs disk writes in
proportion to its patch, not to the model; full weights are written only at a checkpoint.
A log append is one ``write`` + fsync; a line torn by a crash is dropped on open. A checkpoint
switches in one step: the new weights file is written first under its own name, then
``checkpoint.json`` is replaced to point at it, then the old file is removed and the log is
rewritten without the records it covers. Its weights are verified when loaded (against the
signed state hash), not on open: opening stays O(1) in the model size.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from p2p_sync import jsonbounds
from p2p_sync.atomic import atomic_write_bytes, atomic_write_with, fsync_dir
from p2p_sync.errors import StoreError, StoreFullError
from p2p_sync.store.datadir import DataDir
from p2p_sync.store.manifests import ManifestIndex
from p2p_sync.trust.manifest import SNAPSHOT, Manifest


@dataclass(frozen=True)
class AcceptedState:
    """An accepted version: its signed state hash and the artifact that led to it (None for a
    checkpoint the log no longer covers)."""

    version: int
    state_hash: str
    manifest: str | None


@dataclass(frozen=True)
class Checkpoint:
    """Full weights of one version on disk; verified against ``state_hash`` when loaded."""

    version: int
    state_hash: str
    weights: Path


def log_line(rec: AcceptedState) -> bytes:
    doc = {"version": rec.version, "state_hash": rec.state_hash, "manifest": rec.manifest}
    return json.dumps(doc).encode() + b"\n"


def parse_record(line: bytes) -> AcceptedState | None:
    try:
        doc = jsonbounds.loads(line)
        rec = AcceptedState(int(doc["version"]), str(doc["state_hash"]), str(doc["manifest"]))
    except (ValueError, KeyError, TypeError):
        return None
    return rec


class AcceptedLog:
    """The checkpoint and the log records past it, on disk and in memory. The caller holds
    the store's lock, except around :meth:`set_checkpoint`, which takes it itself."""

    def __init__(
        self,
        data: DataDir,
        lock: threading.RLock,
        known: Callable[[object], bool],
        note_drop: Callable[[str], None],
    ) -> None:
        self.data, self.path, self.lock = data, data.log_path, lock
        self._known = known  # whether a manifest is stored: a record must name one
        self._note_drop = note_drop
        self.checkpoint: Checkpoint | None = None
        self.records: list[AcceptedState] = []  # past the checkpoint, oldest first

    def head(self) -> AcceptedState | None:
        """The newest log record, else the checkpoint."""
        if self.records:
            return self.records[-1]
        c = self.checkpoint
        return AcceptedState(c.version, c.state_hash, None) if c else None

    def state_at(self, version: int) -> str | None:
        c = self.checkpoint
        if c is not None and c.version == version:
            return c.state_hash
        return next((r.state_hash for r in self.records if r.version == version), None)

    # ------------------------------------------------------------ the log

    def record(self, version: int, state_hash: str, manifest_digest: str) -> None:
        """Append (version, state, artifact) to the log, durably."""
        head = self.head()
        if head is not None and version <= head.version:
            raise StoreError(f"refusing to replace v{head.version} with older v{version}")
        if not self._known(manifest_digest):
            raise StoreError(f"no known manifest {manifest_digest} to log for v{version}")
        rec = AcceptedState(version, state_hash, manifest_digest)
        with self.data.writing(f"the log record of v{version}"):
            self._append(log_line(rec))
        self.records.append(rec)

    def _append(self, line: bytes) -> None:
        """One ``write`` + fsync. A write that fails part-way (a full disk) is cut back off,
        so the next record starts a line of its own; a line torn by a crash is dropped on
        open."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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

    def rewrite(self, records: list[AcceptedState]) -> None:
        with self.data.writing("the log"):
            atomic_write_bytes(self.path, b"".join(log_line(r) for r in records))
        self.records = list(records)

    def truncate(self, version: int, why: str) -> None:
        """Drop the record of ``version`` and every later one."""
        kept = [r for r in self.records if r.version < version]
        if len(kept) != len(self.records):
            self._note_drop(f"log from v{version}: {why}")
            self.rewrite(kept)

    def cut_before(self, version: int) -> None:
        """Start the log at the record of ``version``; on a full disk the cut waits."""
        start = next(i for i, r in enumerate(self.records) if r.version == version)
        if start:
            with contextlib.suppress(StoreFullError):
                self.rewrite(self.records[start:])

    # ------------------------------------------------------------ the checkpoint

    def set_checkpoint(
        self, version: int, state_hash: str, write: Callable[[BinaryIO], None]
    ) -> None:
        """Write the full weights of ``version`` under their own name, then switch to them."""
        if self.checkpoint is not None and version < self.checkpoint.version:
            raise StoreError(
                f"refusing to replace checkpoint v{self.checkpoint.version} with older v{version}"
            )
        final = self.data.weights_dir / f"v{version}-{state_hash[:32]}.safetensors"
        with self.data.writing(f"the checkpoint of v{version}"):
            atomic_write_with(final, write)  # the full weights, a new file: no lock needed
        with self.lock:
            self._switch(Checkpoint(version, state_hash, final))

    def _switch(self, new: Checkpoint) -> None:
        """Point ``checkpoint.json`` at ``new``'s weights, then remove the old weights and the
        log records ``new`` covers."""
        doc = {"version": new.version, "state_hash": new.state_hash, "weights": new.weights.name}
        try:
            with self.data.writing("checkpoint.json"):
                atomic_write_bytes(self.data.checkpoint_path, json.dumps(doc).encode())
        except StoreFullError:
            new.weights.unlink(missing_ok=True)  # the old checkpoint and its log stay
            raise
        old, self.checkpoint = self.checkpoint, new
        if old is not None and old.weights != new.weights:
            old.weights.unlink(missing_ok=True)
        kept = [r for r in self.records if r.version > new.version]
        try:
            self.rewrite(kept)
        except StoreFullError:  # the file's older records are skipped on open (the floor)
            self.records = kept

    def drop_checkpoint(self, why: str) -> None:
        """Forget the checkpoint: its file, then its weights."""
        if self.checkpoint is None:
            return
        self.data.checkpoint_path.unlink(missing_ok=True)
        fsync_dir(self.data.root)
        self._drop_file(self.checkpoint.weights, why)
        self.checkpoint = None

    def _drop_file(self, path: Path, why: str) -> None:
        path.unlink(missing_ok=True)
        self._note_drop(f"{path.relative_to(self.data.root)}: {why}")

    # ------------------------------------------------------------ on open

    def load(self) -> None:
        """Read the checkpoint, then the log past it."""
        self.checkpoint = self._load_checkpoint()
        self.records = self._load_log()

    def _load_checkpoint(self) -> Checkpoint | None:
        path = self.data.checkpoint_path
        if not path.exists():
            return None
        try:
            doc = jsonbounds.loads(path.read_bytes())
            version, state_hash = int(doc["version"]), str(doc["state_hash"])
            ckpt = Checkpoint(version, state_hash, self.data.weights_dir / str(doc["weights"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{path}: unreadable checkpoint ({exc})") from None
        if not ckpt.weights.is_file():
            self._drop_file(path, f"names missing weights {ckpt.weights.name}")
            return None
        return ckpt

    def _load_log(self) -> list[AcceptedState]:
        """The log's records past the checkpoint. A torn last line (a crash mid-append) and
        anything naming an unknown manifest end the log there; the file is rewritten clean."""
        if not self.path.exists():
            return []
        floor = self.checkpoint.version if self.checkpoint else -1
        *complete, torn = self.path.read_bytes().split(b"\n")  # records end with "\n"
        records: list[AcceptedState] = []
        clean = not torn
        for line in complete:
            rec = parse_record(line)
            if rec is not None and rec.version <= floor:
                continue  # covered by the checkpoint (a rewrite a full disk refused)
            if (
                rec is None
                or not self._known(rec.manifest)
                or (records and rec.version <= records[-1].version)
            ):
                self._note_drop(f"log: unreadable record after {len(records)}")
                clean = False
                break
            records.append(rec)
        if not clean:
            self.rewrite(records)
        return records

    # ------------------------------------------------------------ replay

    def replay_chain(
        self, index: ManifestIndex, held: Callable[[Manifest], bool]
    ) -> tuple[Checkpoint | Manifest | None, list[Manifest]]:
        """A base (the checkpoint, or the newest held snapshot of a logged state: the logged
        artifact, or an anchor of the same version and state) and the logged patches after
        it, in order."""
        base: Checkpoint | Manifest | None = self.checkpoint
        start = 0
        manifests = [m for m, _ in index.entries.values()]
        anchors = {(m.version, m.target_state): m for m in manifests if m.kind == SNAPSHOT}
        for i, rec in enumerate(self.records):
            m = index.get(rec.manifest) if rec.manifest else None
            if m is None or m.kind != SNAPSHOT:
                m = anchors.get((rec.version, rec.state_hash))
            if m is not None and held(m):
                base, start = m, i + 1
        chain = []
        for rec in self.records[start:]:
            m = index.get(rec.manifest) if rec.manifest else None
            if m is None:
                break
            chain.append(m)
        return base, chain
