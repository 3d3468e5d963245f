"""The patch wire format. This docstring is the specification; the code follows it.

Two format versions exist. Version 2 is version 1 plus one frame coding (3, exponent classes);
a decoder reads both. An encoder writes version 2 when at least one frame uses coding 3 (only
possible when it is given the base weights), else version 1, so a file that needs nothing new
stays readable by version-1 decoders.

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
8      2     format version, u16 (1 or 2; a decoder refuses others)
10     2     flags, u16, must be 0 (reserved)
12     4     tensor count T, u32 (rows in the table: every tensor of the layout)
16     4     table size, u32 (bytes of the compressed table that follows)
20     4     table raw size, u32 (bytes of the table once decompressed)
24     16    layout fingerprint: XXH3-128 of the layout (``tensors.layout_fingerprint``)
40     16    base state hash of the weights the patch applies to (``p2p_sync.weights.statehash``)
56     16    target state hash of the weights it produces
=====  ====  =================================================================

Table
-----
One zstd frame (with content size and checksum) holding T rows, in strictly increasing order of
the names' UTF-8 bytes. The layout the rows describe must hash to the header's fingerprint. ::

    Row := name_len u16 | name utf-8[name_len] | dtype u8 | ndim u8 | dims u64[ndim]
           | coding u8 | count u64 | frame_size u64

``dtype`` is a code from ``tensors.DTYPE_CODES``. ``coding`` is 0 (unchanged: count and
frame_size are 0, no frame), 1 (sparse) or 2 (dense); under format version 2 also 3 (exponent
classes, below; only for the float dtypes listed there). Other codes are refused.
``count`` is the number of elements whose bit pattern changes.

Frames
------
For each row with coding != 0, in table order: one zstd frame of exactly ``frame_size`` bytes,
written with content size and checksum. The file ends right after the last frame.

**Expansion.** The table and every frame unpack to at most 64 times their compressed size
(``CodecLimits.max_expansion``), so what a decoder allocates follows the bytes it was given,
not the sizes they declare (zstd alone allows ~32,000x: a 64 KiB frame of run-length blocks
declares 2 GiB). A decoder refuses a file where a row's count or shape needs more than that
before it unpacks anything: a sparse frame holds at least 2 bytes per change (its gaps), a
dense one half a byte per element. zstd reaches such ratios only on near-constant data (nearly
every element changing by the same delta); an encoder then ends a zstd block every 256 bytes
of input, and a block costs at least 4 bytes, which keeps the frame within 64x. Real frames
stay under 4x, tables under 8x.

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

Format version 2: coding 3, positions by exponent class of the base
===================================================================

Why: the receiver holds the base, so it can recompute every element's exponent, and an element's
chance to change in one optimizer step doubles with every binade its magnitude drops (an AdamW
step is about the same size everywhere, the ulp halves per binade). On the built-in workload at
1.4% density, knowing the exponent cuts the position entropy from 7.6 to 5.1 bits per change.

**Classes.** For a float dtype with M mantissa bits (bfloat16 7, float16 10, float32 23,
float64 52, float8_e4m3fn 3, float8_e5m2 2) the *class* of an element is ``(u >> M) & 15``,
``u`` being the base element's bit pattern as an unsigned integer: the low 4 bits of its
exponent field. (Sixteen classes cover the binades where changes happen; binades 16 apart share
a class, which costs little because one of the two is always nearly empty.) Class c's members
are its elements in increasing flat position; the *rank* of a member is its index among them,
and N_c is the number of members. Ranks and N_c depend on the base, so a coding-3 frame decodes
only against the exact base the patch was made for (its state hash is the header's).

**Frame** (coding 3), n = count::

    class table | unary size U u64 | value header g0 | value header g1
    | unary stream | remainder planes | value body g0 | value body g1

``class table`` is 16 rows, for c = 0..15 in order: ``m_c u64 | k_c u8 | mode_c u8``.
mode bit 0 (*complement*): the m_c coded ranks are the class's members that do *not* change
(an encoder uses it when more than half the class changes), else the ones that do; mode bit 1:
the class's deltas go to value group 1, else group 0; other bits must be 0. k_c <= 63 is the
class's Rice parameter. Every coded rank must be below N_c. The number of changes in class c
is m_c, or N_c - m_c under complement; their sum must equal ``count``. The frame's exact size
follows from its headers and the base's N_c; a frame of any other size is refused.

**Codes.** Each class's coded ranks r_0 < r_1 < ... have gaps g_0 = r_0, g_i = r_i - r_{i-1} - 1,
each split as q = g >> k_c and rem = g & (2^k_c - 1). Codes are listed class 0 first, and within
a class in rank order.

- *Unary stream*, U bytes: for each code, q zero bits then a one bit; bits are packed LSB first
  (bit i of the stream is bit i % 8 of byte i // 8); after the last code at most 7 zero bits pad
  the last byte. It holds exactly sum(m_c) one bits.
- *Remainder planes*: for j = 0, 1, ... while some class with m_c > 0 has k_c > j, plane j holds
  bit j of the remainder of every code whose class has k_c > j, in code order, packed LSB first
  and zero-padded to a whole byte.

**Values.** The deltas of the changed elements, taken class 0 first and within a class in
position order, are split into group 0 (classes with mode bit 1 clear) and group 1, keeping that
order; each group is coded by the value coding of format 1 (its n is the group's size), where
here ``b`` may also be 2: values in [-1, 1] are stored as 2-bit two's complement, four to a
byte, p_0 in bits 0-1 of byte 0, p_1 in bits 2-3 and so on, unused high bits of the last byte 0
(packed size ceil(n/4)); the marker M = -2 escapes every other delta.

Why this shape: with the class known, the gaps within a class are close to geometric, for which
Rice codes are within a few percent of the entropy, and a unary/remainder split lets both streams
be packed and unpacked in bulk. Measured on the built-in workload, position bits per change at
1.4% / 6.4% density for the same class gaps: Rice 5.13 / 3.81; zstd over per-class gap byte
planes (the format-1 layout) 5.99 / 4.02; rANS (constriction) over Elias-gamma buckets with a
per-class model, plus raw low bits, 5.30 / 3.82 including the model. So Rice: smallest, no
dependency, a two-line spec. The value groups separate classes where most deltas are +-1 from
small-magnitude classes whose deltas span several ulps. A decoder computes ranks with one pass
over the base (and an encoder the same), so coding 3 costs a scan of the base tensor; an encoder
writes it only where it is smaller than codings 1 and 2 by at least 1/32 of their size (this
encoder's choice: decoding coding 3 takes ~2x the CPU of coding 1, which a saving of a few tenths
of a percent, as on patches that rewrite every element at random, does not repay).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from p2p_sync.codec import device_scans, jit
from p2p_sync.codec.device_scans import Selected
from p2p_sync.errors import (
    BadMagicError,
    BaseMismatchError,
    CorruptFrameError,
    CountMismatchError,
    IndexOutOfRangeError,
    LayoutMismatchError,
    MalformedPatchError,
    MissingBaseError,
    TrailingDataError,
    TruncatedPatchError,
    UnsupportedFormatError,
)
from p2p_sync.weights.patch import Patch, TensorDelta
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.tensors import (
    DTYPE_CODES,
    DTYPES_BY_CODE,
    Layout,
    TensorSet,
    TensorSpec,
    bits_dtype,
    flat_bits,
    layout_fingerprint,
    layout_of,
)
from p2p_sync.weights.threads import map_workers

# A base tensor's bit patterns as the class scans take them: numpy on the host, torch on a GPU.
Bits = np.ndarray | torch.Tensor

MAGIC = b"P2PPATCH"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, 2})
_HEADER = struct.Struct("<8sHHIII16s16s16s")
Frames = Mapping[str, tuple[int, int, bytes]]  # tensor name -> (coding, count, frame)
HEADER_SIZE = _HEADER.size  # 72

UNCHANGED, SPARSE, DENSE, CLASSED = 0, 1, 2, 3
# The codings each format version may use: a version-1 file never holds a coding-3 frame.
CODINGS_BY_VERSION = {1: (UNCHANGED, SPARSE, DENSE), 2: (UNCHANGED, SPARSE, DENSE, CLASSED)}
_ROW_HEAD = struct.Struct("<H")
_ROW_TYPE = struct.Struct("<BB")
_ROW_TAIL = struct.Struct("<BQQ")
_VALUE_HEAD = struct.Struct("<BI")
_SPARSE_HEAD = struct.Struct("<I")
VALUE_BITS = (4, 8, 16, 32, 64)
# Coding-3 frames may also store 2-bit values: there most groups are +-1 and little else, and
# four values to a byte let zstd's Huffman stage reach ~1.1 bits per value (nibbles: ~1.35).
CLASSED_VALUE_BITS = (2, *VALUE_BITS)
_GAP_ESCAPE = 0xFFFF

# zstd level: with one block per stream the entropy stage does the work, and level 1 compressed
# these streams as well as levels 3-9 in our measurements, at the highest speed.
DEFAULT_LEVEL = 1

# Try the dense coding too once this fraction of a tensor changes: on the built-in workload
# dense first won at 15% changed, so below 1/8 the second encode would be wasted time.
DENSE_TRY_FRACTION = 1 / 8
# Coding 3 is written only where it saves at least this share of the best version-1 frame: its
# decode costs ~2x coding 1's CPU (a 20 MB patch rewriting every element at random: 0.104 s
# against 0.058 with 2 threads, for 0.24% fewer bytes; real steps save ~28%).
CLASSED_MIN_SAVING = 1 / 32
BLOCK = 1 << 18  # changed elements a block of decode_frame_blocks holds (2 MiB of positions)


@dataclass(frozen=True)
class CodecLimits:
    """Every bound the decoder enforces, so a hostile file cannot exhaust memory or time."""

    max_tensors: int = 1_000_000
    max_table_bytes: int = 256 * 2**20
    max_ndim: int = 32
    max_tensor_elements: int = 2**40
    # bytes the table or a frame may unpack to per byte of it (the spec's "Expansion"): a
    # decoder's memory follows the file's bytes, not what they declare. Encoders keep to 64.
    max_expansion: int = 64


# What an encoder keeps every frame and table within (a block ends each 4x this many bytes).
MAX_EXPANSION = CodecLimits.max_expansion


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
    n, columns = values.size, values.view(np.uint8).reshape(-1, width)
    out = np.empty(n * width, np.uint8)
    for k in range(width):  # a plane at a time: ~3x faster than a transposed copy
        out[k * n : (k + 1) * n] = columns[:, k]
    return out.tobytes()


def _unplanes(buf: memoryview, n: int, width: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=n * width)
    if width == 1:
        return raw.view(np.int8).copy()
    out = np.empty(n, _int_dtype(width))  # writable
    columns = out.view(np.uint8).reshape(n, width)
    for k in range(width):  # a plane at a time: ~6x faster than a transposed copy
        columns[:, k] = raw[k * n : (k + 1) * n]
    return out


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


def _crumbs(values: np.ndarray) -> bytes:
    """Pack values in [-2, 1] four to a byte, the first in the lowest two bits."""
    u = (values & 3).astype(np.uint8)
    u = np.concatenate([u, np.zeros(-u.size % 4, np.uint8)]).reshape(-1, 4)
    return (u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)).tobytes()


# Byte -> its four sign-extended 2-bit values (lowest first) as one 4-byte entry.
_CRUMB_TABLE = (
    np.array([[((b >> s & 3) ^ 2) - 2 for s in (0, 2, 4, 6)] for b in range(256)], np.int8)
    .view(np.uint32)
    .reshape(256)
)


def _uncrumbs(buf: memoryview, n: int, name: str) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8, count=(n + 3) // 4)
    out = _CRUMB_TABLE[raw].view(np.int8)
    if np.any(out[n:]):
        raise MalformedPatchError(f"{name}: padding bits of 2-bit values are not zero")
    return out[:n]


def _packed_size(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _pack(values: np.ndarray, bits: int) -> bytes:
    if bits == 2:
        return _crumbs(values)
    if bits == 4:
        return _nibbles(values)
    return _planes(values.astype(_int_dtype(bits // 8), copy=False))


def _unpack(buf: memoryview, n: int, bits: int, name: str) -> np.ndarray:
    if bits == 2:
        return _uncrumbs(buf, n, name)
    if bits == 4:
        return _unnibbles(buf, n, name)
    return _unplanes(buf, n, bits // 8)


def _fits(d: np.ndarray, bits: int) -> np.ndarray:
    """-2^(b-1) < d < 2^(b-1), in one add and one compare: shift the range to start at 0 with
    wrapping arithmetic, then compare as unsigned (out-of-range values wrap far above)."""
    bias = (1 << (bits - 1)) - 1
    shifted = (d + d.dtype.type(bias)).view(f"<u{d.dtype.itemsize}")
    return shifted <= 2 * bias


def _choose_bits(d: np.ndarray, width: int, widths: tuple[int, ...]) -> int:
    """The stored width (bits) that minimises raw bytes; ties go to the narrower width."""
    full = 8 * width
    best, best_cost = full, d.size * width
    for bits in widths:
        if bits >= full:
            break
        escapes = int(d.size - np.count_nonzero(_fits(d, bits)))
        cost = _packed_size(d.size, bits) + escapes * width
        if cost < best_cost:
            best, best_cost = bits, cost
    return best


def encode_values(d: np.ndarray, widths: tuple[int, ...] = VALUE_BITS) -> tuple[bytes, list[bytes]]:
    """Value header ``b | E_v`` and body streams (packed values, escapes) for deltas ``d``;
    ``b`` is one of ``widths``."""
    width = d.dtype.itemsize
    bits = _choose_bits(d, width, widths)
    if bits == 8 * width:
        return _VALUE_HEAD.pack(bits, 0), [_pack(d, bits)]
    fits = _fits(d, bits)
    primary = np.where(fits, d, -(1 << (bits - 1)))
    escapes = d[~fits].astype(_int_dtype(width))
    return _VALUE_HEAD.pack(bits, escapes.size), [_pack(primary, bits), escapes.tobytes()]


def _value_head(
    buf: memoryview, width: int, name: str, widths: tuple[int, ...] = VALUE_BITS
) -> tuple[int, int]:
    if len(buf) < _VALUE_HEAD.size:
        raise CountMismatchError(f"{name}: frame ends before its value header")
    bits, escapes = _VALUE_HEAD.unpack_from(buf)
    if bits not in widths or bits > 8 * width or (bits == 8 * width and escapes):
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
    kernels = _kernels()
    if kernels["fast"]:  # one pass (numpy takes seven over 8-byte temporaries)
        planes = np.empty(2 * pos.size, np.uint8)
        escapes = np.empty(pos.size, f"<u{_escape_width(numel)}")  # pages touched as used
        escapes = escapes[: kernels["gap_planes"](pos, planes, escapes)]
        planes = planes.tobytes()
    else:
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


def _gap_planes_py(pos: np.ndarray, planes: np.ndarray, escapes: np.ndarray) -> int:
    """Kernel: sorted positions as gaps (``pos[i] - pos[i-1] - 1``, the first from -1) in two
    byte planes (``planes``: every gap's low byte, then every high byte); a gap of
    ``_GAP_ESCAPE`` or more is stored as that marker and listed in ``escapes``. Returns the
    escape count."""
    n, e, last = pos.size, 0, -1
    for i in range(n):
        gap = pos[i] - last - 1
        last = pos[i]
        escaped = gap >= _GAP_ESCAPE
        g = _GAP_ESCAPE if escaped else gap
        planes[i] = g & 0xFF
        planes[n + i] = g >> 8
        escapes[e] = gap  # kept only when escaped: branch-free
        e += escaped
    return e


def _gap_stats_py(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int]:
    """Kernel: (escape markers, sum of the 16-bit gaps) of the gap planes ``lo``/``hi``."""
    marks = total = 0
    for i in range(lo.size):
        g = np.int64(hi[i]) << 8 | lo[i]
        marks += g == _GAP_ESCAPE
        total += g
    return marks, total


def _positions_from_gaps_py(
    lo: np.ndarray, hi: np.ndarray, big: np.ndarray, used: int, last: int, out: np.ndarray
) -> int:
    """Kernel: positions from gap planes ``lo``/``hi`` into ``out`` (a block of them), the
    first after position ``last``; each escape marker takes the next of ``big`` from
    ``used``. The body was checked whole (:func:`_check_position_body`): the markers match
    the escapes. Returns the escapes used after this block."""
    for i in range(out.size):
        g = np.int64(hi[i]) << 8 | lo[i]
        if g == _GAP_ESCAPE:
            g = np.int64(big[used])
            used += 1
        last += g + 1
        out[i] = last
    return used


def _position_body_size(n: int, numel: int, n_esc: int) -> int:
    return 2 * n + _escape_width(numel) * n_esc


def _decode_position_body(
    body: memoryview, n: int, numel: int, n_esc: int, name: str
) -> np.ndarray:
    _check_position_body(body, n, numel, n_esc, name)
    if not n:
        return np.empty(0, np.int64)
    _, pos = next(_position_blocks(body, n, numel, n_esc, n))
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
    """One zstd frame; each stream ends a block, so it gets its own entropy tables. A frame
    unpacking to more than :data:`MAX_EXPANSION` times its size (near-constant streams) is
    made again with a block ended every ``4 * MAX_EXPANSION`` bytes: a block takes at least 4
    bytes (a run-length one), so decoders, which refuse more, take it."""
    frame = _compress_blocks(streams, level, None)
    if sum(len(s) for s in streams) > MAX_EXPANSION * len(frame):
        frame = _compress_blocks(streams, level, 4 * MAX_EXPANSION)
    return frame


def _compress_blocks(streams: list[bytes], level: int, block: int | None) -> bytes:
    """One zstd frame ending a block after each stream and, if ``block``, every ``block``
    bytes of one."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    size = sum(len(s) for s in streams)
    obj = cctx.compressobj(size=size)
    out = []
    for stream in streams:
        step = block or max(len(stream), 1)
        for at in range(0, len(stream), step):
            out.append(obj.compress(stream[at : at + step]))
            out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(obj.flush())
    return b"".join(out)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


# ---------------------------------------------------------------- exponent classes (coding 3)

# Mantissa width in bits of each float dtype: an element's class is the low 4 bits of the
# exponent field just above it. Other dtypes have no exponent and cannot use coding 3.
MANTISSA_BITS: dict[torch.dtype, int] = {
    torch.bfloat16: 7,
    torch.float16: 10,
    torch.float32: 23,
    torch.float64: 52,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
}
N_CLASSES = 16
_CLASS_ROW = struct.Struct("<QBB")
_CLASS_TAIL = struct.Struct("<Q")
_CLASSED_HEAD = _CLASS_ROW.size * N_CLASSES + _CLASS_TAIL.size + 2 * _VALUE_HEAD.size
_COMPLEMENT, _GROUP = 1, 2
_MAX_RICE = 63
# A class whose changed fraction is at least this sends its values in group 1: there the step is
# large against the ulp and deltas span several ulps; elsewhere 99% are +-1. Measured on the
# built-in workload (1/64 .. 1): 1/2 gave the smallest patches at 1 and 8 steps.
GROUP1_FRACTION = 1 / 2

# _SEL8[b, j]: the bit index of the j-th set bit of byte b (0 where b has fewer set bits).
_SEL8 = np.zeros((256, 8), dtype=np.uint8)
for _b in range(256):
    for _j, _bit in enumerate(i for i in range(8) if _b >> i & 1):
        _SEL8[_b, _j] = _bit


def classed_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can be coded by exponent class (coding 3)."""
    return dtype in MANTISSA_BITS


def element_classes(base_bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The exponent field (and for some dtypes the sign above it) of every base element, as
    uint8, zero-padded to a whole number of 64-element words. Only its low 4 bits, the class,
    are ever read, so no masking pass is spent on the rest."""
    u = base_bits.view(f"<u{base_bits.dtype.itemsize}")
    n = u.size
    out = np.zeros(-(-n // 64) * 64, np.uint8)
    if u.dtype.itemsize == 1:
        np.right_shift(u, MANTISSA_BITS[dtype], out=out[:n])
    else:
        out[:n] = u >> MANTISSA_BITS[dtype]  # the store truncates to the low byte
    return out


@dataclass(frozen=True)
class ClassMap:
    """Which base elements fall in which class, as 64-element membership words.

    ``words[c, w]`` bit i: element 64w+i has class c; ``counts[c, w]``: its popcount;
    ``members[c]``: class c's size.
    """

    words: np.ndarray
    counts: np.ndarray
    members: np.ndarray


def class_map(base_bits: np.ndarray, dtype: torch.dtype) -> ClassMap:
    """Build the membership words of all 16 classes: four bit planes of the class packed to
    bits, then 24 word-wide ANDs (1/64 of a pass each), much cheaper than 16 full compares."""
    n = base_bits.size
    classes = element_classes(base_bits, dtype)
    nw = classes.size // 64
    planes = np.empty((4, nw), np.uint64)
    octets = planes.view(np.uint8)
    tmp = np.empty(classes.size, np.uint8)
    for j in range(4):
        np.bitwise_and(classes, 1 << j, out=tmp)
        octets[j] = np.packbits(tmp.view(bool), bitorder="little")
    inverse = ~planes
    pairs = np.empty((2, 4, nw), np.uint64)
    for half in range(2):
        lo, hi = 2 * half, 2 * half + 1
        for v, (x, y) in enumerate(
            ((inverse, inverse), (planes, inverse), (inverse, planes), (planes, planes))
        ):
            np.bitwise_and(x[lo], y[hi], out=pairs[half, v])
    words = np.empty((N_CLASSES, nw), np.uint64)
    for c in range(N_CLASSES):
        np.bitwise_and(pairs[0, c & 3], pairs[1, c >> 2], out=words[c])
    if n % 64:
        words[:, -1] &= np.uint64((1 << (n % 64)) - 1)
    elif n == 0:
        words = words[:, :0]
    counts = np.bitwise_count(words)
    return ClassMap(words, counts, counts.sum(axis=1, dtype=np.int64))


def class_ranks(words: np.ndarray, counts: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rank of each position among its class's members (``words`` is that class's row of
    :func:`class_map`, ``counts`` its per-word popcounts)."""
    before = np.cumsum(counts, dtype=np.int64) - counts
    blk = pos >> 6
    below = np.left_shift(np.uint64(1), (pos & 63).astype(np.uint64)) - np.uint64(1)
    return before[blk] + np.bitwise_count(words[blk] & below)


def _word_of(counts: np.ndarray, ranks: np.ndarray, members: int) -> tuple[np.ndarray, np.ndarray]:
    """(word index, rank within that word) of each sorted rank. Expanding the counts costs
    about a nanosecond per member, a binary search ~40 per rank: take the cheaper."""
    if members < 24 * ranks.size:
        words = np.repeat(np.arange(counts.size), counts)[ranks]
        first = np.cumsum(counts, dtype=np.int64) - counts
        return words, ranks - first[words]
    cum = np.cumsum(counts, dtype=np.int64)
    words = np.searchsorted(cum, ranks, side="right")
    return words, ranks - (cum[words] - counts[words])


_U64 = np.uint64
_SWAR1, _SWAR2 = _U64(0x5555555555555555), _U64(0x3333333333333333)
_SWAR4 = _U64(0x0F0F0F0F0F0F0F0F)
_BYTES1, _BYTES_HI = _U64(0x0101010101010101), _U64(0x8080808080808080)
_SEL8_FLAT = _SEL8.reshape(-1).astype(np.uint64)


def _select_in_word(w: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Bit index of the j-th set bit of each word, branch-free over whole arrays (SWAR): byte
    popcounts, their prefix sums by one multiply, the byte by a bytewise compare, then a table."""
    x = w - ((w >> _U64(1)) & _SWAR1)
    x = (x & _SWAR2) + ((x >> _U64(2)) & _SWAR2)
    prefix = ((x + (x >> _U64(4))) & _SWAR4) * _BYTES1  # byte i: set bits in bytes 0..i
    ju = j.astype(np.uint64)
    shift = np.bitwise_count(((ju * _BYTES1) | _BYTES_HI) - prefix & _BYTES_HI).astype(np.uint64)
    shift <<= _U64(3)
    before = ((prefix << _U64(8)) >> shift) & _U64(0xFF)
    octet = (w >> shift) & _U64(0xFF)
    return (shift + _SEL8_FLAT[(octet << _U64(3)) + ju - before]).astype(np.int64)


def class_select(
    words: np.ndarray, counts: np.ndarray, members: int, ranks: np.ndarray
) -> np.ndarray:
    """Inverse of :func:`class_ranks`: the flat position of each sorted rank (< members)."""
    if ranks.size == 0:
        return ranks
    blk, j = _word_of(counts, ranks, members)
    return (blk << 6) + _select_in_word(words[blk], j)


def _complement(ranks: np.ndarray, members: int) -> np.ndarray:
    keep = np.ones(members, dtype=bool)
    keep[ranks] = False
    return np.flatnonzero(keep)


def _rice_candidates(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per used class (``sums`` of its gaps, ``counts`` of them), the 5 Rice parameters
    searched: within 2 of log2 of the mean gap (the optimum for a geometric gap lies there)."""
    guess = np.log2(sums / counts + 1).astype(np.int64)
    return np.clip(guess[:, None] + np.arange(-2, 3), 0, _MAX_RICE)


def _rice_pick(candidates: np.ndarray, shifted: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per used class, the column of the candidate that minimises its bits (ties to the
    smaller parameter); ``shifted[c, o]``: the sum of its gaps shifted by ``candidates[c, o]``."""
    cost = shifted + counts[:, None] * (1 + candidates)
    return np.argmin(cost, axis=1)


def _rice_params(gaps: np.ndarray, coded: np.ndarray) -> np.ndarray:
    """Per class, the Rice parameter that minimises its bits among :func:`_rice_candidates`.
    ``gaps`` holds the classes' gaps back to back, ``coded`` how many each has."""
    best = np.zeros(N_CLASSES, np.int64)
    used = np.flatnonzero(coded)
    if used.size == 0:
        return best
    starts, counts = (np.cumsum(coded) - coded)[used], coded[used]
    candidates = _rice_candidates(np.add.reduceat(gaps, starts), counts)
    shifted = np.stack(
        [
            np.add.reduceat(gaps >> np.repeat(candidates[:, o], counts), starts)
            for o in range(candidates.shape[1])
        ],
        axis=1,
    )
    best[used] = candidates[np.arange(used.size), _rice_pick(candidates, shifted, counts)]
    return best


def _unary(quotients: np.ndarray) -> bytes:
    """q zero bits then a one bit per entry, LSB-first."""
    if quotients.size == 0:
        return b""
    ends = np.cumsum(quotients + 1) - 1
    bits = np.zeros(int(ends[-1]) + 1, dtype=bool)
    bits[ends] = True
    return np.packbits(bits, bitorder="little").tobytes()


def _plane_sizes(k: np.ndarray, coded: np.ndarray) -> list[int]:
    """Entries in each remainder plane j: the codes of classes whose parameter exceeds j."""
    return [int(coded[k > j].sum()) for j in range(int(k.max(initial=0)))]


def _remainder_planes(rem: np.ndarray, k_of: np.ndarray) -> bytes:
    """Plane j: bit j of every remainder whose code has k > j, in code order, LSB-first."""
    out = []
    for j in range(int(k_of.max(initial=0))):
        out.append(np.packbits((rem[k_of > j] >> j) & 1 != 0, bitorder="little").tobytes())
    return b"".join(out)


@dataclass(frozen=True)
class _ClassCodes:
    """The position part of a coding-3 frame: per class the number of coded ranks, the Rice
    parameter and the mode; per code (class after class) its gap, and the sum of the gaps'
    quotients (the unary stream's zeros)."""

    coded: np.ndarray
    k: np.ndarray
    mode: np.ndarray
    gaps: np.ndarray
    zeros: int

    def streams(self) -> tuple[bytes, bytes]:
        """(unary stream, remainder planes)."""
        kernels = _kernels()
        if kernels["fast"]:
            sizes = [(m + 7) // 8 for m in _plane_sizes(self.k, self.coded)]
            unary = np.zeros((self.zeros + self.gaps.size + 7) // 8, np.uint8)
            planes = np.zeros(sum(sizes), np.uint8)
            plane_start = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
            kernels["rice_encode"](self.gaps, self.coded, self.k, unary, planes, plane_start)
            return unary.tobytes(), planes.tobytes()
        k_of = np.repeat(self.k, self.coded)
        return _unary(self.gaps >> k_of), _remainder_planes(self.gaps & ((1 << k_of) - 1), k_of)


def _code_classes(rank: np.ndarray, bounds: np.ndarray, members: np.ndarray) -> _ClassCodes:
    """Rice-code every class's ranks (``rank[bounds[c]:bounds[c+1]]``, sorted). A class where
    most members change codes the ranks of those that do not (mode bit 0); one where at least
    GROUP1_FRACTION changes sends its values in group 1 (mode bit 1)."""
    changed = np.diff(bounds)
    group = (changed > 0) & (changed >= GROUP1_FRACTION * members)
    complement = 2 * changed > members
    parts = [rank[bounds[c] : bounds[c + 1]] for c in range(N_CLASSES)]
    for c in np.flatnonzero(complement):
        parts[c] = _complement(parts[c], int(members[c]))
    coded = np.array([p.size for p in parts], np.int64)
    ranks = np.concatenate(parts)
    prev = np.empty_like(ranks)
    prev[1:] = ranks[:-1]
    starts = np.cumsum(coded) - coded
    prev[starts[coded > 0]] = -1
    gaps = ranks - prev - 1
    k = _rice_params(gaps, coded)
    mode = complement * _COMPLEMENT + group * _GROUP
    return _ClassCodes(coded, k, mode, gaps, int((gaps >> np.repeat(k, coded)).sum()))


def _class_codes(
    cls: np.ndarray, rank: np.ndarray, d: np.ndarray, members: np.ndarray
) -> tuple[_ClassCodes, np.ndarray, np.ndarray]:
    """The changes (in position order: class ``cls``, class rank ``rank``, delta ``d``) coded
    class by class: (codes, each class's changed count, the deltas in class order). Compiled:
    a tally, then one gather (a stable counting sort) that also sums each gap's shifts by the
    Rice candidates; the numpy way is a stable sort by class, then per-class arrays."""
    kernels = _kernels()
    if kernels["fast"]:
        return _gathered_codes(kernels, cls, rank, d, members)
    order = np.argsort(cls, kind="stable")
    cls, rank, d = cls[order], rank[order], d[order]
    bounds = np.searchsorted(cls, np.arange(N_CLASSES + 1))
    return _code_classes(rank, bounds, members), np.diff(bounds), d


def _gathered_codes(
    kernels: dict[str, Callable],
    cls: np.ndarray,
    rank: np.ndarray,
    d: np.ndarray,
    members: np.ndarray,
) -> tuple[_ClassCodes, np.ndarray, np.ndarray]:
    """:func:`_class_codes` by the compiled kernels. A class's changed gaps sum to its last
    rank + 1 - its count, which fixes its Rice candidates before the gather pass; a class that
    codes its complement (small classes of tiny weights, where most members change) is
    re-coded from its gathered gaps after it."""
    counts, last = np.zeros(N_CLASSES, np.int64), np.full(N_CLASSES, -1, np.int64)
    kernels["class_tally"](cls, rank, counts, last)
    complement = 2 * counts > members
    plain = np.flatnonzero((counts > 0) & ~complement)
    candidates = np.zeros((N_CLASSES, 5), np.int64)
    if plain.size:
        candidates[plain] = _rice_candidates(last[plain] + 1 - counts[plain], counts[plain])
    starts = np.cumsum(counts) - counts
    gaps, d_out = np.empty(rank.size, np.int64), np.empty_like(d)
    shifted = np.zeros((N_CLASSES, 5), np.int64)
    kernels["class_gather"](cls, rank, d, starts, candidates, gaps, d_out, shifted)
    coded = counts
    if complement.any():
        gaps, coded = _complement_gaps(gaps, starts, counts, members, complement)
        at = np.cumsum(coded) - coded
        for c in np.flatnonzero(complement & (coded > 0)):
            seg = gaps[at[c] : at[c] + coded[c]]
            candidates[c] = _rice_candidates(seg.sum(keepdims=True), coded[c : c + 1])[0]
            shifted[c] = [int((seg >> int(k)).sum()) for k in candidates[c]]
    k, zeros, used = np.zeros(N_CLASSES, np.int64), 0, np.flatnonzero(coded)
    if used.size:
        pick = _rice_pick(candidates[used], shifted[used], coded[used])
        k[used] = candidates[used, pick]
        zeros = int(shifted[used, pick].sum())
    group = (counts > 0) & (counts >= GROUP1_FRACTION * members)
    mode = complement * _COMPLEMENT + group * _GROUP
    return _ClassCodes(coded, k, mode, gaps, zeros), counts, d_out


def _complement_gaps(
    gaps: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    members: np.ndarray,
    complement: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The classes' gaps back to back, each complement class's changed gaps replaced by the
    gaps of its members that did not change; and how many gaps each class now codes."""
    parts = []
    for c in range(N_CLASSES):
        seg = gaps[starts[c] : starts[c] + counts[c]]
        if complement[c]:
            unchanged = _complement(np.cumsum(seg + 1) - 1, int(members[c]))
            seg = np.diff(unchanged, prepend=-1) - 1
        parts.append(seg)
    return np.concatenate(parts), np.array([p.size for p in parts], np.int64)


# ---------------------------------------------------------------- class scans (one pass)

# Coding 3 needs, for every changed element, its rank among the base elements of its class, and
# the decoder the inverse. Both are one sequential pass over the base with 16 counters; compiled
# by numba this costs ~1 ns per element. Without numba the same results come from word-parallel
# numpy (class_map + class_ranks/class_select above), several times slower.


@jit.step
def _count_classes(u: np.ndarray, shift: int, h: np.ndarray, start: int, end: int) -> None:
    """Count the classes of ``u[start:end]`` into the four histograms ``h`` in turn, so runs of
    one class do not wait on one counter."""
    i = start
    while i + 4 <= end:
        h[0, (u[i] >> shift) & 15] += 1
        h[1, (u[i + 1] >> shift) & 15] += 1
        h[2, (u[i + 2] >> shift) & 15] += 1
        h[3, (u[i + 3] >> shift) & 15] += 1
        i += 4
    while i < end:
        h[0, (u[i] >> shift) & 15] += 1
        i += 1


@jit.step
def _class_count(h: np.ndarray, c: int) -> int:
    """Class ``c``'s count over the four histograms."""
    return h[0, c] + h[1, c] + h[2, c] + h[3, c]


def _rank_scan_py(
    u: np.ndarray,
    shift: int,
    pos: np.ndarray,
    cls: np.ndarray,
    rank: np.ndarray,
    members: np.ndarray,
) -> None:
    """Kernel: class and class rank of each sorted position; class sizes into ``members``.
    Between two changed positions the loop only counts."""
    h = np.zeros((4, 16), np.int64)
    start = 0
    for j in range(pos.size):
        end = pos[j]
        _count_classes(u, shift, h, start, end)
        c = (u[end] >> shift) & 15
        cls[j] = c
        rank[j] = _class_count(h, c)
        h[0, c] += 1
        start = end + 1
    _count_classes(u, shift, h, start, u.size)
    for c in range(16):
        members[c] = _class_count(h, c)


# The select scan's per-class state: coded ranks, each class's first, class sizes so far
# (complement classes), where each class reads ranks, its next coded rank, its skip count.
# Steps run per element take the arrays themselves, not this tuple (see _select_walk).
_SelectState = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@jit.step
def _select_start(complement: np.ndarray, state: _SelectState) -> None:
    """Point every class at its first coded rank; a normal class skips the members before it."""
    ranks, first, _, cursor, due, skip = state
    for c in range(16):
        cursor[c] = first[c]
        due[c] = ranks[first[c]]
        skip[c] = 0 if complement[c] else due[c]


@jit.step
def _next_coded(
    c: int,
    ranks: np.ndarray,
    first: np.ndarray,
    cursor: np.ndarray,
    due: np.ndarray,
    skip: np.ndarray,
) -> int:
    """A normal class's skip ran out: this member is its next coded rank, so it changed. Move
    to the following rank; return its index among the class's changed elements."""
    cur, seen = cursor[c], due[c]
    cursor[c] = cur + 1
    due[c] = ranks[cur + 1]
    skip[c] = due[c] - seen - 1
    return cur - first[c]


@jit.step
def _complement_member(
    c: int,
    ranks: np.ndarray,
    first: np.ndarray,
    members: np.ndarray,
    cursor: np.ndarray,
    due: np.ndarray,
) -> tuple[bool, int]:
    """A member of complement class ``c``: (False, 0) when coded (it stays), else (True, its
    index among the class's changed elements)."""
    cur, seen = cursor[c], members[c]
    members[c] = seen + 1
    if seen == due[c]:
        cursor[c] = cur + 1
        due[c] = ranks[cur + 1]
        return False, 0
    return True, seen - (cur - first[c])


@jit.step
def _select_walk(
    u: np.ndarray, shift: int, complement: np.ndarray, state: _SelectState, out: tuple
) -> int:
    """Emit the changed elements in order into ``out`` (position, class, index among the class's
    changed elements); the common element costs one decrement. The count, or -1 past the cap."""
    out_pos, out_cls, out_within = out
    # unpacked once: unpacking arrays from a tuple costs refcount updates, and per element
    # (complement classes) that made the scan 3x slower
    ranks, first, members, cursor, due, skip = state
    k = 0
    for i in range(u.size):
        c = (u[i] >> shift) & 15
        left = skip[c]
        if left > 0:
            skip[c] = left - 1
            continue
        if complement[c]:
            changed, within = _complement_member(c, ranks, first, members, cursor, due)
            if not changed:
                continue
        else:
            within = _next_coded(c, ranks, first, cursor, due, skip)
        if k == out_pos.size:
            return -1
        out_pos[k] = i
        out_cls[k] = c
        out_within[k] = within
        k += 1
    return k


def _select_scan_py(
    u: np.ndarray,
    shift: int,
    ranks: np.ndarray,
    first: np.ndarray,
    complement: np.ndarray,
    out_pos: np.ndarray,
    out_cls: np.ndarray,
    out_within: np.ndarray,
    members: np.ndarray,
    cursor: np.ndarray,
) -> int:
    """Kernel: walk the base once; an element is changed when its class rank is the class's
    next coded rank (or, in a complement class, is not). ``ranks`` holds each class's coded
    ranks from ``first[c]`` on, closed by a sentinel >= 2^62. Emits changed positions in order;
    fills ``members`` (class sizes) and ``cursor`` (where each class stopped reading ``ranks``).
    Returns the number emitted, -1 past the cap. ``skip[c]`` counts the class-c elements left
    before its next coded rank (0 for a complement class: its every member takes the slow path)."""
    skip, due = np.empty(16, np.int64), np.empty(16, np.int64)
    state = (ranks, first, members, cursor, due, skip)
    _select_start(complement, state)
    k = _select_walk(u, shift, complement, state, (out_pos, out_cls, out_within))
    if k < 0:
        return k
    for c in range(16):
        if not complement[c]:
            members[c] = due[c] - skip[c]
    return k


_KERNELS: dict[str, Callable] = {}


def _kernels() -> dict[str, Callable]:
    """The scans compiled by numba (cached on disk), or ``fast=False``: then callers take the
    word-parallel numpy paths (a Python loop per element would take seconds)."""
    if not _KERNELS:
        compiled = jit.compile_kernels(
            {
                "rank": _rank_scan_py,
                "select": _select_scan_py,
                "rice": _rice_decode_py,
                "rice_encode": _rice_encode_py,
                "class_tally": _class_tally_py,
                "class_gather": _class_gather_py,
                "gather": _gather_py,
                "gap_planes": _gap_planes_py,
                "gaps": _positions_from_gaps_py,
                "gap_stats": _gap_stats_py,
            }
        )
        _KERNELS.update(compiled or {}, fast=compiled is not None)
    return _KERNELS


def _unsigned(bits: np.ndarray) -> np.ndarray:
    return bits.view(f"<u{bits.dtype.itemsize}")


def scan_ranks(base_bits: Bits, dtype: torch.dtype, pos: np.ndarray) -> tuple:
    """(class uint8, class rank int64) of each sorted position, and every class's size."""
    if isinstance(base_bits, torch.Tensor):
        return device_scans.scan_ranks(base_bits, MANTISSA_BITS[dtype], pos)
    cls = np.empty(pos.size, np.uint8)
    rank = np.empty(pos.size, np.int64)
    members = np.zeros(N_CLASSES, np.int64)
    kernels = _kernels()
    if kernels["fast"]:
        kernels["rank"](_unsigned(base_bits), MANTISSA_BITS[dtype], pos, cls, rank, members)
        return cls, rank, members
    cmap = class_map(base_bits, dtype)
    cls[:] = (_unsigned(base_bits)[pos] >> MANTISSA_BITS[dtype]) & 15
    for c in range(N_CLASSES):
        sel = np.flatnonzero(cls == c)
        rank[sel] = class_ranks(cmap.words[c], cmap.counts[c], pos[sel])
    return cls, rank, cmap.members


def _select_numpy(
    base_bits: np.ndarray,
    dtype: torch.dtype,
    ranks: np.ndarray,
    starts: np.ndarray,
    complement: np.ndarray,
) -> Selected:
    cmap = class_map(base_bits, dtype)
    parts, consumed = [], np.zeros(N_CLASSES, np.int64)
    for c in range(N_CLASSES):
        r = ranks[starts[c] : starts[c + 1]]
        r = r[: np.searchsorted(r, cmap.members[c])]
        consumed[c] = r.size
        if complement[c]:
            r = _complement(r, int(cmap.members[c]))
        pos = class_select(cmap.words[c], cmap.counts[c], int(cmap.members[c]), r)
        parts.append((pos, np.full(pos.size, c, np.uint8), np.arange(pos.size)))
    pos, cls, within = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(pos, kind="stable")
    return Selected(pos[order], cls[order], within[order], cmap.members, consumed)


def _sentinel_ranks(ranks: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each class's coded ranks closed by a sentinel 2^62, so the select scan reads a class's
    next rank without a bounds check; and where each class's ranks start."""
    first = starts[:-1] + np.arange(N_CLASSES)
    padded = np.full(ranks.size + N_CLASSES, 2**62, np.int64)
    padded[np.arange(ranks.size) + np.repeat(np.arange(N_CLASSES), np.diff(starts))] = ranks
    return padded, first


def _select_compiled(
    select: Callable,
    u: np.ndarray,
    shift: int,
    ranks: np.ndarray,
    starts: np.ndarray,
    complement: np.ndarray,
    cap: int,
) -> Selected | None:
    """:func:`scan_select` by the compiled kernel ``select`` over base words ``u``."""
    out_pos, out_within = np.empty(cap, np.int64), np.empty(cap, np.int64)
    out_cls = np.empty(cap, np.uint8)
    members, cursor = np.zeros(N_CLASSES, np.int64), np.zeros(N_CLASSES, np.int64)
    padded, first = _sentinel_ranks(ranks, starts)
    k = select(u, shift, padded, first, complement, out_pos, out_cls, out_within, members, cursor)
    if k < 0:
        return None
    return Selected(out_pos[:k], out_cls[:k], out_within[:k], members, cursor - first)


def scan_select(
    base_bits: Bits,
    dtype: torch.dtype,
    ranks: np.ndarray,
    starts: np.ndarray,
    complement: np.ndarray,
    cap: int,
) -> Selected | None:
    """Positions of the changed elements given each class's sorted coded ranks
    (``ranks[starts[c]:starts[c+1]]``); None when more than ``cap`` elements would change."""
    shift = MANTISSA_BITS[dtype]
    if isinstance(base_bits, torch.Tensor):
        return device_scans.scan_select(base_bits, shift, ranks, starts, complement, cap)
    kernels = _kernels()
    if not kernels["fast"]:
        found = _select_numpy(base_bits, dtype, ranks, starts, complement)
        return found if found.pos.size <= cap else None
    u = _unsigned(base_bits)
    return _select_compiled(kernels["select"], u, shift, ranks, starts, complement, cap)


def _classed_streams(delta: TensorDelta, base_bits: Bits) -> list[bytes]:
    pos, d = (_np(t) for t in delta.to_sparse())
    if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
        order = np.argsort(pos)
        pos, d = pos[order], d[order]
    cls, rank, members = scan_ranks(base_bits, delta.spec.dtype, pos)
    codes, changed, d = _class_codes(cls, rank, d, members)
    unary, planes = codes.streams()
    in_group1 = np.repeat((codes.mode & _GROUP) != 0, changed)
    values = [encode_values(d[g], CLASSED_VALUE_BITS) for g in (~in_group1, in_group1)]
    head = b"".join(
        _CLASS_ROW.pack(*row)
        for row in zip(codes.coded.tolist(), codes.k.tolist(), codes.mode.tolist())
    )
    head += _CLASS_TAIL.pack(len(unary)) + values[0][0] + values[1][0]
    return [head, unary, planes, *values[0][1], *values[1][1]]


@dataclass(frozen=True)
class _ClassHead:
    """A coding-3 frame's fixed header."""

    coded: np.ndarray
    k: np.ndarray
    mode: np.ndarray
    unary_size: int
    values: tuple[tuple[int, int], tuple[int, int]]

    @property
    def remainder_size(self) -> int:
        return sum((m + 7) // 8 for m in _plane_sizes(self.k, self.coded))

    @property
    def complement(self) -> np.ndarray:
        return (self.mode & _COMPLEMENT) != 0

    @property
    def group(self) -> np.ndarray:
        return (self.mode & _GROUP) != 0


def _classed_head(raw: memoryview, spec: TensorSpec) -> _ClassHead:
    name = spec.name
    if len(raw) < _CLASSED_HEAD:
        raise CountMismatchError(f"{name}: frame ends before its class table")
    rows = [_CLASS_ROW.unpack_from(raw, i * _CLASS_ROW.size) for i in range(N_CLASSES)]
    if max(r[0] for r in rows) > spec.numel:  # checked before any fixed-width arithmetic
        raise CountMismatchError(f"{name}: a class codes more entries than the tensor holds")
    coded, k, mode = (np.array(col, dtype=np.int64) for col in zip(*rows))
    if int(k.max()) > _MAX_RICE or int(mode.max()) > (_COMPLEMENT | _GROUP):
        raise MalformedPatchError(f"{name}: class table holds a Rice parameter or mode past range")
    off = _CLASS_ROW.size * N_CLASSES
    (unary,) = _CLASS_TAIL.unpack_from(raw, off)
    off += _CLASS_TAIL.size
    v0 = _value_head(raw[off:], spec.itemsize, name, CLASSED_VALUE_BITS)
    v1 = _value_head(raw[off + _VALUE_HEAD.size :], spec.itemsize, name, CLASSED_VALUE_BITS)
    head = _ClassHead(coded, k, mode, unary, (v0, v1))
    if len(raw) < _CLASSED_HEAD + unary + head.remainder_size:
        raise CountMismatchError(f"{name}: frame ends inside its position streams")
    return head


def _read_unary(buf: memoryview, total: int, name: str) -> np.ndarray:
    """Quotients from the unary stream: exactly ``total`` one bits, zero padding only."""
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")
    ones = np.flatnonzero(bits)
    if ones.size != total or (total and int(ones[-1]) < bits.size - 8) or (not total and len(buf)):
        raise CountMismatchError(f"{name}: unary stream holds {ones.size} codes, expected {total}")
    return np.diff(ones, prepend=-1) - 1


def _gather_py(
    values: np.ndarray, first: np.ndarray, cls: np.ndarray, within: np.ndarray, out: np.ndarray
) -> None:
    """Kernel: ``out[i] = values[first[cls[i]] + within[i]]`` (indices come from the scan)."""
    for i in range(out.size):
        out[i] = values[first[cls[i]] + within[i]]


def _class_tally_py(
    cls: np.ndarray, rank: np.ndarray, counts: np.ndarray, last: np.ndarray
) -> None:
    """Kernel: each class's changed count and last rank (ranks ascend within a class)."""
    for i in range(cls.size):
        c = cls[i]
        counts[c] += 1
        last[c] = rank[i]


def _class_gather_py(
    cls: np.ndarray,
    rank: np.ndarray,
    d: np.ndarray,
    starts: np.ndarray,
    candidates: np.ndarray,
    gaps: np.ndarray,
    d_out: np.ndarray,
    shifted: np.ndarray,
) -> None:
    """Kernel: the changes in class order, position order within a class (a stable counting
    sort from ``starts``): each rank's gap after its class's previous rank (the first after
    -1), its delta, and per class the sum of its gaps shifted by each candidate parameter."""
    cursor = starts.copy()
    prev = np.full(16, -1, np.int64)
    for i in range(cls.size):
        c = cls[i]
        j = cursor[c]
        cursor[c] = j + 1
        g = rank[i] - prev[c] - 1
        prev[c] = rank[i]
        gaps[j] = g
        d_out[j] = d[i]
        for o in range(candidates.shape[1]):
            shifted[c, o] += g >> candidates[c, o]


def _rice_encode_py(
    gaps: np.ndarray,
    coded: np.ndarray,
    k: np.ndarray,
    unary: np.ndarray,
    planes: np.ndarray,
    plane_start: np.ndarray,
) -> None:
    """Kernel: set the unary and remainder-plane bits of every code (buffers zeroed, sized):
    quotient ``gap >> k`` in unary, the ``k`` low bits across the planes."""
    bit, i = 0, 0
    plane_pos = np.zeros(64, np.int64)
    for c in range(16):
        for _ in range(coded[c]):
            bit += gaps[i] >> k[c]
            unary[bit >> 3] |= np.uint8(1 << (bit & 7))
            bit += 1
            rem = gaps[i]
            for j in range(k[c]):
                p = plane_pos[j]
                if (rem >> j) & 1:
                    planes[plane_start[j] + (p >> 3)] |= np.uint8(1 << (p & 7))
                plane_pos[j] = p + 1
            i += 1


@jit.step
def _unary_code(unary: np.ndarray, bit: int, nbits: int) -> tuple[int, int]:
    """The unary code from bit ``bit`` on: (its zeros, the bit after its one), or (-1, bit)
    when the stream runs out first."""
    q = 0
    while True:
        if bit >= nbits:
            return -1, bit
        if (unary[bit >> 3] >> (bit & 7)) & 1:
            return q, bit + 1
        q += 1
        bit += 1


@jit.step
def _rice_gap(
    q: int, k: int, planes: np.ndarray, plane_start: np.ndarray, plane_pos: np.ndarray
) -> int:
    """A code's gap: quotient ``q`` above its ``k`` remainder bits, bit j the next unread bit of
    plane j."""
    gap = q << k
    for j in range(k):
        p = plane_pos[j]
        gap |= np.int64((planes[plane_start[j] + (p >> 3)] >> (p & 7)) & 1) << j
        plane_pos[j] = p + 1
    return gap


@jit.step
def _unary_padding_ok(unary: np.ndarray, bit: int) -> bool:
    """After the last code only zero bits, fewer than 8 of them, may follow."""
    nbits = unary.size * 8
    if nbits - bit >= 8:
        return False
    while bit < nbits:
        if (unary[bit >> 3] >> (bit & 7)) & 1:
            return False
        bit += 1
    return True


def _rice_decode_py(
    unary: np.ndarray,
    planes: np.ndarray,
    plane_start: np.ndarray,
    coded: np.ndarray,
    k: np.ndarray,
    numel: int,
    ranks: np.ndarray,
) -> int:
    """Kernel: every class's ranks from its Rice codes (raw unary bytes and remainder planes,
    plane j at byte ``plane_start[j]``). Returns 0, or 1 when the unary stream runs out, 2 when
    a gap leaves the tensor, 3 when bits follow the last code (other than < 8 zero pads)."""
    bit, nbits, i = 0, unary.size * 8, 0
    plane_pos = np.zeros(64, np.int64)
    for c in range(16):
        kc, prev = k[c], -1
        for _ in range(coded[c]):
            q, bit = _unary_code(unary, bit, nbits)
            if q < 0:
                return 1
            if q > (numel >> kc):
                return 2
            gap = _rice_gap(q, kc, planes, plane_start, plane_pos)
            if gap >= numel or prev + gap + 1 >= numel:
                return 2
            prev += gap + 1
            ranks[i] = prev
            i += 1
    return 0 if _unary_padding_ok(unary, bit) else 3


_RICE_ERRORS = {
    1: (CountMismatchError, "unary stream ends before its last code"),
    2: (IndexOutOfRangeError, "a coded position lies outside the tensor"),
    3: (CountMismatchError, "unary stream holds bits after its last code"),
}


def _read_remainders(buf: memoryview, k_of: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Inverse of :func:`_remainder_planes` (``buf`` holds exactly the planes)."""
    rem = np.zeros(k_of.size, np.int64)
    off = 0
    for j, m in enumerate(sizes):
        bits = np.unpackbits(
            np.frombuffer(buf, np.uint8, (m + 7) // 8, off), count=m, bitorder="little"
        )
        rem[k_of > j] |= bits.astype(np.int64) << j
        off += (m + 7) // 8
    return rem


def _coded_ranks(raw: memoryview, head: _ClassHead, numel: int, name: str) -> np.ndarray:
    """Every class's coded ranks, class after class. Gaps are bounded by the tensor size before
    any shift or running sum, so hostile input cannot overflow them."""
    kernels = _kernels()
    if kernels["fast"]:
        off = _CLASSED_HEAD + head.unary_size
        sizes = [(m + 7) // 8 for m in _plane_sizes(head.k, head.coded)]
        unary = np.frombuffer(raw, np.uint8, head.unary_size, _CLASSED_HEAD)
        planes = np.frombuffer(raw, np.uint8, sum(sizes), off)
        plane_start = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        ranks = np.empty(int(head.coded.sum()), np.int64)
        status = kernels["rice"](unary, planes, plane_start, head.coded, head.k, numel, ranks)
        if status:
            error, what = _RICE_ERRORS[status]
            raise error(f"{name}: {what}")
        return ranks
    off = _CLASSED_HEAD
    q = _read_unary(raw[off : off + head.unary_size], int(head.coded.sum()), name)
    off += head.unary_size
    k = np.repeat(head.k, head.coded)
    if q.size and bool(np.any(q > (numel >> k))):
        raise IndexOutOfRangeError(f"{name}: a position gap exceeds the tensor's {numel} elements")
    rem = _read_remainders(raw[off:], k, _plane_sizes(head.k, head.coded))
    gaps = (q << k) | rem
    if float(gaps.sum(dtype=np.float64)) + gaps.size > N_CLASSES * numel:
        raise IndexOutOfRangeError(f"{name}: positions run past the tensor's {numel} elements")
    ends = np.cumsum(gaps + 1)
    starts = np.concatenate(([0], np.cumsum(head.coded)))
    before = np.concatenate(([0], ends))[starts[:-1]]
    return ends - 1 - np.repeat(before, head.coded)


def _classed_values(
    raw: memoryview, head: _ClassHead, found: Selected, spec: TensorSpec
) -> np.ndarray:
    """The deltas of the found elements, in position order, after the exact size check."""
    name, width, n = spec.name, spec.itemsize, found.pos.size
    changed = np.where(head.complement, found.members - head.coded, head.coded)
    group = head.group
    sizes = [int(changed[~group].sum()), int(changed[group].sum())]
    bodies = [_value_body_size(m, width, *head.values[g]) for g, m in enumerate(sizes)]
    off = _CLASSED_HEAD + head.unary_size + head.remainder_size
    _check_size(raw, off + sum(bodies), n, name)
    values = []
    for g, m in enumerate(sizes):
        bits, n_esc = head.values[g]
        values.append(_decode_value_body(raw[off : off + bodies[g]], m, width, bits, n_esc, name))
        off += bodies[g]
    # value index of a class's first changed element: groups back to back, classes in order
    first = np.zeros(N_CLASSES, np.int64)
    for g in (0, 1):
        members_of = np.flatnonzero(group == bool(g))
        first[members_of] = np.cumsum(changed[members_of]) - changed[members_of] + g * sizes[0]
    every = np.concatenate(values)
    kernels = _kernels()
    if kernels["fast"]:
        out = np.empty(n, every.dtype)
        kernels["gather"](every, first, found.cls, found.within, out)
        return out
    return every[first[found.cls] + found.within]


def _decode_classed(raw: memoryview, spec: TensorSpec, n: int, base_bits: Bits) -> TensorDelta:
    name = spec.name
    head = _classed_head(raw, spec)
    if len(raw) < _CLASSED_HEAD + head.unary_size + head.remainder_size + (n + 3) // 4:
        # n values take at least n/4 bytes: refuse before the scan sizes its output by n
        raise CountMismatchError(f"{name}: frame too short for {n} changed values")
    ranks = _coded_ranks(raw, head, spec.numel, name)
    starts = np.concatenate(([0], np.cumsum(head.coded)))
    found = scan_select(base_bits, spec.dtype, ranks, starts, head.complement, n)
    if found is not None and bool(np.any(found.consumed < head.coded)):
        raise IndexOutOfRangeError(f"{name}: a coded position lies past its class's members")
    if found is None or found.pos.size != n:
        have = "more" if found is None else found.pos.size
        raise CountMismatchError(f"{name}: classes change {have} elements, table says {n}")
    d = _classed_values(raw, head, found, spec)
    return TensorDelta(
        spec, torch.from_numpy(found.pos), torch.from_numpy(d).view(bits_dtype(spec.dtype))
    )


def _sparse_streams(delta: TensorDelta) -> list[bytes]:
    pos, d = delta.to_sparse()
    pos_head, pos_body = encode_positions(_np(pos), delta.spec.numel)
    val_head, val_body = encode_values(_np(d))
    return [pos_head + val_head, *pos_body, *val_body]


def _dense_streams(delta: TensorDelta) -> list[bytes]:
    head, body = encode_values(_np(delta.to_dense()))
    return [head, *body]


def encode_frame(
    delta: TensorDelta, level: int, base_bits: Bits | None = None
) -> tuple[int, int, bytes]:
    """(coding, count, frame) for one tensor: the smallest of the codings it may use. Coding 3
    needs the base's bits; without them (or for a dtype with no exponent) it is not tried."""
    return _frames(delta, level, base_bits)[0]


Frame = tuple[int, int, bytes]


def _frames(delta: TensorDelta, level: int, base_bits: Bits | None) -> tuple[Frame, Frame]:
    """(the smallest frame, the smallest of the version-1 codings): the same when coding 3
    does not win."""
    count = delta.count
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


def _decompress(frame: memoryview, bound: int, name: str, limits: CodecLimits) -> memoryview:
    """The frame's bytes, unpacked only if it declares at most ``bound`` of them (what its row
    allows) and at most ``max_expansion`` times its own size: the output is allocated whole."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CorruptFrameError(f"{name}: not a zstd frame ({exc})") from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) or size > bound:
        raise MalformedPatchError(f"{name}: frame declares {size} bytes, at most {bound} possible")
    if size > limits.max_expansion * len(frame):
        raise MalformedPatchError(
            f"{name}: a {len(frame)}-byte frame declares {size} bytes, more than "
            f"{limits.max_expansion}x its size"
        )
    try:
        return memoryview(zstandard.ZstdDecompressor().decompress(frame, max_output_size=size))
    except zstandard.ZstdError as exc:
        raise CorruptFrameError(f"{name}: frame is corrupt ({exc})") from None


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


def _check_position_body(body: memoryview, n: int, numel: int, n_esc: int, name: str) -> None:
    """Every check :func:`_decode_position_body` makes, without building the positions
    (O(n) bytes of temporaries, not 8 per entry): the escape markers, and the last position
    (the gaps' sum) inside the tensor."""
    lo = np.frombuffer(body, np.uint8, n)
    hi = np.frombuffer(body, np.uint8, n, n)
    kernels = _kernels()
    if kernels["fast"]:  # one pass over the planes, not five
        marks, total = kernels["gap_stats"](lo, hi)
    else:
        marks = int(np.count_nonzero((lo == 0xFF) & (hi == 0xFF)))
        total = int(lo.sum(dtype=np.int64)) + 256 * int(hi.sum(dtype=np.int64))
    if marks != n_esc:
        raise CountMismatchError(f"{name}: {marks} gap escape markers, header says {n_esc}")
    big = np.frombuffer(body, f"<u{_escape_width(numel)}", n_esc, 2 * n)
    if n_esc and int(big.max()) >= numel:
        raise IndexOutOfRangeError(f"{name}: a position gap exceeds the tensor's {numel} elements")
    last = total - _GAP_ESCAPE * n_esc + int(big.sum(dtype=np.uint64)) + n - 1
    if n and last >= numel:
        raise IndexOutOfRangeError(f"{name}: position {last} outside a tensor of {numel} elements")


def _position_blocks(
    body: memoryview, n: int, numel: int, n_esc: int, block: int
) -> Iterator[tuple[int, np.ndarray]]:
    """The positions of a checked body (:func:`_check_position_body`), ``block`` at a time:
    (index of the first, positions)."""
    big = np.frombuffer(body, f"<u{_escape_width(numel)}", n_esc, 2 * n)
    kernels = _kernels()
    kernel = kernels["gaps"] if kernels["fast"] else None
    used, last = 0, -1
    for i in range(0, n, block):
        j = min(n, i + block)
        lo = np.frombuffer(body, np.uint8, j - i, i)
        hi = np.frombuffer(body, np.uint8, j - i, n + i)
        pos = np.empty(j - i, np.int64)
        if kernel is not None:  # one pass (numpy takes seven over 8-byte temporaries)
            used = kernel(lo, hi, big, used, last, pos)
        else:
            pos[:] = hi
            pos <<= 8
            pos |= lo
            marks = np.flatnonzero(pos == _GAP_ESCAPE)
            pos[marks] = big[used : used + marks.size]
            used += marks.size
            pos += 1
            pos[0] += last
            np.cumsum(pos, out=pos)
        last = int(pos[-1])
        yield i, pos


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
    escapes, the last position in range), so a frame that fails to decode fails before
    anything is applied. Other codings come whole. ``block``: :data:`BLOCK` when None."""
    block = block or BLOCK
    if row.coding != SPARSE or row.count <= block:
        yield decode_frame(row, frame, base_bits, limits)
        return
    spec, n = row.spec, row.count
    raw = _decompress(frame, _frame_bound(row), spec.name, limits)
    body, n_esc, d = _sparse_bodies(raw, spec, n)
    _check_position_body(body, n, spec.numel, n_esc, spec.name)
    deltas = torch.from_numpy(d).view(bits_dtype(spec.dtype))
    for i, pos in _position_blocks(body, n, spec.numel, n_esc, block):
        yield TensorDelta(spec, torch.from_numpy(pos), deltas[i : i + pos.size])


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
    """Decode and fully validate one tensor's frame (coding 3 needs the base's bits)."""
    raw = _decompress(frame, _frame_bound(row), row.spec.name, limits)
    if row.coding == CLASSED:
        if base_bits is None:
            raise MissingBaseError(f"{row.spec.name}: exponent-class frame needs the base weights")
        return _decode_classed(raw, row.spec, row.count, base_bits)
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


def encode(
    patch: Patch,
    level: int = DEFAULT_LEVEL,
    workers: int = 1,
    base: TensorSet | None = None,
    base_hash: bytes | None = None,
) -> bytes:
    """Serialize ``patch``; with ``workers > 1`` tensor frames are compressed in parallel.

    With ``base`` (the weights the patch applies to, read only) float tensors may take the
    exponent-class coding (format version 2); without it every frame is a version-1 coding, as
    is the file. ``base_hash``: the caller's record of ``base``'s state hash, if it has one.
    """
    patch.validate()
    if base is not None:
        _check_base(base, patch.layout, patch.base_hash, base_hash)
    changed = [patch.deltas[s.name] for s in patch.layout if s.name in patch.deltas]
    pairs = map_workers(lambda d: _frames(d, level, _base_bits(base, d.spec)), changed, workers)
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


def _table(layout: Layout, frames: Frames, level: int) -> tuple[bytes, int]:
    """The file's row table: compressed, and its raw length."""
    rows = []
    for spec in layout:
        coding, count, frame = frames.get(spec.name, (UNCHANGED, 0, b""))
        rows.append(_row_bytes(spec, coding, count, len(frame)))
    table_raw = b"".join(rows)
    return _compress([table_raw], level), len(table_raw)


def _file_size(frames: Frames, table: tuple[bytes, int]) -> int:
    """The length of :func:`_join`'s file, without joining it."""
    return HEADER_SIZE + len(table[0]) + sum(len(f[2]) for f in frames.values())


def _join(
    layout: Layout, base_hash: bytes, target_hash: bytes, frames: Frames, table: tuple[bytes, int]
) -> bytes:
    version = 2 if any(f[0] == CLASSED for f in frames.values()) else 1
    header = _HEADER.pack(
        MAGIC,
        version,
        0,
        len(layout),
        len(table[0]),
        table[1],
        layout_fingerprint(layout),
        base_hash,
        target_hash,
    )
    return b"".join([header, table[0], *(frames[s.name][2] for s in layout if s.name in frames)])


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


def _check_row(
    spec: TensorSpec, coding: int, count: int, size: int, limits: CodecLimits, version: int
) -> None:
    if spec.numel > limits.max_tensor_elements:
        raise MalformedPatchError(f"{spec.name}: {spec.numel} elements exceed the limit")
    if coding not in CODINGS_BY_VERSION[version]:
        raise UnsupportedFormatError(f"{spec.name}: unknown coding {coding} in format {version}")
    if coding == CLASSED and not classed_dtype(spec.dtype):
        raise MalformedPatchError(f"{spec.name}: coding 3 needs a float dtype, not {spec.dtype}")
    if count > spec.numel:
        raise CountMismatchError(f"{spec.name}: {count} changes in {spec.numel} elements")
    if (coding == UNCHANGED) != (count == 0) or (coding == UNCHANGED) != (size == 0):
        raise CountMismatchError(f"{spec.name}: coding {coding} with count {count}, size {size}")
    if _least_content(spec, coding, count) > limits.max_expansion * size:
        raise MalformedPatchError(
            f"{spec.name}: {count} changes in {spec.numel} elements cannot be coded in "
            f"{size} bytes (a frame unpacks to at most {limits.max_expansion}x its size)"
        )


def _least_content(spec: TensorSpec, coding: int, count: int) -> int:
    """The fewest bytes a frame of this row unpacks to: 2 per change (the gap planes) for a
    sparse frame, half a byte per element for a dense one (coding 3 needs the base, whose
    size bounds it: 0 here)."""
    if coding == SPARSE:
        return 2 * count
    if coding == DENSE:
        return spec.numel // 2
    return 0


def _read_table(data: memoryview, n: int, zsize: int, rawsize: int, limits: CodecLimits) -> bytes:
    if n > limits.max_tensors or rawsize > limits.max_table_bytes:
        raise MalformedPatchError(f"table of {n} tensors / {rawsize} bytes exceeds the limits")
    if len(data) < HEADER_SIZE + zsize:
        raise TruncatedPatchError(
            f"patch is {len(data)} bytes, its table ends at {HEADER_SIZE + zsize}"
        )
    table = _decompress(data[HEADER_SIZE : HEADER_SIZE + zsize], rawsize, "tensor table", limits)
    if len(table) != rawsize:
        raise MalformedPatchError(f"table is {len(table)} bytes, header says {rawsize}")
    return bytes(table)


def _parse_rows(
    table: bytes, n: int, first_offset: int, limits: CodecLimits, version: int
) -> list[FrameInfo]:
    reader, rows, offset, prev = _Reader(table), [], first_offset, None
    for _ in range(n):
        spec, coding, count, size = _parse_row(reader, limits)
        _check_row(spec, coding, count, size, limits, version)
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
    rows = _parse_rows(table, n, HEADER_SIZE + zsize, limits, version)
    if layout_fingerprint(tuple(r.spec for r in rows)) != fp:
        raise MalformedPatchError("table layout does not match the header's fingerprint")
    end = rows[-1].offset + rows[-1].size if rows else HEADER_SIZE + zsize
    if len(data) < end:
        raise TruncatedPatchError(f"patch is {len(data)} bytes, its frames end at {end}")
    if len(data) > end:
        raise TrailingDataError(f"{len(data) - end} unexpected bytes after the last frame")
    return PatchInfo(version, fp, base, target, tuple(rows), len(data))


def _decode_rows(
    data: memoryview,
    rows: list[FrameInfo],
    workers: int,
    base: TensorSet | None,
    limits: CodecLimits,
) -> list[TensorDelta]:
    def one(row: FrameInfo) -> TensorDelta:
        bits = _base_bits(base, row.spec) if row.coding == CLASSED else None
        return decode_frame(row, data[row.offset : row.offset + row.size], bits, limits)

    return map_workers(one, rows, workers)


def check_without_base(data: bytes | memoryview, limits: CodecLimits = CodecLimits()) -> list[str]:
    """Verify everything in a patch that needs no base: the header, the table, every frame's
    zstd checksum and structure, sparse and dense frames in full, and the position codes of
    exponent-class frames. Returns the names of those frames: which elements their codes
    select, and their values, can only be checked against the base's bits."""
    data = memoryview(data)
    need: list[str] = []
    for row in read_header(data, limits).rows:
        frame = data[row.offset : row.offset + row.size]
        if row.coding == UNCHANGED:
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
    if any(r.coding == CLASSED for r in changed):
        if base is None:
            raise MissingBaseError("patch has exponent-class frames: decoding needs its base")
        _check_base(base, info.layout, info.base_hash, base_hash)
    else:
        base = None
    deltas = _decode_rows(data, changed, workers, base, limits)
    return Patch(info.layout, info.base_hash, info.target_hash, {d.spec.name: d for d in deltas})
