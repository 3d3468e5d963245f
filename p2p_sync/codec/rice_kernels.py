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


def _rice_write_py(values: np.ndarray, k: np.ndarray, unary: np.ndarray, rem: np.ndarray) -> None:
    """Kernel: every value's capped Rice code, the unary part into ``unary``, the low bits into
    ``rem`` (both zeroed and sized by the caller)."""
    ubit, rbit = 0, 0
    for i in range(values.size):
        v, kk = values[i], k[i]
        q = v >> kk
        if q >= QCAP:
            q, width, low = QCAP, RAW, v
        else:
            width, low = kk, v & ((1 << kk) - 1)
        ubit += q
        unary[ubit >> 3] |= np.uint8(1 << (ubit & 7))
        ubit += 1
        rbit = _put_bits(rem, rbit, low, width)


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


def _rice_read_py(
    unary: np.ndarray, rem: np.ndarray, k: np.ndarray, at: np.ndarray, out: np.ndarray
) -> int:
    """Kernel: ``k.size`` values from the streams, reading from bits ``at[0]`` (unary) and
    ``at[1]`` (remainders), which it moves past them. Returns a status code (READ_OK...)."""
    ubit, rbit, rbits = at[0], at[1], rem.size * 8
    for i in range(k.size):
        q, ubit = _quotient(unary, ubit)
        if q < 0:
            return UNARY_ENDS
        if q > QCAP:
            return PAST_CAP
        width = RAW if q == QCAP else k[i]
        if rbit + width > rbits:
            return FIELDS_END
        low = _get_bits(rem, rbit, width)
        rbit += width
        if q == QCAP:
            if (low >> k[i]) < QCAP:
                return NOT_CANONICAL
            out[i] = low
        else:
            out[i] = (q << k[i]) | low
    at[0], at[1] = ubit, rbit
    return READ_OK


def _rice_costs_py(values: np.ndarray, cls: np.ndarray, options: np.ndarray, cost: np.ndarray) -> None:
    """Kernel: ``cost[o, c]`` += the bits of the capped Rice code with parameter
    ``options[o, c]`` over class c's values (``cls``: each value's class)."""
    for i in range(values.size):
        v, c = values[i], cls[i]
        for o in range(options.shape[0]):
            k = options[o, c]
            q = v >> k
            cost[o, c] += QCAP + 1 + RAW if q >= QCAP else q + 1 + k
