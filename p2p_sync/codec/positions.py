"""Position coding: sorted flat positions as 16-bit gap byte planes plus escapes.

Encoding, whole and block-wise decoding, and the checks that keep every position inside its
tensor before any is built (docs/format.md, "Position coding").
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import _GAP_ESCAPE, _SPARSE_HEAD
from p2p_sync.codec.values import _check_size, _planes
from p2p_sync.errors import CountMismatchError, IndexOutOfRangeError


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
