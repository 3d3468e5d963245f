"""One tensor's frame: the smallest coding on encode, full validation on decode.

Sparse (coding 1), dense (2) and exponent-class (3) frames; decoding whole or, for large sparse
frames, in blocks of positions so an apply never holds a whole tensor's positions at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from p2p_sync.codec.classed import _classed_streams, _decode_classed
from p2p_sync.codec.classes import Bits, classed_dtype, segmented_dtype
from p2p_sync.codec.compression import _compress, _decompress
from p2p_sync.codec.limits import (
    _CLASSED_HEAD,
    _SPARSE_HEAD,
    _VALUE_HEAD,
    BASED,
    BLOCK,
    CLASSED,
    CLASSED_MIN_SAVING,
    DENSE,
    DENSE_TRY_FRACTION,
    PARTS,
    SEGMENTED,
    SPARSE,
    CodecLimits,
)
from p2p_sync.codec.parts import read_parts
from p2p_sync.codec.positions import (
    _check_position_body,
    _decode_position_body,
    _position_blocks,
    _position_body_size,
    encode_positions,
)
from p2p_sync.codec.segmented import decode_segmented, encode_segmented
from p2p_sync.codec.table import FrameInfo
from p2p_sync.codec.values import (
    _check_size,
    _decode_value_body,
    _value_body_size,
    _value_head,
    decode_values,
    encode_values,
)
from p2p_sync.errors import CountMismatchError, MissingBaseError
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.tensors import TensorSpec, bits_dtype


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def _sparse_streams(delta: TensorDelta) -> list[bytes]:
    pos, d = delta.to_sparse()
    pos_head, pos_body = encode_positions(_np(pos), delta.spec.numel)
    val_head, val_body = encode_values(_np(d))
    return [pos_head + val_head, *pos_body, *val_body]


def _dense_streams(delta: TensorDelta) -> list[bytes]:
    head, body = encode_values(_np(delta.to_dense()))
    return [head, *body]


def encode_frame(
    delta: TensorDelta, level: int, base_bits: Bits | None = None, segmented: bool = False
) -> tuple[int, int, bytes]:
    """(coding, count, frame) for one tensor: the smallest of the codings it may use. Coding 3
    needs the base's bits; without them (or for a dtype with no exponent) it is not tried.
    ``segmented``: a float tensor takes coding 4 (format 3: no zstd, decodable by segment)."""
    return _frames(delta, level, base_bits, segmented)[0]


Frame = tuple[int, int, bytes]


def _frames(
    delta: TensorDelta, level: int, base_bits: Bits | None, segmented: bool = False
) -> tuple[Frame, Frame]:
    """(the smallest frame, the smallest of the version-1 codings): the same when coding 3
    does not win. With ``segmented`` a float tensor takes coding 4 whatever its size: the
    point is a frame the device codes and reads without zstd."""
    count = delta.count
    if segmented and base_bits is not None and segmented_dtype(delta.spec.dtype):
        frame = (SEGMENTED, count, encode_segmented(delta, base_bits))
        return frame, frame
    plain = (SPARSE, count, _compress(_sparse_streams(delta), level))
    if count >= DENSE_TRY_FRACTION * delta.spec.numel:
        dense = _compress(_dense_streams(delta), level)
        if len(dense) < len(plain[2]):
            plain = (DENSE, count, dense)
    if base_bits is not None and classed_dtype(delta.spec.dtype):
        classed = _compress(_classed_streams(delta, base_bits), level)
        if len(classed) <= len(plain[2]) * (1 - CLASSED_MIN_SAVING):
            return (CLASSED, count, classed), plain
    return plain, plain


def _frame_bound(row: FrameInfo) -> int:
    width, n = row.spec.itemsize, row.count
    if row.coding == DENSE:
        return _VALUE_HEAD.size + row.spec.numel * 2 * width
    if row.coding == CLASSED:  # unary bits are at most one per code plus one per element
        return _CLASSED_HEAD + (n + row.spec.numel) // 8 + 1 + n * (8 + 2 * width)
    return _SPARSE_HEAD.size + _VALUE_HEAD.size + n * (2 + 8 + 2 * width)


def _sparse_bodies(raw: memoryview, spec: TensorSpec, n: int) -> tuple[memoryview, int, np.ndarray]:
    """A sparse frame's position body, its escape count and its decoded deltas. Headers
    first, so a wrong count shows as a size mismatch before any body is parsed."""
    name, width, numel = spec.name, spec.itemsize, spec.numel
    head = _SPARSE_HEAD.size + _VALUE_HEAD.size
    if len(raw) < head:
        raise CountMismatchError(f"{name}: frame ends before its headers")
    (pos_esc,) = _SPARSE_HEAD.unpack_from(raw)
    bits, val_esc = _value_head(raw[_SPARSE_HEAD.size :], width, name)
    pos_size = _position_body_size(n, numel, pos_esc)
    _check_size(raw, head + pos_size + _value_body_size(n, width, bits, val_esc), n, name)
    if pos_esc > n or val_esc > n:
        raise CountMismatchError(f"{name}: more escapes than the {n} entries")
    d = _decode_value_body(raw[head + pos_size :], n, width, bits, val_esc, name)
    return raw[head : head + pos_size], pos_esc, d


def _decode_sparse(raw: memoryview, spec: TensorSpec, n: int) -> TensorDelta:
    body, n_esc, d = _sparse_bodies(raw, spec, n)
    pos = _decode_position_body(body, n, spec.numel, n_esc, spec.name)
    return TensorDelta(
        spec, torch.from_numpy(pos), torch.from_numpy(d).view(bits_dtype(spec.dtype))
    )


def decode_frame_blocks(
    row: FrameInfo,
    frame: memoryview,
    base_bits: Bits | None = None,
    block: int | None = None,
    limits: CodecLimits = CodecLimits(),
) -> Iterator[TensorDelta]:
    """:func:`decode_frame` as consecutive deltas of at most ``block`` positions each, for a
    caller that applies them one by one: a sparse frame's positions take 8 bytes per changed
    element (250 MB for the 1.05B-element embedding of a 70B model at 3%, per worker), a
    block's 2 MiB. The whole frame is checked before the first block is given (counts,
    escapes, the last position in range; every part of a coding-5 frame), so a frame that
    fails to decode fails before anything is applied. Other codings come whole. ``block``:
    :data:`BLOCK` when None."""
    if row.coding == PARTS:
        checked = [
            (p, _checked_blocks(p.row, p.data, None, block, limits))
            for p in read_parts(row, frame, limits)
        ]
        for part, blocks in checked:
            yield from (_shifted(row.spec, part.start, d) for d in blocks)
        return
    yield from _checked_blocks(row, frame, base_bits, block, limits)


def _checked_blocks(
    row: FrameInfo,
    frame: memoryview,
    base_bits: Bits | None,
    block: int | None,
    limits: CodecLimits,
) -> Iterator[TensorDelta]:
    """One frame's blocks, the frame checked in full before this returns (a list for the
    codings that decode whole, a generator over checked positions for a large sparse one)."""
    block = block or BLOCK
    if row.coding != SPARSE or row.count <= block:
        return iter([decode_frame(row, frame, base_bits, limits)])
    spec, n = row.spec, row.count
    raw = _decompress(frame, _frame_bound(row), spec.name, limits)
    body, n_esc, d = _sparse_bodies(raw, spec, n)
    _check_position_body(body, n, spec.numel, n_esc, spec.name)
    deltas = torch.from_numpy(d).view(bits_dtype(spec.dtype))
    return (
        TensorDelta(spec, torch.from_numpy(pos), deltas[i : i + pos.size])
        for i, pos in _position_blocks(body, n, spec.numel, n_esc, block)
    )


def _shifted(spec: TensorSpec, start: int, part: TensorDelta) -> TensorDelta:
    """A part's delta in the whole tensor: its positions moved by the range's ``start``
    (a dense part's nonzero entries first taken as positions)."""
    if part.positions is None:
        pos = torch.nonzero(part.deltas).flatten()
        return TensorDelta(spec, pos + start, part.deltas[pos])
    return TensorDelta(spec, part.positions + start, part.deltas)


def _decode_parts(row: FrameInfo, frame: memoryview, limits: CodecLimits) -> TensorDelta:
    """A coding-5 frame whole: its parts' changes, shifted, end to end (sorted, as the
    ranges are in order)."""
    pieces = [
        _shifted(row.spec, p.start, decode_frame(p.row, p.data, None, limits))
        for p in read_parts(row, frame, limits)
    ]
    pos = torch.cat([d.positions for d in pieces if d.positions is not None])
    return TensorDelta(row.spec, pos, torch.cat([d.deltas for d in pieces]))


def _decode_dense(raw: memoryview, spec: TensorSpec, count: int) -> TensorDelta:
    d = decode_values(raw, spec.numel, spec.itemsize, spec.name)
    nonzero = int(np.count_nonzero(d))
    if nonzero != count:
        raise CountMismatchError(f"{spec.name}: dense frame changes {nonzero}, table says {count}")
    return TensorDelta(spec, None, torch.from_numpy(d).view(bits_dtype(spec.dtype)))


def decode_frame(
    row: FrameInfo,
    frame: memoryview,
    base_bits: Bits | None = None,
    limits: CodecLimits = CodecLimits(),
) -> TensorDelta:
    """Decode and fully validate one tensor's frame (codings 3 and 4 need the base's bits)."""
    if row.coding in BASED and base_bits is None:
        raise MissingBaseError(f"{row.spec.name}: exponent-class frame needs the base weights")
    if row.coding == SEGMENTED:
        assert base_bits is not None
        return decode_segmented(frame, row.spec, row.count, base_bits)
    if row.coding == PARTS:
        return _decode_parts(row, frame, limits)
    raw = _decompress(frame, _frame_bound(row), row.spec.name, limits)
    if row.coding == CLASSED:
        assert base_bits is not None
        return _decode_classed(raw, row.spec, row.count, base_bits)
    if row.coding == DENSE:
        return _decode_dense(raw, row.spec, row.count)
    return _decode_sparse(raw, row.spec, row.count)
