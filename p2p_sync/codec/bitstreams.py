"""Capped Rice codes as two bit streams, packed and read by whole-tensor torch ops.

Coding 4 (docs/format.md, "Format version 3") keeps every code's quotient in a unary stream
and its low bits in a remainder stream, so both are written and read without a loop over codes:
the unary stream's one bits end the codes, the remainders' offsets are a prefix sum of their
widths. The same ops run on the host and on a GPU and give the same bytes.
"""

from __future__ import annotations

import torch

from p2p_sync.errors import CountMismatchError, MalformedPatchError

# A quotient of QCAP or more is written as QCAP zeros and a one, its value raw in RAW bits: a
# far outlier (a sign flip near zero, an empty stretch of a class) costs 81 bits, not millions.
QCAP = 32
RAW = 48
MAX_K = 40


def _weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 entries packed LSB first, zero-padded to a whole byte."""
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _weights(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits` (every bit, padding included)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data.view(-1, 1) >> shifts) & 1).view(-1)


def widths(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Remainder bits of each code: its parameter, or RAW for a capped one."""
    return torch.where(q >= QCAP, RAW, k)


def rice_cost(values: torch.Tensor, k: int) -> int:
    """Bits the capped Rice code with parameter ``k`` spends on ``values``."""
    q = values >> k
    capped = q >= QCAP
    return int(torch.where(capped, QCAP + 1 + RAW, q + 1 + k).sum())


def best_k(values: torch.Tensor) -> int:
    """The parameter among five around log2 of the mean that spends the fewest bits (ties to
    the smaller): the optimum for a geometric source lies there."""
    if values.numel() == 0:
        return 0
    mean = float(values.sum()) / values.numel()
    guess = max(0, int(torch.tensor(mean + 1.0).log2()))
    candidates = [k for k in range(guess - 2, guess + 3) if 0 <= k <= MAX_K]
    return min(candidates, key=lambda k: (rice_cost(values, k), k))


def encode(values: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unary stream, remainder stream) of non-negative int64 ``values``, each with its own
    parameter ``k`` (int64, same length)."""
    q = values >> k
    capped = q >= QCAP
    q = torch.where(capped, QCAP, q)
    w = torch.where(capped, RAW, k)
    low = torch.where(capped, values, values & ((1 << k) - 1))
    ends = torch.cumsum(q + 1, 0) - 1
    unary = values.new_zeros(int(ends[-1]) + 1 if ends.numel() else 0, dtype=torch.uint8)
    unary[ends] = 1
    return pack_bits(unary), pack_bits(_fields(low, w))


def _fields(low: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bits of every field ``low`` (``w`` bits each, LSB first) back to back."""
    starts = torch.cumsum(w, 0) - w
    total = int(w.sum()) if w.numel() else 0
    bits = low.new_zeros(total, dtype=torch.uint8)
    live = torch.nonzero(w > 0).view(-1)
    j = 0
    while live.numel():
        bits[starts[live] + j] = ((low[live] >> j) & 1).to(torch.uint8)
        j += 1
        live = live[w[live] > j]
    return bits


def quotients(unary: torch.Tensor, name: str) -> torch.Tensor:
    """Every code's quotient (as many as the stream has one bits); after the last one only
    fewer than 8 zero bits may follow, and no quotient exceeds the cap."""
    ones = torch.nonzero(unpack_bits(unary)).view(-1)
    count = ones.numel()
    if (count and int(ones[-1]) < unary.numel() * 8 - 8) or (not count and unary.numel()):
        raise MalformedPatchError(f"{name}: unary stream runs on past its last code")
    q = torch.diff(ones, prepend=ones.new_tensor([-1])) - 1
    if q.numel() and int(q.max()) > QCAP:
        raise MalformedPatchError(f"{name}: a unary code runs past the cap of {QCAP}")
    return q


def read_fields(data: torch.Tensor, start: int, w: torch.Tensor, name: str) -> torch.Tensor:
    """Fields of widths ``w`` read back to back from bit ``start`` of ``data`` (uint8)."""
    offsets = torch.cumsum(w, 0) - w + start
    end = start + (int(w.sum()) if w.numel() else 0)
    if end > data.numel() * 8:
        raise CountMismatchError(f"{name}: remainder stream ends inside its fields")
    padded = torch.cat([data, data.new_zeros(8)]).to(torch.int64)
    byte = offsets >> 3
    word = torch.zeros_like(offsets)
    for i in range(7):  # 7 bytes hold any field: its 7-bit offset plus at most RAW = 48 bits
        word |= padded[byte + i] << (8 * i)
    return (word >> (offsets & 7)) & ((1 << w) - 1)


def check_end(data: torch.Tensor, total: int, name: str) -> None:
    """A stream of ``total`` bits fills ``data`` up to its last byte's zero padding."""
    if data.numel() != (total + 7) // 8:
        raise CountMismatchError(f"{name}: a stream is {data.numel()} bytes, its codes {total} bits")
    if total % 8 and int(data[-1]) >> (total % 8):
        raise MalformedPatchError(f"{name}: a stream pads its last byte with one bits")


def decode(q: torch.Tensor, k: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Values from quotients, parameters and remainders; a capped code must need its cap (one
    value, one code), so a stream decodes to one file only."""
    capped = q == QCAP
    if bool(torch.any(capped & ((low >> k) < QCAP))):
        raise MalformedPatchError("a raw Rice code holds a value its parameter codes in short")
    return torch.where(capped, low, (q << k) | low)
