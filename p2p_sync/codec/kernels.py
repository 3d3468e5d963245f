"""Host kernels of the codec: one-pass loops that numba compiles on first use.

Gap planes, class rank and select scans, Rice coding and gathers. Each is a plain Python
function (its steps marked with :func:`jit.step`); :func:`_kernels` hands out the compiled
forms, or ``fast=False`` so callers take their word-parallel numpy paths instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from p2p_sync import jit
from p2p_sync.codec.limits import _GAP_ESCAPE
from p2p_sync.codec.rice_kernels import (
    _escape_codes_py,
    _gather_codes_py,
    _read_counts_py,
    _read_rest_py,
    _rice_costs_py,
    _rice_size_py,
    _rice_write_py,
    _segment_select_py,
)


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


# Class scans (one pass). Coding 3 needs, for every changed element, its rank among the base
# elements of its class, and the decoder the inverse. Both are one sequential pass over the base
# with 16 counters; compiled by numba this costs ~1 ns per element. Without numba the same
# results come from word-parallel numpy (class_map + class_ranks/class_select in classes.py),
# several times slower.


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
                "rice_write": _rice_write_py,
                "rice_costs": _rice_costs_py,
                "rice_size": _rice_size_py,
                "segment_counts": _read_counts_py,
                "segment_codes": _read_rest_py,
                "segment_select": _segment_select_py,
                "gather_codes": _gather_codes_py,
                "escape_codes": _escape_codes_py,
            }
        )
        _KERNELS.update(compiled or {}, fast=compiled is not None)
    return _KERNELS


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
