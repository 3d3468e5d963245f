"""Exponent classes of a base tensor (coding 3): membership, ranks and their inverse.

Which class each base element falls in, the rank of a changed element among its class's
members (encode) and the element a rank names (decode): by the compiled scans, by word-parallel
numpy without numba, or by torch on the base's own device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from p2p_sync.codec import device_scans
from p2p_sync.codec.device_scans import Selected
from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import MANTISSA_BITS, N_CLASSES

# A base tensor's bit patterns as the class scans take them: numpy on the host, torch on a GPU.
Bits = np.ndarray | torch.Tensor


# _SEL8[b, j]: the bit index of the j-th set bit of byte b (0 where b has fewer set bits).
_SEL8 = np.zeros((256, 8), dtype=np.uint8)
for _b in range(256):
    for _j, _bit in enumerate(i for i in range(8) if _b >> i & 1):
        _SEL8[_b, _j] = _bit


def classed_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can be coded by exponent class (coding 3)."""
    return dtype in MANTISSA_BITS


def segmented_dtype(dtype: torch.dtype) -> bool:
    """Whether coding 4 can carry a tensor of ``dtype``: a float of at most 4 bytes (its
    magnitudes then fit the 48 raw bits of a capped Rice code with room to spare)."""
    return dtype in MANTISSA_BITS and dtype.itemsize <= 4


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
