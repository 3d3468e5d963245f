"""The trainer role: publish every new version as signed, chunked artifacts, and seed them.

``Publisher.publish(state_dict)`` is the Python API (call it after an optimizer step); the CLI
drives it from ``--watch DIR``. Per version it publishes what ``versions.PublishPolicy`` says
(1-step patch, periodic anchor snapshot, aligned merged catch-up patches), stores and serves
the chunks, persists the weights, and announces the manifests to its peers.

Seeding: have-map answers come from ``protocol.seeding.SuperSeeder`` (each requester is shown
chunks of its own): the upload stays near one copy of the payload however many rollouts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from p2p_sync import codec
from p2p_sync.codec.catchup import merge_steps
from p2p_sync.errors import StoreFullError, WeightsFileError
from p2p_sync.protocol.versions import PublishPolicy, to_publish
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.dataview import SeedingView
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.timings import Built, PublishTimings, sizes_line, timings_line
from p2p_sync.store.restore import restore
from p2p_sync.trust.chunks import file_chunk_hashes, manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import PATCH, SNAPSHOT, Manifest, sign
from p2p_sync.weights.patch import (
    DiffScratch,
    Patch,
    TensorDelta,
    add_all,
    check_layout,
    diff,
    diff_tracked,
    untied,
)
from p2p_sync.weights.served import copy_of, detached
from p2p_sync.weights.statehash import StateDigest
from p2p_sync.weights.tensors import (
    Layout,
    TensorSet,
    TensorSpec,
    flat_bits,
    layout_fingerprint,
    layout_of,
    layout_of_specs,
)
from p2p_sync.weights.threads import background_pool, map_workers
from p2p_sync.weights.weights_io import load_weights, open_weights, pread_into, read_index, write_to

log = logging.getLogger("p2psync.trainer")


class TrainerNode(Node):
    """A node that seeds: each requester is shown a few chunks of its own (super-seeding),
    and it serves ``publish.seed_uploads`` of them at once (0: ``download.max_sources``)."""

    view_class = SeedingView

    def __init__(self, cfg: NodeConfig, *args: Any, **kwargs: Any) -> None:
        slots = cfg.publish.seed_uploads or cfg.download.max_sources
        settled = replace(cfg, http=replace(cfg.http, max_concurrent_uploads=slots))
        super().__init__(settled, *args, **kwargs)


class Publisher:
    """Turns successive state dicts into published versions.

    It holds one copy of the last published weights (``prev``: a diff needs the old bits) and
    keeps it current in place: on the host the diff's own pass moves each changed word to the
    new version (``patch.diff_tracked``); on a device the 1-step patch is applied to it. No
    per-version copy. Durable state is the store's checkpoint and log (``p2p_sync.store``): the
    published artifacts are the log; anchors double as checkpoints, and full weights are
    written otherwise only every ``checkpoint_every`` versions and at ``close()``.
    """

    def __init__(
        self,
        node: Node,
        key: SigningKey,
        policy: PublishPolicy | None = None,
        checkpoint_every: int | None = None,
    ) -> None:
        """``policy`` and ``checkpoint_every`` default to the node's config."""
        cfg = node.cfg
        self.node, self.key, self.policy = node, key, policy or cfg.publish
        self.workers = cfg.threads  # threads for per-tensor work
        self.checkpoint_every = checkpoint_every or cfg.store.checkpoint_every
        self.prev: dict[str, torch.Tensor] | None = None
        self.prev_hash: bytes | None = None
        # ``prev``'s per-tensor sums, so each version's state hash costs O(patch); a build
        # leaves the new version's in ``_target_digest`` until ``_advance`` adopts it.
        self.digest: StateDigest | None = None
        self._target_digest: StateDigest | None = None
        self.timings = PublishTimings()
        self.history = _history(self.policy)
        self._spans: asyncio.Task[None] | None = None  # catch-ups of the last version
        self._moved = False  # ``prev`` moved in place ahead of the store (a build in progress)
        self._rebuild_prev()

    @property
    def next_version(self) -> int:
        state = self.node.store.state
        return state.version + 1 if state else 0

    def _manifest(
        self, version: int, kind: str, target: str, layout: str, payload: bytes | None, **extra
    ) -> Manifest:
        return manifest_for(
            payload,
            swarm=self.node.policy.swarm_id,
            version=version,
            kind=kind,
            target_state=target,
            layout=layout,
            now=int(time.time()),
            lifetime_s=self.policy.lifetime_s,
            chunk_size=self.policy.chunk_size,
            **extra,
        )

    def _snapshot(self, version: int, new: TensorSet, target: str, layout: str) -> Built:
        """The anchor: written straight to a pack file one tensor at a time, hashed by reading
        it back block by block; the bytes never sit in memory as one payload."""
        fd, name = tempfile.mkstemp(prefix=".snapshot-", suffix=".tmp", dir=self.node.store.root)
        with self.node.store.writing(f"the anchor of v{version}"):
            try:
                with os.fdopen(fd, "wb") as f:
                    self._write_weights(f, new, version)
            except BaseException:
                os.unlink(name)  # a model's worth of a full disk, given back at once
                raise
        chunks = file_chunk_hashes(name, self.policy.chunk_size)
        m = self._manifest(version, SNAPSHOT, target, layout, None, chunks=chunks)
        return m, sign(m, [self.key]), Path(name)

    def _build(self, new: TensorSet, owned: bool) -> tuple[int, str, Patch | None, list[Built]]:
        """CPU-heavy part (diff, encode, hash, sign) for tensors in memory, in a worker thread:
        tensor by tensor on the host (``_frame_of``), as a whole patch on a device."""
        version = self.next_version
        t = self.timings = PublishTimings(version)
        t0 = time.perf_counter()
        if self.prev is None or self.digest is None or version == 0:
            self._target_digest = StateDigest.of(new, self.workers)
            target = self._target_digest.hash().hex()
            t.diff_s = time.perf_counter() - t0
            built = self._artifacts(version, target, layout_of(new), new, None)
            return version, target, None, built
        if all(t.device.type == "cpu" for t in self.prev.values()):
            return self._build_frames(version, new, t0)
        return self._build_on_device(version, new, owned, t0)

    def _build_frames(
        self, version: int, new: TensorSet, t0: float
    ) -> tuple[int, str, Patch | None, list[Built]]:
        """Each tensor diffed and coded as one frame while ``prev`` moves to it in place, as
        for a watched file: no whole ``Patch`` held (~0.3 GB of positions at 1B), no pass
        left for ``_advance``. Frames are independent, and zstd and numpy release the GIL:
        every worker codes."""
        assert self.prev is not None and self.digest is not None
        layout = layout_of(self.prev)
        check_layout(layout, layout_of(new), "new version")
        digest, scratch = self.digest.copy(), DiffScratch()
        self._moved = True
        done = map_workers(
            lambda s: (s.name, *self._frame_of(s, new[s.name], digest, scratch)),
            layout,
            self.workers,
        )
        return self._assemble(version, layout, digest, done, t0)

    def _build_on_device(self, version: int, new: TensorSet, owned: bool, t0: float) -> tuple:
        """The whole patch, diffed on the weights' device (format 2's scans run there too);
        in format 1 the diff moves ``prev`` in its pass, else ``_advance`` does."""
        assert self.prev is not None and self.digest is not None
        self._moved = not self.policy.based and not owned
        step = diff(self.prev, new, digest=self.digest, workers=self.workers, advance=self._moved)
        self.timings.diff_s = time.perf_counter() - t0
        return self._coded(version, step, new)

    def _coded(self, version: int, step: Patch, new: TensorSet) -> tuple:
        """Code a whole 1-step patch (kept in the history) and sign the head's artifacts."""
        t1, self._target_digest = time.perf_counter(), step.target_digest
        base, seg = self.prev if self.policy.based else None, self.policy.segmented
        payload = codec.encode(step, codec.DEFAULT_LEVEL, self.workers, base, self.prev_hash, seg)
        if self.history.maxlen:  # kept in format 1: merging it needs no base (coded later)
            self.history.append(payload if base is None else step)
        self.timings.encode_s = time.perf_counter() - t1
        target = step.target_hash.hex()
        return version, target, step, self._artifacts(version, target, step.layout, new, payload)

    def _build_file(self, path: Path) -> tuple[int, str, Patch | None, list[Built]]:
        """The same for a weights file, streamed: each tensor is read, diffed against ``prev``
        and coded as one frame, then takes its place in ``prev`` (``workers`` tensors at once).
        Peak memory is ``prev`` plus a tensor per worker, not two models; ``diff_s`` covers
        reading the file too. A file that fails part-way leaves ``prev`` rebuilt from the
        store."""
        assert self.prev is not None and self.prev_hash is not None and self.digest is not None
        version = self.next_version
        self.timings = PublishTimings(version)
        t0 = time.perf_counter()
        with open_weights(path) as f:
            entries, start = read_index(f, path)
            layout = layout_of_specs([(n, dt, shape) for n, dt, shape, _, _ in entries])
            check_layout(layout_of(self.prev), layout, f"{path}")
            digest = self.digest.copy()
            self._moved = True
            done = self._stream_frames(f.fileno(), entries, start, path, digest)
        return self._assemble(version, layout, digest, done, t0)

    def _assemble(
        self, version: int, layout: Layout, digest: StateDigest, done: list, t0: float
    ) -> tuple[int, str, Patch | None, list[Built]]:
        """The patch file (and its history entry) from per-tensor ``done``: (name, frame,
        format-1 frame or, for format 2, the delta to code later), None where unchanged; then
        the signed artifacts."""
        assert self.prev is not None and self.prev_hash is not None
        t, t1 = self.timings, time.perf_counter()
        frames = {name: f for name, f, _ in done if f is not None}
        self._target_digest, target_hash = digest, digest.hash()
        payload = codec.assemble(layout, self.prev_hash, target_hash, frames)
        if self.history.maxlen:
            history = {name: h for name, _, h in done if h is not None}
            if not self.policy.based:
                self.history.append(codec.assemble(layout, self.prev_hash, target_hash, history))
            else:
                self.history.append(Patch(layout, self.prev_hash, target_hash, history))
        t.diff_s, t.encode_s = t1 - t0, time.perf_counter() - t1
        target = target_hash.hex()
        return version, target, None, self._artifacts(version, target, layout, self.prev, payload)

    def _stream_frames(
        self, fd: int, entries: list, start: int, path: Path, digest: StateDigest
    ) -> list[tuple[str, tuple | None, tuple | None]]:
        """Frames (and history frames) of every changed tensor; ``prev`` and ``digest`` move
        to the file's version tensor by tensor, in place (the digest by the words that
        changed). Each tensor is read into a buffer its worker thread reuses: a fresh tensor
        per read would page-fault the whole model in again every version. A buffer is sized
        to the largest tensor its thread has read so far, not to the model's largest."""
        assert self.prev is not None
        local, scratch = threading.local(), DiffScratch()

        def one(entry: tuple) -> tuple[str, tuple | None, tuple | None]:
            name, dtype, shape, begin, end = entry
            if getattr(local, "buffer", None) is None or local.buffer.numel() < end - begin:
                local.buffer = None  # the smaller one goes before the larger one comes
                local.buffer = torch.empty(end - begin, dtype=torch.uint8)
            new = local.buffer[: end - begin].view(dtype).view(shape)
            pread_into(fd, new, start + begin, path, name)
            spec = TensorSpec(name, shape, dtype)
            return name, *self._frame_of(spec, new, digest, scratch)

        return map_workers(one, entries, self.workers)

    def _frame_of(
        self, spec: TensorSpec, new: torch.Tensor, digest: StateDigest, scratch: DiffScratch
    ) -> tuple[tuple | None, tuple | TensorDelta | None]:
        """One tensor's frame and history entry (None, None if unchanged): its format-1 frame,
        or in formats 2 and 3 the delta, coded after the announcement. ``prev``'s tensor and
        the digest move to ``new`` in place. Format 1 moves it in the diff's own pass; formats
        2 and 3 code against the old bits first, then copy."""
        assert self.prev is not None
        old, based = self.prev[spec.name], self.policy.based
        delta = diff_tracked(spec, old, new, digest, scratch, advance=not based)
        if delta is None:
            return None, None
        bits = flat_bits(old).numpy() if based else None
        frame = codec.encode_frame(delta, codec.DEFAULT_LEVEL, bits, self.policy.segmented)
        if not based:
            return frame, frame
        old.copy_(new)
        return frame, delta

    def _rebuild_prev(self) -> None:
        """``prev`` from the store: checkpoint + logged patches (at start, or after a publish
        failed with ``prev`` moved part-way)."""
        restored = restore(self.node.store, workers=self.workers)
        self._moved = False
        self.prev = restored.weights if restored is not None else None
        self.prev_hash = bytes.fromhex(restored.state.state_hash) if restored else None
        self.digest = restored.digest if restored is not None else None

    def _artifacts(
        self, version: int, target: str, layout: Layout, weights: TensorSet, step: bytes | None
    ) -> list[Built]:
        """Sign the head's artifacts: the 1-step patch, or the anchor of a version without
        one (v0). An anchor due later, and merged catch-up spans, follow the announcement
        (``_publish_behind``): they are for newcomers and laggards, and an anchor writes and
        hashes the whole model (seconds at 1B, a minute at 70B)."""
        t, built = self.timings, []
        layout_hex = layout_fingerprint(layout).hex()
        for kind, base in to_publish(version, self.policy):
            t1 = time.perf_counter()
            if kind == SNAPSHOT and step is None:
                built.append(self._snapshot(version, weights, target, layout_hex))
                t.snapshot_s = time.perf_counter() - t1
            elif base == version - 1 and step is not None and self.prev_hash is not None:
                t.patch_bytes = len(step)
                base_state = self.prev_hash.hex()
                built.append(self._signed(version, base, base_state, target, layout_hex, step))
                t.hash_sign_s += time.perf_counter() - t1
        return built

    def _signed(
        self, version: int, base: int, base_state: str, target: str, layout: str, payload: bytes
    ) -> Built:
        m = self._manifest(
            version, PATCH, target, layout, payload, base_version=base, base_state=base_state
        )
        return m, sign(m, [self.key]), payload

    def _encode_history(self) -> None:
        """Code the history's pending steps in format 1 (a background thread's work, after
        the head's announcement; the history does not move before ``spans_done``)."""
        for i in range(len(self.history)):
            step = self.history[i]
            if isinstance(step, Patch):
                self.history[i] = codec.encode(step, workers=self.workers)

    def _span_jobs(self, version: int) -> list[tuple[int, list[bytes | Patch]]]:
        """(base, steps) of each merged catch-up span due at ``version`` that the history
        reaches back to (``_encode_history`` codes any step still pending before a merge)."""
        steps = list(self.history)
        return [
            (base, steps[len(steps) - (version - base) :])
            for kind, base in to_publish(version, self.policy)
            if kind == PATCH and base is not None and 1 < version - base <= len(steps)
        ]

    def _build_spans(self, version: int, target: str, layout: str) -> list[Built]:
        """Merged catch-up patches, merged and coded one tensor at a time, then signed."""
        self._encode_history()
        built = []
        for base, steps in self._span_jobs(version):
            coded = [s for s in steps if isinstance(s, bytes)]
            assert len(coded) == len(steps), "the history's steps are coded first"
            payload = merge_steps(coded, workers=self.workers)
            base_state = codec.read_header(payload).base_hash.hex()
            built.append(self._signed(version, base, base_state, target, layout, payload))
        return built

    def _anchor_due(self, version: int) -> bool:
        """Whether an anchor of ``version`` follows its announcement (v0's is the head)."""
        return version > 0 and any(k == SNAPSHOT for k, _ in to_publish(version, self.policy))

    async def _publish_behind(
        self, version: int, target: str, layout: str, anchor: bool, checkpoint: bool
    ) -> None:
        """Build, store and announce the catch-up spans (coding the history's pending steps
        first) and the anchor of ``version``, then write the checkpoint when one is due and
        code what the history still holds decoded, after its head, in a thread below the
        head's priority. The anchor goes before that coding: newcomers start from it, and
        rollouts evict behind it (one that has applied ``version`` keeps its anchor as a
        record of that state: ``TrustedSet.is_record``). ``prev`` and the history hold
        ``version`` until this ends: the next publish waits for it (``spans_done``)."""
        with background_pool() as pool:  # the head's delivery and the next step go first
            loop = asyncio.get_running_loop()
            if self._span_jobs(version):
                await self._spans_behind(loop, pool, version, target, layout)
            if anchor:
                t1 = time.perf_counter()
                snap = await loop.run_in_executor(
                    pool, self._snapshot, version, self.prev, target, layout
                )
                await self._announce_behind([snap])
                self.timings.snapshot_s = time.perf_counter() - t1
                log.info("v%d anchor in %.2fs", version, self.timings.snapshot_s)
            if checkpoint:
                await loop.run_in_executor(pool, self._checkpoint, version, target)
            await loop.run_in_executor(pool, self._encode_history)
        self.node.last_publish = dataclasses.asdict(self.timings)

    async def _spans_behind(
        self, loop: asyncio.AbstractEventLoop, pool: Any, version: int, target: str, layout: str
    ) -> None:
        """The catch-up spans of ``version``: built in ``pool``, stored and announced."""
        t, t0 = self.timings, time.perf_counter()  # still this version's timings
        built = await loop.run_in_executor(pool, self._build_spans, version, target, layout)
        await self._announce_behind(built)
        t.catchup_s = time.perf_counter() - t0
        t.catchup_bytes = sum(len(p) for *_, p in built)
        log.info("v%d catch-up patches in %.2fs: %s", version, t.catchup_s, sizes_line(built))

    async def _announce_behind(self, built: list[Built]) -> None:
        await asyncio.to_thread(self._put, built)
        await self.node.learner.announce([m.digest for m, _, _ in built])
        self.node.learner.new_info.set()

    def _put(self, built: list[Built]) -> None:
        """Store each artifact's payload (bytes, or a pack file moved in) and its manifest."""
        store = self.node.store
        for m, signed, payload in built:
            if isinstance(payload, Path):
                store.put_pack_file(m, payload)
            else:
                store.put_payload(m, payload)  # hashed moments ago for the manifest
            store.put_manifest(m, signed)

    async def spans_done(self) -> None:
        """Wait for the last version's catch-up patches (a failure is logged: the head it
        follows is published, and peers behind it still have the 1-step patches)."""
        task, self._spans = self._spans, None
        if task is None:
            return
        try:
            await task
        except StoreFullError:
            pass  # logged by the store: the head is published, the next anchor comes later
        except Exception:
            log.exception("building catch-up patches failed")

    def _store(
        self,
        version: int,
        target: str,
        new: TensorSet,
        step: Patch | None,
        built: list[Built],
        owned: bool,
    ) -> None:
        t0 = time.perf_counter()
        store = self.node.store
        self._put(built)
        record = built[0][0]  # v0's anchor, else the 1-step patch
        store.record(version, target, record.digest)
        self._advance(new, step, target, owned)
        self.timings.store_s = time.perf_counter() - t0

    def _checkpoint_due(self, version: int) -> bool:
        """Full weights due at ``version`` (written after its announcement, ``_checkpoint``),
        unless an anchor on its way will be the replay base (``Store.replay_chain``)."""
        return not self._anchor_due(version) and self.node.store.checkpoint_due(
            self.checkpoint_every
        )

    def _checkpoint(self, version: int, target: str) -> None:
        """Write ``prev`` (at ``version``) as the store's checkpoint, after the announcement
        (inline it held a 1B model's every 10th version back by ~2 s). ``prev`` holds ``version``
        until the next publish, which waits for it (``spans_done``); a crash before it lands
        replays the log from the older base."""
        store, prev = self.node.store, self.prev
        store.set_checkpoint(version, target, lambda f: self._write_weights(f, prev, version))

    def _write_weights(self, f: BinaryIO, weights: TensorSet | None, version: int) -> None:
        """``version``'s full weights (an anchor's pack, a checkpoint) to ``f``."""
        write_to(f, weights)  # type: ignore[arg-type]

    def _advance(self, new: TensorSet, step: Patch | None, target: str, owned: bool) -> None:
        """Bring ``prev`` to the new version, unless the build already moved it in place: take
        the caller's tensors when they are handed over (``owned``), apply the step (a device
        diff, O(patch)), or copy them once (v0)."""
        if self._moved:
            pass
        elif owned:
            self.prev = untied(new)
        elif self.prev is not None and step is not None:
            add_all(self.prev, step)  # its sums are the diff's target digest, adopted below
        else:
            self.prev = copy_of(new)
        self.prev_hash = bytes.fromhex(target)
        self.digest, self._target_digest = self._target_digest, None
        self._moved = False

    async def publish(self, state_dict: TensorSet, owned: bool = False) -> list[Manifest]:
        """Publish ``state_dict`` (``ServedWeights``: cast as read) as the next version; returns
        its manifests. Tensors are only read; ``owned=True``: handed over for good, not copied."""
        new = detached(state_dict)
        return await self._publish(lambda: self._build(new, owned), new, owned)

    async def publish_file(self, path: Path) -> list[Manifest]:
        """Publish a safetensors file (``--watch``): streamed tensor by tensor into ``prev``
        when there is one on the CPU to diff against, else loaded whole. A file that cannot be
        published raises ``WeightsFileError`` (gone, unreadable, not a regular file, not
        safetensors, cut short, no tensors) or ``LayoutMismatchError`` (other tensor names,
        shapes or dtypes than v0) and changes nothing."""
        prev = self.prev
        if (
            prev is None
            or self.next_version == 0
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in prev.values())
        ):
            weights = await asyncio.to_thread(load_weights, path)
            if not weights:  # a v0 of nothing would make every later file a layout mismatch
                raise WeightsFileError(f"{path}: holds no tensors")
            return await self.publish(weights, owned=True)
        return await self._publish(lambda: self._build_file(path), None, True)

    async def _publish(
        self, build: Callable[[], tuple], new: TensorSet | None, owned: bool
    ) -> list[Manifest]:
        await self.spans_done()  # the last version's: one writer of the store at a time
        t0 = time.perf_counter()
        try:
            version, target, step, built = await asyncio.to_thread(build)
            new = new if new is not None else self.prev
            assert new is not None
            await asyncio.to_thread(self._store, version, target, new, step, built, owned)
        except Exception:
            if self._moved:  # ``prev`` moved part or all of the way: back to the store's head
                await asyncio.to_thread(self._rebuild_prev)
            raise
        manifests = await self._announced(version, built, t0)
        pending = self._pending()
        anchor, checkpoint = self._anchor_due(version), self._checkpoint_due(version)
        if pending or anchor or checkpoint or self._span_jobs(version):
            self._spans = asyncio.create_task(
                self._publish_behind(version, target, manifests[0].layout, anchor, checkpoint)
            )
        return manifests

    def _pending(self) -> bool:
        """Whether the last version left work for after its announcement (history to code)."""
        return any(isinstance(s, Patch) for s in self.history)

    async def _announced(self, version: int, built: list[Built], t0: float) -> list[Manifest]:
        """Stored: make room, announce the version and log what it cost (since ``t0``)."""
        self.node.evict()  # inline: the store is not shared across threads (a few unlinks)
        self.node.metrics.version.set(version)
        manifests = [m for m, _, _ in built]
        self.timings.stored_at = time.time()
        await self.node.learner.announce([m.digest for m in manifests])
        self.node.learner.new_info.set()
        t = self.timings
        t.total_s, t.finished_at = time.perf_counter() - t0, time.time()
        self.node.last_publish = dataclasses.asdict(t)
        summary = timings_line(t), sizes_line(built)
        log.info("published v%d in %.2fs (%s): %s", version, t.total_s, *summary)
        return manifests

    async def aclose(self) -> None:
        """``close`` once the last catch-up patches are stored (from the node's event loop)."""
        await self.spans_done()
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Checkpoint the head at clean shutdown, so a restart replays nothing."""
        state = self.node.store.state
        if state is not None and self.node.store.checkpoint_due(1):
            with contextlib.suppress(StoreFullError):  # logged by the store; the log rebuilds it
                self._checkpoint(state.version, state.state_hash)

    def refresh(self, now: int) -> list[Manifest]:
        """Re-sign the newest manifest of each (version, kind, base) once half its lifetime has
        passed: same chunks, new created/expires. Without it, an anchor older than the manifest
        lifetime would be refused by newcomers as a freeze attack. Peers already past that
        version ignore the re-signed copy (not newer than what they accepted)."""
        newest: dict[tuple, Manifest] = {}
        for m in self.node.store.manifests():
            key = (m.version, m.kind, m.base_version)
            if key not in newest or m.expires > newest[key].expires:
                newest[key] = m
        fresh = []
        for m in newest.values():
            if now < m.expires - (m.expires - m.created) // 2:
                continue
            renewed = dataclasses.replace(m, created=now, expires=now + self.policy.lifetime_s)
            self.node.store.put_manifest(renewed, sign(renewed, [self.key]))
            fresh.append(renewed)
        return fresh

    async def refresh_loop(self, stop: asyncio.Event, interval: float = 600.0) -> None:
        while not stop.is_set():
            try:
                renewed = await asyncio.to_thread(self.refresh, int(time.time()))
            except StoreFullError:  # logged by the store: the next round tries again
                renewed = []
            if renewed:
                log.info("re-signed %d manifest(s) nearing expiry", len(renewed))
                await self.node.learner.announce([m.digest for m in renewed])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


def _history(policy: PublishPolicy) -> collections.deque[bytes | Patch]:
    """Recent 1-step patches for merged catch-up patches, kept encoded (format 1, no base
    needed): decoded, 16 steps of a 1B model would hold ~5 GB of positions. With formats 2 and
    3 on the wire the newest step waits decoded (a ``Patch``) until ``_encode_history`` codes
    it after the announcement: that coding is not on the way to the rollouts."""
    return collections.deque(maxlen=max(policy.catchup_spans, default=0))
