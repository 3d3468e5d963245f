"""The patch wire format. This docstring is the specification; the code follows it.

Format version 1
================

All integers are little-endian. ``u8/u16/u32/u64`` are unsigned, ``iN`` signed two's complement.
A patch file is::

    Header  Table  Frame*

Header (72 bytes)
-----------------
=====  ====  =================================================================
off    size  field
=====  ====  =================================================================
0      8     magic ``b"P2PPATCH"``
8      2     format version, u16 (this spec: 1; a decoder refuses others)
10     2     flags, u16, must be 0 (reserved)
12     4     tensor count T, u32 (rows in the table: every tensor of the layout)
16     4     table size, u32 (bytes of the compressed table that follows)
20     4     table raw size, u32 (bytes of the table once decompressed)
24     16    layout fingerprint: XXH3-128 of the layout (``tensors.layout_fingerprint``)
40     16    base state hash: XXH3-128 of the weights the patch applies to
56     16    target state hash: XXH3-128 of the weights it produces
=====  ====  =================================================================

Table
-----
One zstd frame (with content size and checksum) holding T rows, in strictly increasing order of
the names' UTF-8 bytes. The layout the rows describe must hash to the header's fingerprint. ::

    Row := name_len u16 | name utf-8[name_len] | dtype u8 | ndim u8 | dims u64[ndim]
           | coding u8 | count u64 | frame_size u64

``dtype`` is a code from ``tensors.DTYPE_CODES``. ``coding`` is 0 (unchanged: count and
frame_size are 0, no frame), 1 (sparse) or 2 (dense); codes 3-255 are reserved for later
coders (the planned exponent-conditioned position coder takes 3 under format version 2).
``count`` is the number of elements whose bit pattern changes.

Frames
------
For each row with coding != 0, in table order: one zstd frame of exactly ``frame_size`` bytes,
written with content size and checksum. The file ends right after the last frame.

Every element of a tensor of dtype width W bytes is treated as a W-byte integer bit pattern.
Its *delta* is ``d = (new - old) mod 2^(8W)`` read as a signed W-byte integer (iW); applying it
is ``old + d mod 2^(8W)``. Exact integer arithmetic: no floating-point rounding anywhere.

**Value coding** (codes n deltas d_0..d_{n-1}) has a 5-byte header and a body::

    value header := b u8 | E_v u32
    value body   := packed values | escapes iW[E_v]

``b`` is the stored width in bits, one of 4, 8, 16, 32, 64, with b <= 8W. Each delta is stored as
a b-bit two's complement integer p_i. For b = 4, values are packed two to a byte, p_0 in the low
nibble of byte 0, p_1 in its high nibble, and so on; for odd n the last high nibble is 0 (packed
size ceil(n/2)). For b >= 8, values are split into b/8 byte planes of n bytes each: plane k holds
byte k (little-endian) of every p_i. If b == 8W, p_i = d_i and E_v = 0. If b < 8W, the marker
M = -2^(b-1) is reserved: a delta with -2^(b-1) < d_i < 2^(b-1) is stored as p_i = d_i; any
other is stored as M and appended, at full width, to ``escapes``, in order. E_v equals the
number of markers.

**Position coding** (codes the sorted, distinct flat row-major positions P_0 < ... < P_{n-1})::

    position header := E_p u32
    position body   := gap_lo u8[n] | gap_hi u8[n] | pos_escapes uE[E_p]

Gaps are g_0 = P_0 and g_i = P_i - P_{i-1} - 1. A gap below 0xFFFF is stored as the u16
``gap_lo | gap_hi << 8``; a larger one as 0xFFFF and appended to ``pos_escapes`` (E bytes each:
4 when the tensor has at most 2^32 elements, else 8). E_p equals the number of 0xFFFF markers.
Every P_i must be below the tensor's element count.

**Sparse frame** (coding 1), n = count::

    position header | value header | position body | value body

**Dense frame** (coding 2), one delta per element (n = element count, zeros included); the
number of non-zero deltas must equal ``count``::

    value header | value body

Headers come first so that the exact decompressed size of a frame follows from its row and
headers; a frame of any other size is refused before its body is parsed. (An encoder ends a zstd
block after each stream, so each gets its own entropy tables; a decoder needs no knowledge of
this.)

Why this shape: positions and values are separate byte planes so zstd's order-0 entropy stage
sees homogeneous symbols (gap low bytes are near-geometric, gap high bytes are nearly all zero,
value deltas are mostly +-1, so 4 bits plus escapes usually win); one independent frame per
tensor lets encode and decode run in parallel. An encoder writes the dense frame when it is
smaller than the sparse one.

Room to grow: format version 2 is reserved for a position coder that conditions on the base
value's exponent (small-magnitude weights change more often; the receiver can recompute the
exponent from its base, measured at 146x vs 106x at 1.4% density). It will take coding code 3,
so version-1 frames stay decodable by the same decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from p2p_sync.errors import (
    BadMagicError,
    CorruptFrameError,
    CountMismatchError,
    IndexOutOfRangeError,
    MalformedPatchError,
    TrailingDataError,
    TruncatedPatchError,
    UnsupportedFormatError,
)
from p2p_sync.patch import Patch, TensorDelta
from p2p_sync.tensors import DTYPE_CODES, DTYPES_BY_CODE, TensorSpec, bits_dtype, layout_fingerprint

MAGIC = b"P2PPATCH"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})
_HEADER = struct.Struct("<8sHHIII16s16s16s")
HEADER_SIZE = _HEADER.size  # 72

UNCHANGED, SPARSE, DENSE = 0, 1, 2
_ROW_HEAD = struct.Struct("<H")
_ROW_TYPE = struct.Struct("<BB")
_ROW_TAIL = struct.Struct("<BQQ")
_VALUE_HEAD = struct.Struct("<BI")
_SPARSE_HEAD = struct.Struct("<I")
VALUE_BITS = (4, 8, 16, 32, 64)
_GAP_ESCAPE = 0xFFFF

# zstd level: with one block per stream the entropy stage does the work, and level 1 compressed
# these streams as well as levels 3-9 in our measurements, at the highest speed.
DEFAULT_LEVEL = 1

# Try the dense coding too once this fraction of a tensor changes: on the built-in workload
# dense first won at 15% changed, so below 1/8 the second encode would be wasted time.
DENSE_TRY_FRACTION = 1 / 8


@dataclass(frozen=True)
class CodecLimits:
    """Every bound the decoder enforces, so a hostile file cannot exhaust memory or time."""

    max_tensors: int = 1_000_000
    max_table_bytes: int = 256 * 2**20
    max_ndim: int = 32
    max_tensor_elements: int = 2**40


@dataclass(frozen=True)
class FrameInfo:
    """One table row: a tensor, how it is coded, how many elements change, where its frame is."""

    spec: TensorSpec
    coding: int
    count: int
    offset: int
    size: int


@dataclass(frozen=True)
class PatchInfo:
    """Everything the header and table say, without decoding any frame (for ``inspect``)."""

    version: int
    fingerprint: bytes
    base_hash: bytes
    target_hash: bytes
    rows: tuple[FrameInfo, ...]
    total_size: int

    @property
    def layout(self) -> tuple[TensorSpec, ...]:
        return tuple(r.spec for r in self.rows)

    @property
    def dense_bytes(self) -> int:
        return sum(r.spec.nbytes for r in self.rows)

    @property
    def changed(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def numel(self) -> int:
        return sum(r.spec.numel for r in self.rows)

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def bits_per_changed(self) -> float:
        return 8 * self.total_size / self.changed if self.changed else float("inf")

    @property
    def ratio(self) -> float:
        """Dense size over patch size: how many times smaller than a full push."""
        return self.dense_bytes / self.total_size


# ---------------------------------------------------------------- value section


def _int_dtype(width: int) -> np.dtype:
    return np.dtype(f"<i{width}")


def _planes(values: np.ndarray) -> bytes:
    """Byte planes of little-endian integers: plane k = byte k of every value."""
    width = values.dtype.itemsize
    if width == 1:
        return values.tobytes()
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, width).T).tobytes()


def _unplanes(buf: memoryview, n: int, width: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=n * width)
    if width == 1:
        return raw.view(np.int8).copy()
    return raw.reshape(width, n).T.copy().view(_int_dtype(width)).reshape(n)  # copy: writable


def _nibbles(values: np.ndarray) -> bytes:
    """Pack values in [-8, 7] two to a byte, the first in the low nibble."""
    u = (values & 0xF).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    return (u[0::2] | (u[1::2] << 4)).tobytes()


# Byte -> its two sign-extended nibbles (low first) as one 2-byte entry: one 1-D gather
# decodes two values.
_NIBBLE_TABLE = (
    np.array([[((b & 0xF) ^ 8) - 8, ((b >> 4) ^ 8) - 8] for b in range(256)], dtype=np.int8)
    .view(np.uint16)
    .reshape(256)
)


def _unnibbles(buf: memoryview, n: int, name: str) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=(n + 1) // 2)
    out = _NIBBLE_TABLE[raw].view(np.int8)
    if n % 2 and out[n]:
        raise MalformedPatchError(f"{name}: padding nibble is not zero")
    return out[:n]


def _packed_size(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _pack(values: np.ndarray, bits: int) -> bytes:
    if bits == 4:
        return _nibbles(values)
    return _planes(values.astype(_int_dtype(bits // 8), copy=False))


def _unpack(buf: memoryview, n: int, bits: int, name: str) -> np.ndarray:
    if bits == 4:
        return _unnibbles(buf, n, name)
    return _unplanes(buf, n, bits // 8)


def _fits(d: np.ndarray, bits: int) -> np.ndarray:
    """-2^(b-1) < d < 2^(b-1), in one add and one compare: shift the range to start at 0 with
    wrapping arithmetic, then compare as unsigned (out-of-range values wrap far above)."""
    bias = (1 << (bits - 1)) - 1
    shifted = (d + d.dtype.type(bias)).view(f"<u{d.dtype.itemsize}")
    return shifted <= 2 * bias


def _choose_bits(d: np.ndarray, width: int) -> int:
    """The stored width (bits) that minimises raw bytes; ties go to the narrower width."""
    full = 8 * width
    best, best_cost = full, d.size * width
    for bits in VALUE_BITS:
        if bits >= full:
            break
        escapes = int(d.size - np.count_nonzero(_fits(d, bits)))
        cost = _packed_size(d.size, bits) + escapes * width
        if cost < best_cost:
            best, best_cost = bits, cost
    return best


def encode_values(d: np.ndarray) -> tuple[bytes, list[bytes]]:
    """Value header ``b | E_v`` and body streams (packed values, escapes) for deltas ``d``."""
    width = d.dtype.itemsize
    bits = _choose_bits(d, width)
    if bits == 8 * width:
        return _VALUE_HEAD.pack(bits, 0), [_pack(d, bits)]
    fits = _fits(d, bits)
    primary = np.where(fits, d, -(1 << (bits - 1)))
    escapes = d[~fits].astype(_int_dtype(width))
    return _VALUE_HEAD.pack(bits, escapes.size), [_pack(primary, bits), escapes.tobytes()]


def _value_head(buf: memoryview, width: int, name: str) -> tuple[int, int]:
    if len(buf) < _VALUE_HEAD.size:
        raise CountMismatchError(f"{name}: frame ends before its value header")
    bits, escapes = _VALUE_HEAD.unpack_from(buf)
    if bits not in VALUE_BITS or bits > 8 * width or (bits == 8 * width and escapes):
        raise MalformedPatchError(f"{name}: value width {bits} bits invalid for {width}-byte data")
    return bits, escapes


def _value_body_size(n: int, width: int, bits: int, n_esc: int) -> int:
    return _packed_size(n, bits) + n_esc * width


def _decode_value_body(
    body: memoryview, n: int, width: int, bits: int, n_esc: int, name: str
) -> np.ndarray:
    primary = _unpack(body, n, bits, name)
    if bits == 8 * width:
        return primary
    out = primary.astype(_int_dtype(width))
    marks = np.flatnonzero(primary == -(1 << (bits - 1)))
    if marks.size != n_esc:
        raise CountMismatchError(f"{name}: {marks.size} value escape markers, header says {n_esc}")
    out[marks] = np.frombuffer(body, _int_dtype(width), n_esc, _packed_size(n, bits))
    return out


def _check_size(buf: memoryview, expected: int, n: int, name: str) -> None:
    if len(buf) != expected:
        raise CountMismatchError(
            f"{name}: frame holds {len(buf)} bytes, {n} entries need {expected}"
        )


def decode_values(buf: memoryview, n: int, width: int, name: str) -> np.ndarray:
    """Inverse of :func:`encode_values`: ``buf`` is the header followed by exactly the body."""
    bits, n_esc = _value_head(buf, width, name)
    _check_size(buf, _VALUE_HEAD.size + _value_body_size(n, width, bits, n_esc), n, name)
    return _decode_value_body(buf[_VALUE_HEAD.size :], n, width, bits, n_esc, name)


# ---------------------------------------------------------------- positions


def _escape_width(numel: int) -> int:
    return 4 if numel <= 2**32 else 8


def encode_positions(pos: np.ndarray, numel: int) -> tuple[bytes, list[bytes]]:
    """Position header ``E_p`` and body streams (gap_lo, gap_hi, pos_escapes)."""
    gaps = np.diff(pos, prepend=-1) - 1
    esc = gaps >= _GAP_ESCAPE
    g16 = np.where(esc, _GAP_ESCAPE, gaps).astype("<u2")
    escapes = gaps[esc].astype(f"<u{_escape_width(numel)}")
    planes = _planes(g16)
    return _SPARSE_HEAD.pack(escapes.size), [
        planes[: pos.size],
        planes[pos.size :],
        escapes.tobytes(),
    ]


def _position_body_size(n: int, numel: int, n_esc: int) -> int:
    return 2 * n + _escape_width(numel) * n_esc


def _decode_position_body(
    body: memoryview, n: int, numel: int, n_esc: int, name: str
) -> np.ndarray:
    raw = np.frombuffer(body, np.uint8, 2 * n)
    gaps = raw[:n].astype(np.int64) | (raw[n:].astype(np.int64) << 8)
    marks = np.flatnonzero(gaps == _GAP_ESCAPE)
    if marks.size != n_esc:
        raise CountMismatchError(f"{name}: {marks.size} gap escape markers, header says {n_esc}")
    big = np.frombuffer(body, f"<u{_escape_width(numel)}", n_esc, 2 * n)
    if n_esc and int(big.max()) >= numel:
        raise IndexOutOfRangeError(f"{name}: a position gap exceeds the tensor's {numel} elements")
    gaps[marks] = big.astype(np.int64)
    gaps += 1
    pos = np.cumsum(gaps, out=gaps)
    pos -= 1
    if n and int(pos[-1]) >= numel:
        raise IndexOutOfRangeError(
            f"{name}: position {int(pos[-1])} outside a tensor of {numel} elements"
        )
    return pos


def decode_positions(buf: memoryview, n: int, numel: int, name: str) -> np.ndarray:
    """Inverse of :func:`encode_positions`: ``buf`` is the header followed by exactly the body."""
    if len(buf) < _SPARSE_HEAD.size:
        raise CountMismatchError(f"{name}: frame ends before its position header")
    (n_esc,) = _SPARSE_HEAD.unpack_from(buf)
    _check_size(buf, _SPARSE_HEAD.size + _position_body_size(n, numel, n_esc), n, name)
    return _decode_position_body(buf[_SPARSE_HEAD.size :], n, numel, n_esc, name)


# ---------------------------------------------------------------- frames


def _compress(streams: list[bytes], level: int) -> bytes:
    """One zstd frame; each stream ends a block, so it gets its own entropy tables."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    size = sum(len(s) for s in streams)
    obj = cctx.compressobj(size=size)
    out = []
    for stream in streams:
        if stream:
            out.append(obj.compress(stream))
            out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(obj.flush())
    return b"".join(out)


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


def encode_frame(delta: TensorDelta, level: int) -> tuple[int, int, bytes]:
    """(coding, count, frame) for one tensor: the smaller of the sparse and dense codings."""
    count = delta.count
    best = (SPARSE, _compress(_sparse_streams(delta), level))
    if count >= DENSE_TRY_FRACTION * delta.spec.numel:
        dense = _compress(_dense_streams(delta), level)
        if len(dense) < len(best[1]):
            best = (DENSE, dense)
    return best[0], count, best[1]


def _decompress(frame: memoryview, bound: int, name: str) -> memoryview:
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CorruptFrameError(f"{name}: not a zstd frame ({exc})") from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) or size > bound:
        raise MalformedPatchError(f"{name}: frame declares {size} bytes, at most {bound} possible")
    try:
        return memoryview(zstandard.ZstdDecompressor().decompress(frame, max_output_size=size))
    except zstandard.ZstdError as exc:
        raise CorruptFrameError(f"{name}: frame is corrupt ({exc})") from None


def _frame_bound(row: FrameInfo) -> int:
    width, n = row.spec.itemsize, row.count
    if row.coding == DENSE:
        return _VALUE_HEAD.size + row.spec.numel * 2 * width
    return _SPARSE_HEAD.size + _VALUE_HEAD.size + n * (2 + 8 + 2 * width)


def _decode_sparse(raw: memoryview, spec: TensorSpec, n: int) -> TensorDelta:
    """Headers first, so a wrong count shows as a size mismatch before any body is parsed."""
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
    pos = _decode_position_body(raw[head : head + pos_size], n, numel, pos_esc, name)
    d = _decode_value_body(raw[head + pos_size :], n, width, bits, val_esc, name)
    return TensorDelta(
        spec, torch.from_numpy(pos), torch.from_numpy(d).view(bits_dtype(spec.dtype))
    )


def _decode_dense(raw: memoryview, spec: TensorSpec, count: int) -> TensorDelta:
    d = decode_values(raw, spec.numel, spec.itemsize, spec.name)
    nonzero = int(np.count_nonzero(d))
    if nonzero != count:
        raise CountMismatchError(f"{spec.name}: dense frame changes {nonzero}, table says {count}")
    return TensorDelta(spec, None, torch.from_numpy(d).view(bits_dtype(spec.dtype)))


def decode_frame(row: FrameInfo, frame: memoryview) -> TensorDelta:
    """Decode and fully validate one tensor's frame."""
    raw = _decompress(frame, _frame_bound(row), row.spec.name)
    if row.coding == DENSE:
        return _decode_dense(raw, row.spec, row.count)
    return _decode_sparse(raw, row.spec, row.count)


# ---------------------------------------------------------------- header and table


def _row_bytes(spec: TensorSpec, coding: int, count: int, size: int) -> bytes:
    name = spec.name.encode("utf-8")
    return b"".join(
        (
            _ROW_HEAD.pack(len(name)),
            name,
            _ROW_TYPE.pack(DTYPE_CODES[spec.dtype], len(spec.shape)),
            struct.pack(f"<{len(spec.shape)}Q", *spec.shape),
            _ROW_TAIL.pack(coding, count, size),
        )
    )


def encode(patch: Patch, level: int = DEFAULT_LEVEL, workers: int = 1) -> bytes:
    """Serialize ``patch``; with ``workers > 1`` tensor frames are compressed in parallel."""
    patch.validate()
    changed = [patch.deltas[s.name] for s in patch.layout if s.name in patch.deltas]
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            frames = list(pool.map(lambda d: encode_frame(d, level), changed))
    else:
        frames = [encode_frame(d, level) for d in changed]
    by_name = {d.spec.name: f for d, f in zip(changed, frames)}
    rows = []
    for spec in patch.layout:
        coding, count, frame = by_name.get(spec.name, (UNCHANGED, 0, b""))
        rows.append(_row_bytes(spec, coding, count, len(frame)))
    table_raw = b"".join(rows)
    table = _compress([table_raw], level)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, len(patch.layout), len(table), len(table_raw),
        patch.fingerprint, patch.base_hash, patch.target_hash,
    )  # fmt: skip
    return b"".join([header, table, *(by_name[d.spec.name][2] for d in changed)])


class _Reader:
    """Bounds-checked cursor over the decompressed table."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.off = buf, 0

    def take(self, fmt: struct.Struct) -> tuple:
        if self.off + fmt.size > len(self.buf):
            raise MalformedPatchError("tensor table ends in the middle of a row")
        out = fmt.unpack_from(self.buf, self.off)
        self.off += fmt.size
        return out

    def take_bytes(self, n: int) -> bytes:
        if self.off + n > len(self.buf):
            raise MalformedPatchError("tensor table ends in the middle of a row")
        out = self.buf[self.off : self.off + n]
        self.off += n
        return out


def _parse_row(reader: _Reader, limits: CodecLimits) -> tuple[TensorSpec, int, int, int]:
    (name_len,) = reader.take(_ROW_HEAD)
    try:
        name = reader.take_bytes(name_len).decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPatchError("tensor name is not valid UTF-8") from None
    code, ndim = reader.take(_ROW_TYPE)
    if code not in DTYPES_BY_CODE:
        raise UnsupportedFormatError(f"{name}: unknown dtype code {code}")
    if ndim > limits.max_ndim:
        raise MalformedPatchError(f"{name}: {ndim} dimensions, limit is {limits.max_ndim}")
    shape = reader.take(struct.Struct(f"<{ndim}Q"))
    coding, count, size = reader.take(_ROW_TAIL)
    return TensorSpec(name, tuple(shape), DTYPES_BY_CODE[code]), coding, count, size


def _check_row(spec: TensorSpec, coding: int, count: int, size: int, limits: CodecLimits) -> None:
    if spec.numel > limits.max_tensor_elements:
        raise MalformedPatchError(f"{spec.name}: {spec.numel} elements exceed the limit")
    if coding not in (UNCHANGED, SPARSE, DENSE):
        raise UnsupportedFormatError(f"{spec.name}: unknown coding {coding}")
    if count > spec.numel:
        raise CountMismatchError(f"{spec.name}: {count} changes in {spec.numel} elements")
    if (coding == UNCHANGED) != (count == 0) or (coding == UNCHANGED) != (size == 0):
        raise CountMismatchError(f"{spec.name}: coding {coding} with count {count}, size {size}")


def _read_table(data: memoryview, n: int, zsize: int, rawsize: int, limits: CodecLimits) -> bytes:
    if n > limits.max_tensors or rawsize > limits.max_table_bytes:
        raise MalformedPatchError(f"table of {n} tensors / {rawsize} bytes exceeds the limits")
    if len(data) < HEADER_SIZE + zsize:
        raise TruncatedPatchError(
            f"patch is {len(data)} bytes, its table ends at {HEADER_SIZE + zsize}"
        )
    table = _decompress(data[HEADER_SIZE : HEADER_SIZE + zsize], rawsize, "tensor table")
    if len(table) != rawsize:
        raise MalformedPatchError(f"table is {len(table)} bytes, header says {rawsize}")
    return bytes(table)


def _parse_rows(table: bytes, n: int, first_offset: int, limits: CodecLimits) -> list[FrameInfo]:
    reader, rows, offset, prev = _Reader(table), [], first_offset, None
    for _ in range(n):
        spec, coding, count, size = _parse_row(reader, limits)
        _check_row(spec, coding, count, size, limits)
        key = spec.name.encode("utf-8")
        if prev is not None and key <= prev:
            raise MalformedPatchError(f"table rows not in strict name order at {spec.name!r}")
        rows.append(FrameInfo(spec, coding, count, offset, size))
        offset, prev = offset + size, key
    if reader.off != len(table):
        raise MalformedPatchError(f"{len(table) - reader.off} stray bytes after the table rows")
    return rows


def read_header(data: bytes | memoryview, limits: CodecLimits = CodecLimits()) -> PatchInfo:
    """Parse and check the header and table (not the frames)."""
    data = memoryview(data)
    if len(data) < len(MAGIC) or bytes(data[: len(MAGIC)]) != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(bytes(data)):
            raise TruncatedPatchError(f"patch is only {len(data)} bytes")
        raise BadMagicError("not a p2psync patch (bad magic bytes)")
    if len(data) < HEADER_SIZE:
        raise TruncatedPatchError(f"patch is {len(data)} bytes, the header alone is {HEADER_SIZE}")
    _, version, flags, n, zsize, rawsize, fp, base, target = _HEADER.unpack_from(data)
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedFormatError(
            f"patch format version {version}; this build reads {sorted(SUPPORTED_VERSIONS)}"
        )
    if flags:
        raise UnsupportedFormatError(f"unknown header flags 0x{flags:04x}")
    table = _read_table(data, n, zsize, rawsize, limits)
    rows = _parse_rows(table, n, HEADER_SIZE + zsize, limits)
    if layout_fingerprint(tuple(r.spec for r in rows)) != fp:
        raise MalformedPatchError("table layout does not match the header's fingerprint")
    end = rows[-1].offset + rows[-1].size if rows else HEADER_SIZE + zsize
    if len(data) < end:
        raise TruncatedPatchError(f"patch is {len(data)} bytes, its frames end at {end}")
    if len(data) > end:
        raise TrailingDataError(f"{len(data) - end} unexpected bytes after the last frame")
    return PatchInfo(version, fp, base, target, tuple(rows), len(data))


def _decode_rows(data: memoryview, rows: Iterable[FrameInfo], workers: int) -> list[TensorDelta]:
    def one(row: FrameInfo) -> TensorDelta:
        return decode_frame(row, data[row.offset : row.offset + row.size])

    rows = list(rows)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(one, rows))
    return [one(r) for r in rows]


def decode(
    data: bytes | memoryview, limits: CodecLimits = CodecLimits(), workers: int = 1
) -> Patch:
    """Parse a patch, validating every field and frame before returning it."""
    data = memoryview(data)
    info = read_header(data, limits)
    changed = [r for r in info.rows if r.coding != UNCHANGED]
    deltas = _decode_rows(data, changed, workers)
    return Patch(info.layout, info.base_hash, info.target_hash, {d.spec.name: d for d in deltas})
