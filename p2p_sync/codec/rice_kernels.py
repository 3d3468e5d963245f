"""Host kernels of coding 4's capped Rice codes: one pass over the codes, numba-compiled.

The host twin of :mod:`p2p_sync.codec.bitstreams` (whole-tensor torch ops, for a GPU): a
sequential loop costs a few nanoseconds a code on a CPU, where the torch ops' gathers cost ten
times that. Both write the same bytes and read the same values (tests compare them).
"""

from __future__ import annotations

import numpy as np

from p2p_sync import jit
from p2p_sync.codec.limits import QCAP, RAW

# rice_read's status codes
READ_OK, UNARY_ENDS, PAST_CAP, FIELDS_END, NOT_CANONICAL = 0, 1, 2, 3, 4


@jit.step
def _put_bits(out: np.ndarray, bit: int, value: int, width: int) -> int:
    """OR ``width`` low bits of ``value`` into ``out`` from bit ``bit`` on (LSB first)."""
    while width > 0:
        shift = bit & 7
        take = min(8 - shift, width)
        out[bit >> 3] |= np.uint8((value & ((1 << take) - 1)) << shift)
        value >>= take
        bit += take
        width -= take
    return bit


@jit.step
def _get_bits(data: np.ndarray, bit: int, width: int) -> int:
    """``width`` bits of ``data`` from bit ``bit`` on, LSB first."""
    value, got = 0, 0
    while got < width:
        shift = bit & 7
        take = min(8 - shift, width - got)
        value |= ((np.int64(data[bit >> 3]) >> shift) & ((1 << take) - 1)) << got
        bit += take
        got += take
    return value


def _rice_size_py(values: np.ndarray, cls: np.ndarray, k: np.ndarray) -> tuple[int, int]:
    """Kernel: (unary bits, remainder bits) of the values' capped Rice codes, value i with
    parameter ``k[cls[i]]``."""
    ubits, rbits = 0, 0
    for i in range(values.size):
        kk = k[cls[i]]
        q = values[i] >> kk
        capped = q >= QCAP
        ubits += (QCAP if capped else q) + 1
        rbits += RAW if capped else kk
    return ubits, rbits


def _rice_write_py(
    values: np.ndarray,
    cls: np.ndarray,
    k: np.ndarray,
    unary: np.ndarray,
    rem: np.ndarray,
    at: np.ndarray,
) -> None:
    """Kernel: the values' capped Rice codes (value i with parameter ``k[cls[i]]``), the unary
    parts into ``unary`` and the low bits into ``rem`` (zeroed and sized by the caller) from
    bits ``at[0]`` and ``at[1]`` on, which it moves past them."""
    ubit, rbit = at[0], at[1]
    for i in range(values.size):
        v, kk = values[i], k[cls[i]]
        q = v >> kk
        if q >= QCAP:
            q, width, low = QCAP, RAW, v
        else:
            width, low = kk, v & ((1 << kk) - 1)
        ubit += q
        unary[ubit >> 3] |= np.uint8(1 << (ubit & 7))
        ubit += 1
        rbit = _put_bits(rem, rbit, low, width)
    at[0], at[1] = ubit, rbit


@jit.step
def _quotient(unary: np.ndarray, bit: int) -> tuple[int, int]:
    """(zeros before the next one bit, the bit after it), or (-1, bit) when the stream ends."""
    q, nbits = 0, unary.size * 8
    while bit < nbits:
        byte = np.int64(unary[bit >> 3]) >> (bit & 7)
        if byte == 0:
            q += 8 - (bit & 7)
            bit += 8 - (bit & 7)
            continue
        while not byte & 1:
            byte >>= 1
            q += 1
            bit += 1
        return q, bit + 1
    return -1, bit


def _rice_costs_py(
    values: np.ndarray, cls: np.ndarray, options: np.ndarray, cost: np.ndarray
) -> None:
    """Kernel: ``cost[o, c]`` += the bits of the capped Rice code with parameter
    ``options[o, c]`` over class c's values (``cls``: each value's class)."""
    for i in range(values.size):
        v, c = values[i], cls[i]
        for o in range(options.shape[0]):
            k = options[o, c]
            q = v >> k
            cost[o, c] += QCAP + 1 + RAW if q >= QCAP else q + 1 + k


# _segments_read's status codes past the Rice ones
COUNTS_OVER, ESCAPES_OVER, RANK_PAST, INDEX_PAST = 5, 6, 7, 8


@jit.step
def _read_one(unary: np.ndarray, rem: np.ndarray, k: int, at: np.ndarray) -> tuple[int, int]:
    """(status, value) of the next code: ``at`` holds the two streams' read positions."""
    q, ubit = _quotient(unary, at[0])
    if q < 0:
        return UNARY_ENDS, 0
    if q > QCAP:
        return PAST_CAP, 0
    width = RAW if q == QCAP else k
    if at[1] + width > rem.size * 8:
        return FIELDS_END, 0
    low = _get_bits(rem, at[1], width)
    at[0], at[1] = ubit, at[1] + width
    if q == QCAP:
        return (NOT_CANONICAL, 0) if (low >> k) < QCAP else (READ_OK, low)
    return READ_OK, (q << k) | low


def _read_counts_py(
    unary: np.ndarray,
    rem: np.ndarray,
    k: np.ndarray,
    sizes: np.ndarray,
    groups: np.ndarray,
    at: np.ndarray,
) -> int:
    """Kernel: every group's change count (codes 1), each segment's within its length."""
    for g in range(sizes.size):
        total = 0
        for c in range(16):
            status, v = _read_one(unary, rem, k[c, 0], at)
            if status:
                return status
            total += v
            if total > sizes[g]:
                return COUNTS_OVER
            groups[g * 16 + c] = v
    return READ_OK


@jit.step
def _read_escapes(
    unary: np.ndarray,
    rem: np.ndarray,
    k: np.ndarray,
    wide: np.ndarray,
    groups: np.ndarray,
    at: np.ndarray,
    escapes: np.ndarray,
) -> int:
    """Escape counts (codes 2): each narrow class's group that changes."""
    for gc in range(groups.size):
        if groups[gc] and not wide[gc & 15]:
            status, e = _read_one(unary, rem, k[gc & 15, 1], at)
            if status:
                return status
            if e > groups[gc]:
                return ESCAPES_OVER
            escapes[gc] = e
    return READ_OK


def _read_rest_py(
    unary: np.ndarray,
    rem: np.ndarray,
    k: np.ndarray,
    wide: np.ndarray,
    sizes: np.ndarray,
    groups: np.ndarray,
    at: np.ndarray,
    rank: np.ndarray,
    mag: np.ndarray,
) -> int:
    """Kernel: escape counts, rank gaps, escape gaps and magnitudes (codes 2-5) into each
    change's class rank and magnitude, in code order."""
    escapes = np.zeros(groups.size, np.int64)
    status = _read_escapes(unary, rem, k, wide, groups, at, escapes)
    if status:
        return status
    limits = np.empty(groups.size, np.int64)  # a rank lies below its segment's length
    for gc in range(groups.size):
        limits[gc] = sizes[gc >> 4]
    status = _read_runs(unary, rem, k, 2, groups, limits, at, rank, RANK_PAST)
    if status:
        return status
    index = np.empty(escapes.sum(), np.int64)  # an escape index lies below its group's size
    status = _read_runs(unary, rem, k, 3, escapes, groups, at, index, INDEX_PAST)
    if status:
        return status
    _mark_escapes(groups, escapes, index, mag)
    return _read_magnitudes(unary, rem, k, wide, groups, at, mag)


@jit.step
def _read_runs(
    unary: np.ndarray,
    rem: np.ndarray,
    k: np.ndarray,
    stream: int,
    counts: np.ndarray,
    limits: np.ndarray,
    at: np.ndarray,
    out: np.ndarray,
    past: int,
) -> int:
    """Per group, its ``counts`` gap codes (parameter ``k[class, stream]``) as ascending values
    from 0, each below the group's ``limits``, into ``out`` back to back; ``past`` when not."""
    i = 0
    for gc in range(counts.size):
        r = -1
        for _ in range(counts[gc]):
            status, gap = _read_one(unary, rem, k[gc & 15, stream], at)
            if status:
                return status
            r += gap + 1
            if r >= limits[gc]:
                return past
            out[i] = r
            i += 1
    return READ_OK


@jit.step
def _mark_escapes(
    groups: np.ndarray, escapes: np.ndarray, index: np.ndarray, mag: np.ndarray
) -> None:
    """Each escaped change's magnitude is marked -1 (``index``: within its group)."""
    first, j = 0, 0
    for gc in range(groups.size):
        for _ in range(escapes[gc]):
            mag[first + index[j]] = -1
            j += 1
        first += groups[gc]


@jit.step
def _read_magnitudes(
    unary: np.ndarray,
    rem: np.ndarray,
    k: np.ndarray,
    wide: np.ndarray,
    groups: np.ndarray,
    at: np.ndarray,
    mag: np.ndarray,
) -> int:
    """Magnitudes (codes 5): a wide class's every change, a narrow class's marked ones; the
    rest are 1."""
    i = 0
    for gc in range(groups.size):
        c = gc & 15
        for _ in range(groups[gc]):
            if wide[c] or mag[i] < 0:
                status, v = _read_one(unary, rem, k[c, 4], at)
                if status:
                    return status
                mag[i] = v + (1 if wide[c] else 2)
            else:
                mag[i] = 1
            i += 1
    return READ_OK


_NEVER = 1 << 62  # a class without (more) codes in the segment: its skip never runs out


@jit.step
def _segment_start(
    lo: int,
    hi: int,
    cls: np.ndarray,
    rank: np.ndarray,
    nxt: np.ndarray,
    end: np.ndarray,
    skip: np.ndarray,
) -> None:
    """Point every class at its first code in ``lo:hi``; ``skip``: its members to pass
    before the one that code names."""
    for c in range(16):
        nxt[c], end[c], skip[c] = hi, hi, _NEVER
    for j in range(hi - 1, lo - 1, -1):
        nxt[cls[j]] = j
    for j in range(lo, hi):
        end[cls[j]] = j + 1
    for c in range(16):
        if nxt[c] < end[c]:
            skip[c] = rank[nxt[c]]


@jit.step
def _segment_walk(
    u: np.ndarray,
    shift: int,
    start: int,
    stop: int,
    rank: np.ndarray,
    state: tuple,
    out: tuple,
    k: int,
    left: int,
) -> tuple[int, int]:
    """Walk ``u[start:stop]``: an element whose class's skip ran out is the one its next code
    names (others cost a decrement). Returns (emitted so far, codes left in the segment)."""
    nxt, end, skip = state
    out_pos, out_code = out
    for p in range(start, stop):
        c = (u[p] >> shift) & 15
        r = skip[c]
        if r:
            skip[c] = r - 1
            continue
        j = nxt[c]
        out_pos[k], out_code[k] = p, j
        k += 1
        nxt[c] = j + 1
        skip[c] = rank[j + 1] - rank[j] - 1 if j + 1 < end[c] else _NEVER
        left -= 1
        if left == 0:
            break
    return k, left


def _segment_select_py(
    u: np.ndarray,
    shift: int,
    span: int,
    bounds: np.ndarray,
    cls: np.ndarray,
    rank: np.ndarray,
    out_pos: np.ndarray,
    out_code: np.ndarray,
) -> int:
    """Kernel: the element each code names (codes by segment, class, rank; segment g's are
    ``bounds[g]:bounds[g+1]``; segments without one are not read), in position order with
    the code's index. Returns the count, or -1 when a rank lies past its class's members."""
    k, n = 0, u.size
    table = np.empty((3, 16), np.int64)
    state = (table[0], table[1], table[2])
    for g in range(bounds.size - 1):
        lo, hi = bounds[g], bounds[g + 1]
        if lo == hi:
            continue
        _segment_start(lo, hi, cls, rank, state[0], state[1], state[2])
        start = g << span
        stop = min(n, start + (1 << span))
        k, left = _segment_walk(u, shift, start, stop, rank, state, (out_pos, out_code), k, hi - lo)
        if left:
            return -1
    return k


def _gather_codes_py(
    key: np.ndarray,
    rank: np.ndarray,
    d: np.ndarray,
    cursor: np.ndarray,
    gap: np.ndarray,
    mag: np.ndarray,
    neg: np.ndarray,
) -> None:
    """Kernel: changes from position order into code order (a stable counting sort by group
    from ``cursor``, each group's first index, moved along): rank gaps within the group,
    magnitudes and signs of the deltas."""
    prev = np.full(cursor.size, -1, np.int64)
    for i in range(key.size):
        gc = key[i]
        j = cursor[gc]
        cursor[gc] = j + 1
        gap[j] = rank[i] - prev[gc] - 1
        prev[gc] = rank[i]
        v = np.int64(d[i])  # widened first: -(-32768) does not fit an int16
        mag[j] = -v if v < 0 else v
        neg[j] = v < 0


def _escape_codes_py(
    groups: np.ndarray, mag: np.ndarray, counts: np.ndarray, gaps: np.ndarray
) -> int:
    """Kernel: per group the changes whose magnitude is not 1 (``counts``) and their index
    gaps within the group (``gaps``, back to back). Returns how many in all."""
    i, e = 0, 0
    for gc in range(groups.size):
        last, start = -1, e
        for t in range(groups[gc]):
            if mag[i] != 1:
                gaps[e] = t - last - 1
                last = t
                e += 1
            i += 1
        counts[gc] = e - start
    return e
