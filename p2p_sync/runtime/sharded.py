"""A sharded trainer publishing: every rank diffs its own blocks, rank 0 signs and announces.

``Trainer.publish(state_dict)`` with DTensors in it (FSDP2, tensor parallel) is a collective
call. Each rank diffs its blocks of every tensor on its own device against its blocks of the
last version (``weights.dtensors.ShardDiffer``); only the changes and the state-hash sum moves
travel to rank 0 (O(patch)), where they become the checkpoint patch an unsharded publish of the
same weights would make. Each rank codes its own blocks' frames; where a tensor's blocks are
runs of its flat order (FSDP2's rows) rank 0 joins them as they are (coding 5, no decoding),
so its part of a version is O(tensors), not O(patch). Rank 0's node publishes it
(:class:`StepPublisher`) and every rank returns the version number.

In format 1 rank 0 holds no copy of the model: v0's snapshot is written by the ranks straight
into its file, each block where its bytes go; anchors and checkpoints are written from the
store a tensor at a time; after a restart or a failed version the ranks' kept blocks are
seeded from the store's head, a tensor at a time. Formats 2 and 3 code against the base, so
rank 0 keeps the copy every publisher keeps, and their first version since start comes to it
whole, one tensor at a time (no other rank holds a whole tensor).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import torch
import torch.distributed as dist

from p2p_sync import codec
from p2p_sync.codec import Frame, FrameInfo
from p2p_sync.errors import PatchError, PublishError, WeightsFileError
from p2p_sync.runtime.timings import Built, PublishTimings
from p2p_sync.runtime.trainer import Publisher
from p2p_sync.store.streamed import Head, write_head
from p2p_sync.trust.chunks import file_chunk_hashes
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, sign
from p2p_sync.weights.delta import Patch, TensorDelta
from p2p_sync.weights.shards import Box, add_sums, merge_blocks, to_whole
from p2p_sync.weights.statehash import StateDigest, Sums, add
from p2p_sync.weights.tensors import Layout, TensorSet, TensorSpec, layout_fingerprint, layout_of
from p2p_sync.weights.weights_io import header_of

if TYPE_CHECKING:  # torch.distributed.tensor takes ~0.5 s to import: only sharded runs pay it
    from p2p_sync.weights.dtensors import Parts, ShardDiffer

log = logging.getLogger("p2psync.trainer")
T = TypeVar("T")
RankFrames = dict[str, tuple["Box", Frame | None, Sums]]  # per tensor: block, frame, sum moves
Run = Callable[[Coroutine[Any, Any, T]], T]  # runs a coroutine on rank 0's node loop


def is_sharded(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether publishing ``state_dict`` is a collective call (it holds DTensors); served
    weights are asked of their originals (nothing is cast to learn it)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    if dtensor is None:
        return False
    tensors = getattr(state_dict, "tensors", state_dict)
    return any(isinstance(t, dtensor.DTensor) for t in tensors.values())


def rank() -> int:
    """This process's rank (0 outside a torch.distributed job)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class StepPublisher(Publisher):
    """A publisher fed what a sharded trainer's ranks diffed: their coded block deltas.

    In format 1 the ranks' frames are the patch (joined, not decoded) and rank 0 keeps no copy
    of the model: ``prev`` goes after the first version, and anchors and checkpoints are
    written from the store one tensor at a time (``store.streamed``). Formats 2 and 3 code
    against the base, so there rank 0 keeps ``prev`` and moves it by each patch."""

    _joined = False  # the version being stored was joined from the ranks' frames

    def _build_ranks(self, ranks: list[RankFrames]) -> tuple[int, str, Patch | None, list[Built]]:
        """The version from every rank's frames: joined as they are (format 1), or decoded
        into the whole patch when the policy codes against the base (formats 2 and 3)."""
        assert self.digest is not None and self.prev_hash is not None
        version, layout = self.next_version, self.digest.layout
        self.timings, t0 = PublishTimings(version), time.perf_counter()
        self._joined = not self.policy.based
        if not self._joined:
            from p2p_sync.weights.dtensors import assemble

            step, target = assemble(layout, [decode_parts(r, layout) for r in ranks], self.digest)
            step = Patch(step.layout, step.base_hash, step.target_hash, step.deltas, target)
            return self._coded(version, step, {})  # ``_advance`` applies the step to ``prev``
        frames, self._target_digest = join_ranks(layout, ranks, self.digest)
        target = self._target_digest.hash()
        payload = codec.assemble(layout, self.prev_hash, target, frames)
        if self.history.maxlen:
            self.history.append(payload)
        self.timings.encode_s = time.perf_counter() - t0
        built = self._artifacts(version, target.hex(), layout, {}, payload)
        return version, target.hex(), None, built

    def _advance(self, new: TensorSet, step: Patch | None, target: str, owned: bool) -> None:
        """Stored: a joined version lets ``prev`` go (the store holds the head)."""
        if self._joined:
            self.prev, self._moved, self._joined = None, True, False
        super()._advance(new, step, target, owned)

    def _write_weights(self, f: BinaryIO, weights: TensorSet | None, version: int) -> None:
        """Full weights from ``prev``, or without it from the store, a tensor at a time."""
        if weights is not None:
            super()._write_weights(f, weights, version)
        else:
            write_head(self.node.store, f, version)

    def _rebuild_prev(self) -> None:
        """Formats 2 and 3: the copy of the head every publisher keeps. Format 1: none, only
        the head's state and sums, read from the store a tensor at a time; a store that
        cannot give them so is rebuilt as every publisher rebuilds it (``restore`` cuts the
        log where it cannot replay), and the copy let go."""
        if self.policy.based:
            return super()._rebuild_prev()
        state, self.prev, self._moved = self.node.store.state, None, False
        self.prev_hash = self.digest = None
        if state is None:
            return
        try:
            head = Head(self.node.store, state.version)
            for _ in head.tensors():
                pass
        except (PatchError, WeightsFileError) as exc:
            log.warning("v%d not read from the store (%s): rebuilding it", state.version, exc)
            super()._rebuild_prev()
            self.prev = None
            return
        self.prev_hash, self.digest = bytes.fromhex(state.state_hash), head.digest

    def head(self) -> Head:
        """The store's head, for the ranks to diff the next version from."""
        state = self.node.store.state
        assert state is not None
        return Head(self.node.store, state.version)

    def snapshot_path(self) -> Path:
        """A new file in the store's folder for the ranks to write a snapshot into."""
        fd, name = tempfile.mkstemp(prefix=".snapshot-", suffix=".tmp", dir=self.node.store.root)
        os.close(fd)
        return Path(name)

    async def publish_written(self, path: Path, digest: StateDigest) -> list[Manifest]:
        """Publish the snapshot the ranks wrote at ``path`` (v0, format 1), whose sums the
        ranks counted, as the next version; rank 0 never held its weights."""

        def build() -> tuple[int, str, None, list[Built]]:
            version, target = self.next_version, digest.hash().hex()
            self.timings, self._target_digest, self._joined = PublishTimings(version), digest, True
            chunks = file_chunk_hashes(path, self.policy.chunk_size)
            layout = layout_fingerprint(digest.layout).hex()
            m = self._manifest(version, SNAPSHOT, target, layout, None, chunks=chunks)
            return version, target, None, [(m, sign(m, [self.key]), path)]

        return await self._publish(build, {}, False)

    async def publish_ranks(self, ranks: list[RankFrames]) -> list[Manifest]:
        """Publish the ranks' diff (against the last version) as the next version."""
        return await self._publish(lambda: self._build_ranks(ranks), {}, False)


class ShardedPublishing:
    """One rank's side of publishing sharded state dicts; ``publisher`` on rank 0 only."""

    def __init__(self, publisher: StepPublisher | None, group: Any = None) -> None:
        self.publisher, self.group = publisher, group
        self.differ: ShardDiffer | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int:
        """Publish the next version, on every rank at once; every rank gets its number."""
        outcome: Any = None
        try:
            if self.differ is None:
                outcome = self._first(state_dict, run)
            else:
                outcome = self._next(state_dict, run)
        except Exception as exc:  # the other ranks are told, then it is raised here
            outcome = exc
        shared = [outcome if rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        if isinstance(outcome, Exception) or isinstance(shared[0], Exception):
            self.differ = None  # blocks may have moved part-way: the next version starts over
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(shared[0], Exception):
            raise PublishError(f"rank 0 could not publish: {shared[0]}")
        return int(shared[0])

    def _first(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int | None:
        """The first version since start. Format 1: v0 is written by the ranks straight into the
        snapshot's file, a later one is diffed from the store's head (rank 0 holds a block, or
        one tensor, at a time, never the model). Formats 2 and 3: every tensor comes whole to
        rank 0, one at a time, to be diffed against the copy of the head they keep."""
        from p2p_sync.weights.dtensors import ShardDiffer, whole_at

        p = self.publisher
        plain = [None if p is None or p.policy.based else p.next_version == 0]
        dist.broadcast_object_list(plain, src=0, group=self.group)
        self.differ = ShardDiffer(state_dict)
        if plain[0] is not None:  # format 1: no copy of the model on rank 0
            return (
                self._first_written(state_dict, run) if plain[0] else self._seeded(state_dict, run)
            )
        whole = {}
        for name in sorted(state_dict):
            t = whole_at(state_dict[name], 0, self.group)
            if t is not None:
                whole[name] = t
        if p is None:
            return None
        return run(p.publish(whole, owned=True))[0].version

    def _first_written(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int | None:
        """v0 written into its snapshot's file by the ranks, and its digest from their sums."""
        from p2p_sync.weights.dtensors import digest_of, gather_to, partial_sums

        layout = layout_of(state_dict)
        sums = gather_to(partial_sums(state_dict), 0, self.group)
        if self.publisher is None or sums is None:
            write_snapshot(state_dict, None, self.group)  # the other ranks send their blocks
            return None
        path = self.publisher.snapshot_path()
        write_snapshot(state_dict, path, self.group)
        return run(self.publisher.publish_written(path, digest_of(layout, sums)))[0].version

    def _seeded(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int | None:
        """After a restart or a failed version (format 1): every rank's kept blocks become the
        store's head, sent by rank 0 a tensor at a time, and the version is their diff."""
        from p2p_sync.weights.dtensors import seed_blocks

        assert self.differ is not None
        if self.publisher is not None:
            run(self.publisher.spans_done())  # the store is done with the last version
        head = self.publisher.head() if self.publisher is not None else None
        names = [s.name for s in self.differ.layout]
        seed_blocks(self.differ.prev, head.tensors() if head else None, names, 0, self.group)
        return self._next(state_dict, run)

    def _next(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int | None:
        from p2p_sync.weights.dtensors import gather_to

        assert self.differ is not None
        try:
            mine: Any = code_parts(self.differ.step(state_dict))
        except Exception as exc:  # still joins the gather: a rank missing from it hangs all
            mine = exc
        coded = gather_to(mine, 0, self.group)
        if isinstance(mine, Exception):
            raise mine
        if self.publisher is None or coded is None:
            return None
        failed = [(r, c) for r, c in enumerate(coded) if isinstance(c, Exception)]
        if failed:
            raise PublishError(f"rank {failed[0][0]} could not diff its blocks: {failed[0][1]}")
        return run(self.publisher.publish_ranks(coded))[0].version


def write_snapshot(
    state_dict: Mapping[str, torch.Tensor], path: Path | None, group: Any = None
) -> None:
    """The sharded state dict as a safetensors file at ``path`` (rank 0), written a block at
    a time where each block's bytes go; collective: the ranks with no ``path`` send theirs.
    A failed write still lets every rank finish, then raises on rank 0."""
    from p2p_sync.weights.dtensors import blocks_into

    specs = [(n, t.dtype, tuple(t.shape)) for n, t in sorted(state_dict.items())]
    fd, failed = (os.open(path, os.O_WRONLY | os.O_CLOEXEC) if path else None), None
    try:
        at = len(head := header_of(specs))
        if fd is not None:
            os.pwrite(fd, head, 0)
        for name, dtype, shape in specs:
            try:
                blocks_into(state_dict[name], None if failed else fd, at, 0, group)
            except OSError as exc:  # a full disk: the other ranks still send every block
                failed = failed or exc
            at += math.prod(shape) * dtype.itemsize
    finally:
        if fd is not None:
            os.close(fd)
    if failed is not None:
        raise failed


def join_ranks(
    layout: Layout, ranks: list[RankFrames], base: StateDigest
) -> tuple[dict[str, Frame], StateDigest]:
    """The patch's frames from every rank's, and the new version's digest from ``base``
    and the ranks' sum moves. A tensor whose blocks are runs of its flat order (FSDP2's rows,
    a whole tensor) takes its ranks' frames as they are, as the parts of a coding-5 frame;
    a tensor split otherwise (columns) is decoded, merged and coded again."""
    target = StateDigest(layout, dict(base.sums))
    frames = {}
    for spec in layout:
        mine = [r[spec.name] for r in ranks if spec.name in r]
        target.sums[spec.name] = add(target.sums[spec.name], add_sums([m for *_, m in mine]))
        changed = [(box, f) for box, f, _ in mine if f is not None]
        if changed:
            frames[spec.name] = _joined(spec, changed)
    return frames, target


def _joined(spec: TensorSpec, changed: list[tuple[Box, Frame]]) -> Frame:
    """One tensor's frame from its blocks' frames, re-coded only where blocks interleave."""
    runs = [(box.flat_range, f) for box, f in changed]
    if any(r is None for r, _ in runs):
        wholes = [to_whole(spec, box, _decoded(spec, box, f)) for box, f in changed]
        merged = merge_blocks(spec, wholes)
        assert merged is not None  # each frame holds at least one change
        return codec.encode_frame(merged, codec.DEFAULT_LEVEL)
    if len(runs) == 1 and runs[0][0] == (0, spec.numel):
        return runs[0][1]
    return codec.join_parts(sorted(((r[0], r[1], f) for r, f in runs if r), key=lambda p: p[0]))


def _decoded(spec: TensorSpec, box: Box, frame: Frame) -> TensorDelta:
    coding, count, data = frame
    row = FrameInfo(TensorSpec(spec.name, box.shape, spec.dtype), coding, count, 0, len(data))
    return codec.decode_frame(row, memoryview(data))


def code_parts(parts: Parts) -> RankFrames:
    """A rank's block deltas as codec frames: the patch's own parts where rank 0 joins them
    as they are (about the patch's size; raw positions and deltas take ~10 bytes a change)."""
    return {
        name: (box, None if d is None else codec.encode_frame(d.host(), codec.DEFAULT_LEVEL), moved)
        for name, (box, d, moved) in parts.items()
    }


def decode_parts(coded: RankFrames, layout: Layout) -> Parts:
    """A rank's frames back into block deltas (rank 0; the frames are its own ranks')."""
    specs = {s.name: s for s in layout}
    return {
        name: (box, None if f is None else _decoded(specs[name], box, f), moved)
        for name, (box, f, moved) in coded.items()
    }


__all__ = [
    "ShardedPublishing",
    "StepPublisher",
    "code_parts",
    "decode_parts",
    "is_sharded",
    "join_ranks",
    "rank",
]
