"""Value coding: deltas as narrow packed integers plus full-width escapes.

Bit planes, nibbles and 2-bit crumbs, the width that minimises a stream, and the exact-size
checks a decoder makes (docs/format.md, "Value coding").
"""

from __future__ import annotations

import numpy as np

from p2p_sync.codec.limits import _VALUE_HEAD, VALUE_BITS
from p2p_sync.errors import CountMismatchError, MalformedPatchError


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
