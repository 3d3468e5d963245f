"""Coding 5: one tensor's frame as parts, each a base-free frame of a contiguous range.

A sharded trainer's ranks each hold a contiguous range of most tensors (FSDP2's row blocks).
Each rank codes the changes in its range as an ordinary coding-1 or coding-2 frame of a 1-D
tensor of the range's length; the rank that publishes joins them under a small index without
decoding a byte (:func:`join_parts`). A decoder reads the parts in order and shifts their
positions by the range's start (``frames``). See docs/format.md, "Format version 4".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from p2p_sync.codec.limits import PART_CODINGS, PARTS, CodecLimits
from p2p_sync.codec.table import FrameInfo, _check_row
from p2p_sync.errors import CountMismatchError, MalformedPatchError
from p2p_sync.weights.tensors import TensorSpec

_PARTS_HEAD = struct.Struct("<I")  # how many parts
_PART_ROW = struct.Struct("<QQBQQ")  # start, length, coding, count, size

Frame = tuple[int, int, bytes]  # (coding, count, frame bytes)


@dataclass(frozen=True)
class Part:
    """One part of a coding-5 frame: its range starts at ``start`` in the whole tensor;
    ``row`` describes its frame as a 1-D tensor of the range's length, ``data`` holds it."""

    start: int
    row: FrameInfo
    data: memoryview


def join_parts(parts: list[tuple[int, int, Frame]]) -> Frame:
    """A coding-5 frame from ``(start, length, frame)`` per range, in order of ``start``;
    unchanged ranges (coding 0) are left out. Raises ``ValueError`` when nothing changed or
    the ranges overlap (a caller's bug, not bad input)."""
    kept = [(s, n, f) for s, n, f in parts if f[1] > 0]
    if not kept:
        raise ValueError("a coding-5 frame needs at least one changed part")
    for (s, n, _), (t, _, _) in zip(kept, kept[1:]):
        if t < s + n:
            raise ValueError(f"parts overlap or are out of order at {t}")
    for _, _, (coding, _, _) in kept:
        if coding not in PART_CODINGS:
            raise ValueError(f"coding {coding} cannot be a part (only {PART_CODINGS})")
    head = [_PARTS_HEAD.pack(len(kept))]
    head += [_PART_ROW.pack(s, n, f[0], f[1], len(f[2])) for s, n, f in kept]
    count = sum(f[1] for _, _, f in kept)
    return PARTS, count, b"".join(head + [f[2] for _, _, f in kept])


def read_parts(row: FrameInfo, frame: memoryview, limits: CodecLimits) -> list[Part]:
    """The parts of a coding-5 frame, every index field checked: ranges in order, inside the
    tensor, not overlapping; each part's row as a table row would be; counts and sizes adding
    up to the frame's. Nothing is decompressed here."""
    name, numel = row.spec.name, row.spec.numel
    n = _part_count(frame, name, limits)
    at, end, total = _PARTS_HEAD.size + n * _PART_ROW.size, 0, 0
    out = []
    for i in range(n):
        start, length, coding, count, size = _PART_ROW.unpack_from(frame, 4 + i * _PART_ROW.size)
        if start < end or length == 0 or start + length > numel:
            raise MalformedPatchError(
                f"{name}: part {i} [{start}, +{length}) is out of order or outside "
                f"the tensor's {numel} elements"
            )
        spec = TensorSpec(f"{name}[{start}:{start + length}]", (length,), row.spec.dtype)
        if coding not in PART_CODINGS:
            raise MalformedPatchError(f"{spec.name}: coding {coding} cannot be a part")
        _check_row(spec, coding, count, size, limits, 1)
        if at + size > len(frame):
            raise CountMismatchError(f"{spec.name}: part ends past its frame")
        out.append(Part(start, FrameInfo(spec, coding, count, 0, size), frame[at : at + size]))
        at, end, total = at + size, start + length, total + count
    if at != len(frame):
        raise CountMismatchError(f"{name}: {len(frame) - at} bytes after the last part")
    if total != row.count:
        raise CountMismatchError(f"{name}: parts change {total}, table says {row.count}")
    return out


def _part_count(frame: memoryview, name: str, limits: CodecLimits) -> int:
    if len(frame) < _PARTS_HEAD.size:
        raise CountMismatchError(f"{name}: frame ends before its part count")
    (n,) = _PARTS_HEAD.unpack_from(frame)
    if n == 0 or n > limits.max_parts:
        raise MalformedPatchError(f"{name}: {n} parts (1 to {limits.max_parts} allowed)")
    if len(frame) < _PARTS_HEAD.size + n * _PART_ROW.size:
        raise CountMismatchError(f"{name}: frame ends inside its index of {n} parts")
    return n


__all__ = ["Part", "join_parts", "read_parts"]
