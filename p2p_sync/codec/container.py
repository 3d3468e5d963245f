"""Whole patches: encode and decode, the base check coding 3 needs, base-free checking.

The entry points callers use; frames are coded and decoded in parallel threads, one per
tensor, and the header and table come from :mod:`p2p_sync.codec.table`.
"""

from __future__ import annotations

import functools

import torch

from p2p_sync.codec.classed import _classed_head, _coded_ranks
from p2p_sync.codec.classes import Bits, classed_dtype
from p2p_sync.codec.compression import _decompress
from p2p_sync.codec.frames import Frame, _frame_bound, _frames, decode_frame
from p2p_sync.codec.limits import BASED, CLASSED, DEFAULT_LEVEL, SEGMENTED, UNCHANGED, CodecLimits
from p2p_sync.codec.segmented import read_codes
from p2p_sync.codec.table import FrameInfo, Frames, _file_size, _join, _table, read_header
from p2p_sync.errors import BaseMismatchError, LayoutMismatchError, MissingBaseError
from p2p_sync.weights.delta import Patch, TensorDelta
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.tensors import Layout, TensorSet, TensorSpec, flat_bits, layout_of
from p2p_sync.weights.threads import map_workers


def _check_base(base: TensorSet, layout: Layout, want: bytes, known: bytes | None) -> None:
    """Coding 3 is only meaningful against the exact base: the classes come from its bits.
    ``known`` is the caller's record of the base's state hash (saves hashing it again)."""
    if layout_of(base) != layout:
        raise LayoutMismatchError("base weights differ from the patch's names, shapes or dtypes")
    have = known if known is not None else state_hash(base)
    if have != want:
        raise BaseMismatchError(
            f"base weights hash to {have.hex()}, patch was made for {want.hex()}"
        )


def scan_view(t: torch.Tensor) -> Bits:
    """A base tensor's bit patterns where the class scans read them: a numpy view on the host
    (no copy), the tensor itself on a GPU (the scans then run there: no O(model) copy)."""
    flat = flat_bits(t.detach()).contiguous()
    return flat.numpy() if flat.device.type == "cpu" else flat


def _base_bits(base: TensorSet | None, spec: TensorSpec) -> Bits | None:
    if base is None or not classed_dtype(spec.dtype):
        return None
    return scan_view(base[spec.name])


def _pair(
    level: int, base: TensorSet | None, segmented: bool, delta: TensorDelta
) -> tuple[Frame, Frame]:
    """One tensor's (smallest frame, smallest version-1 frame)."""
    return _frames(delta, level, _base_bits(base, delta.spec), segmented)


def encode(
    patch: Patch,
    level: int = DEFAULT_LEVEL,
    workers: int = 1,
    base: TensorSet | None = None,
    base_hash: bytes | None = None,
    segmented: bool = False,
) -> bytes:
    """Serialize ``patch``; with ``workers > 1`` tensor frames are coded in parallel. With
    ``base`` (the weights it applies to, read only) float tensors may take the exponent-class
    coding (format 2), with ``segmented`` too the segmented one (format 3: no zstd, coded
    where the base lives); without a base the file is format 1. ``base_hash``: the caller's
    record of ``base``'s state hash, if it has one."""
    patch.validate()
    if base is not None:
        _check_base(base, patch.layout, patch.base_hash, base_hash)
    changed = [patch.deltas[s.name] for s in patch.layout if s.name in patch.deltas]
    pairs = map_workers(functools.partial(_pair, level, base, segmented), changed, workers)
    frames = {d.spec.name: p[0] for d, p in zip(changed, pairs)}
    table = _table(patch.layout, frames, level)
    if any(p[0] is not p[1] for p in pairs):
        # coding 3 won frame by frame, but the row table compresses differently: by a few
        # bytes, a file of version-1 frames can still be the smaller one, and then it is the
        # one sent (sizes compared before either file is joined: a patch is copied once)
        plain = {d.spec.name: p[1] for d, p in zip(changed, pairs)}
        plain_table = _table(patch.layout, plain, level)
        if _file_size(plain, plain_table) < _file_size(frames, table):
            frames, table = plain, plain_table
    return _join(patch.layout, patch.base_hash, patch.target_hash, frames, table)


def assemble(
    layout: Layout,
    base_hash: bytes,
    target_hash: bytes,
    frames: Frames,
    level: int = DEFAULT_LEVEL,
) -> bytes:
    """A patch file from frames made by :func:`encode_frame` (tensors not in ``frames`` are
    unchanged). For builders that code each tensor as soon as it is diffed, without ever
    holding the whole decoded patch: the bytes equal :func:`encode`'s for the same frames."""
    return _join(layout, base_hash, target_hash, frames, _table(layout, frames, level))


def _decode_rows(
    data: memoryview,
    rows: list[FrameInfo],
    workers: int,
    base: TensorSet | None,
    limits: CodecLimits,
) -> list[TensorDelta]:
    def one(row: FrameInfo) -> TensorDelta:
        bits = _base_bits(base, row.spec) if row.coding in BASED else None
        return decode_frame(row, data[row.offset : row.offset + row.size], bits, limits)

    return map_workers(one, rows, workers)


def check_without_base(data: bytes | memoryview, limits: CodecLimits = CodecLimits()) -> list[str]:
    """Verify everything in a patch that needs no base: the header, the table, every frame's
    zstd checksum and structure, sparse and dense frames in full, the position codes of
    exponent-class frames (coding 3) and every stream of segmented ones (coding 4). Returns
    the names of the class-coded frames: which elements their codes select (and coding 3's
    values) can only be checked against the base's bits."""
    data = memoryview(data)
    need: list[str] = []
    for row in read_header(data, limits).rows:
        frame = data[row.offset : row.offset + row.size]
        if row.coding == UNCHANGED:
            continue
        if row.coding == SEGMENTED:
            read_codes(frame, row.spec, row.count, None)
            need.append(row.spec.name)
            continue
        if row.coding != CLASSED:
            decode_frame(row, frame, None, limits)
            continue
        raw = _decompress(frame, _frame_bound(row), row.spec.name, limits)
        _coded_ranks(raw, _classed_head(raw, row.spec), row.spec.numel, row.spec.name)
        need.append(row.spec.name)
    return need


def decode(
    data: bytes | memoryview,
    limits: CodecLimits = CodecLimits(),
    workers: int = 1,
    base: TensorSet | None = None,
    base_hash: bytes | None = None,
) -> Patch:
    """Parse a patch, validating every field and frame before returning it.

    A patch with exponent-class frames (coding 3) decodes only against its base: pass the
    weights it applies to as ``base`` (read, never written); their layout and state hash are
    checked first (``base_hash``: the caller's record of its state hash, saves that pass).
    Without such frames ``base`` is not needed and not looked at.
    """
    data = memoryview(data)
    info = read_header(data, limits)
    changed = [r for r in info.rows if r.coding != UNCHANGED]
    if any(r.coding in BASED for r in changed):
        if base is None:
            raise MissingBaseError("patch has exponent-class frames: decoding needs its base")
        _check_base(base, info.layout, info.base_hash, base_hash)
    else:
        base = None
    deltas = _decode_rows(data, changed, workers, base, limits)
    return Patch(info.layout, info.base_hash, info.target_hash, {d.spec.name: d for d in deltas})
