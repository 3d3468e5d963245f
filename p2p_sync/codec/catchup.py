"""Merged catch-up patches built from encoded 1-step patches, one tensor at a time.

A catch-up patch ``v - s -> v`` (``versions.PublishPolicy.catchup_spans``) lets a peer that
fell ``s`` versions behind fetch one patch instead of ``s``. Merging decoded patches holds
every step's positions and deltas at once, then the merge of them all: on a 0.95B model, a
span of 4 steps at 3.3% density took 14.8 s and lifted the trainer's peak RSS from 1.7x to
2.5x the model; a span of 16 would hold ~16 patches decoded. Here each tensor is merged on
its own: its frame is decoded from every step, the parts are summed
(:func:`p2p_sync.weights.merge.merge_tensor`), and the result is coded as one frame before the next
tensor is touched, so memory is one tensor's changes per worker plus the encoded frames. The
file equals ``codec.encode(patch.merge([codec.decode(s) for s in steps]))`` byte for byte.

Steps must be version-1 files (the trainer keeps its history so: exponent-class frames need
a base the history does not have) and must chain: each one's base is the previous one's
target.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from p2p_sync import codec
from p2p_sync.errors import ChainBrokenError, LayoutMismatchError, MissingBaseError
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.merge import merge_concatenated, merge_tensor
from p2p_sync.weights.tensors import TensorSpec, bits_dtype
from p2p_sync.weights.threads import map_workers

# Codings whose blocks come sparse (a coding-5 frame's dense parts too): merged block by block.
_SPARSE_BLOCKS = (codec.SPARSE, codec.PARTS)


def merge_steps(
    steps: Sequence[bytes], workers: int = 1, level: int = codec.DEFAULT_LEVEL
) -> bytes:
    """One patch file equal to applying ``steps`` (encoded patches) in order."""
    if not steps:
        raise ValueError("merge_steps needs at least one patch")
    infos = [codec.read_header(s) for s in steps]
    _check_chain(infos)
    rows = [{r.spec.name: r for r in info.rows if r.coding != codec.UNCHANGED} for info in infos]
    views = [memoryview(s) for s in steps]

    def one(spec: TensorSpec) -> tuple[str, codec.Frame] | None:
        found = [(v, row) for v, by_name in zip(views, rows) if (row := by_name.get(spec.name))]
        if len(found) > 1 and all(row.coding in _SPARSE_BLOCKS for _, row in found):
            merged = _merge_sparse(spec, found)
        else:
            parts = [
                codec.decode_frame(row, v[row.offset : row.offset + row.size]) for v, row in found
            ]
            merged = merge_tensor(spec, parts) if parts else None
        return None if merged is None else (spec.name, codec.encode_frame(merged, level))

    frames = dict(f for f in map_workers(one, list(infos[0].layout), workers) if f is not None)
    return codec.assemble(infos[0].layout, infos[0].base_hash, infos[-1].target_hash, frames, level)


def _merge_sparse(
    spec: TensorSpec, found: list[tuple[memoryview, codec.FrameInfo]]
) -> TensorDelta | None:
    """Sparse frames decoded a block at a time straight into one buffer, end to end, then
    summed (:func:`p2p_sync.weights.merge.merge_concatenated`): each step's changes are held once,
    where decoding them and concatenating held them twice (a 1B model's 16-step span peaked
    at 1.28x the model in the merge alone)."""
    counts = [row.count for _, row in found]
    starts = np.cumsum([0, *counts], dtype=np.int64)
    pos = torch.empty(int(starts[-1]), dtype=torch.int64)
    dels = torch.empty(int(starts[-1]), dtype=bits_dtype(spec.dtype))
    for (view, row), at, end in zip(found, starts, starts[1:]):
        frame = view[row.offset : row.offset + row.size]
        for block in codec.decode_frame_blocks(row, frame):
            assert block.positions is not None  # a sparse frame's blocks are sparse
            n = block.positions.numel()
            pos[at : at + n], dels[at : at + n] = block.positions, block.deltas
            at += n
        if at != end:  # the decoder checks counts first: this would be a bug, not bad input
            raise AssertionError(f"{spec.name}: decoded {at - end + row.count} of {row.count}")
    return merge_concatenated(spec, pos, dels, starts)


def _check_chain(infos: Sequence[codec.PatchInfo]) -> None:
    for prev, nxt in zip(infos, infos[1:]):
        if nxt.fingerprint != infos[0].fingerprint:
            raise LayoutMismatchError("patches to merge have different tensor layouts")
        if prev.target_hash != nxt.base_hash:
            raise ChainBrokenError(
                f"patch with base {nxt.base_hash.hex()} does not follow "
                f"one with target {prev.target_hash.hex()}"
            )
    if any(r.coding in codec.BASED for info in infos for r in info.rows):
        raise MissingBaseError("catch-up merges take version-1 patches (no exponent classes)")
