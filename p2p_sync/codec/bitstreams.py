"""Capped Rice codes as two bit streams, packed and read by whole-tensor torch ops.

Coding 4 (docs/format.md, "Format version 3") keeps every code's quotient in a unary stream
and its low bits in a remainder stream, so both are written and read without a loop over codes:
the unary stream's one bits end the codes, the remainders' offsets are a prefix sum of their
widths. The same ops run on the host and on a GPU and give the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import MAX_K, QCAP, RAW
from p2p_sync.errors import CountMismatchError, MalformedPatchError


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


def best_k(
    values: torch.Tensor, cls: torch.Tensor, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class (``cls``: each value's, below ``classes``), the capped-Rice parameter that
    spends the fewest bits on its values, and those bits (int64 each). The five candidates lie
    around log2 of the class's mean, where the optimum for a geometric source is; ties go to
    the smaller parameter."""
    count = torch.bincount(cls, minlength=classes).to(torch.float64)
    total = torch.bincount(cls, weights=values.to(torch.float64), minlength=classes)
    guess = torch.log2(total / count.clamp(min=1) + 1).floor().to(torch.int64)
    options = (guess[None, :] + torch.arange(-2, 3, device=guess.device)[:, None]).clamp(0, MAX_K)
    if values.device.type == "cpu" and _kernels()["fast"]:
        cost = torch.zeros(options.shape, dtype=torch.int64)
        _kernels()["rice_costs"](values.numpy(), cls.numpy(), options.numpy(), cost.numpy())
    else:
        cost = torch.stack([_cost(values, cls, row, classes) for row in options])
    pick = torch.argmin(cost, 0)
    best = torch.arange(classes, device=cls.device)
    return options[pick, best], cost[pick, best].to(torch.int64)


def _cost(values: torch.Tensor, cls: torch.Tensor, k: torch.Tensor, classes: int) -> torch.Tensor:
    """Bits per class of the capped Rice code, each class with its parameter ``k[class]``."""
    kv = k[cls]
    q = values >> kv
    bits = torch.where(q >= QCAP, QCAP + 1 + RAW, q + 1 + kv)
    return torch.bincount(cls, weights=bits.to(torch.float64), minlength=classes)


Parts = list[tuple[torch.Tensor, torch.Tensor]]


def encode(parts: Parts, ks: list[torch.Tensor], host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(unary stream, remainder stream) of ``parts`` one after the other: part i holds
    non-negative int64 values and each one's class, coded with parameter ``ks[i][class]``. By
    the compiled kernels (``host``: no per-code array is built) or by torch ops."""
    if host:
        return _encode_host(parts, ks)
    values = torch.cat([v for v, _ in parts])
    k = torch.cat([kt.to(cls.device)[cls] for (_, cls), kt in zip(parts, ks, strict=True)])
    return encode_ops(values, k)


def _encode_host(parts: Parts, ks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    kernels, arrays = (
        _kernels(),
        [(v.numpy(), c.numpy(), k.numpy()) for (v, c), k in zip(parts, ks)],
    )
    sizes = [kernels["rice_size"](*a) for a in arrays]
    unary = np.zeros((sum(u for u, _ in sizes) + 7) // 8, np.uint8)
    rem = np.zeros((sum(r for _, r in sizes) + 7) // 8, np.uint8)
    at = np.zeros(2, np.int64)
    for values, cls, k in arrays:
        kernels["rice_write"](values, cls, k, unary, rem, at)
    return torch.from_numpy(unary), torch.from_numpy(rem)


def encode_ops(values: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` by whole-tensor torch ops, on the values' device."""
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


def check_end(data: torch.Tensor | np.ndarray, total: int, name: str) -> None:
    """A stream of ``total`` bits fills ``data`` up to its last byte's zero padding."""
    if len(data) != (total + 7) // 8:
        raise CountMismatchError(f"{name}: a stream is {len(data)} bytes, its codes {total} bits")
    if total % 8 and int(data[-1]) >> (total % 8):
        raise MalformedPatchError(f"{name}: a stream pads its last byte with one bits")


def decode(q: torch.Tensor, k: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Values from quotients, parameters and remainders; a capped code must need its cap (one
    value, one code), so a stream decodes to one file only."""
    capped = q == QCAP
    if bool(torch.any(capped & ((low >> k) < QCAP))):
        raise MalformedPatchError("a raw Rice code holds a value its parameter codes in short")
    return torch.where(capped, low, (q << k) | low)


class OpsReader:
    """Codes read from the front of the two streams, part by part, by torch ops on the
    streams' device (every quotient found at once)."""

    def __init__(self, unary: torch.Tensor, remainder: torch.Tensor, name: str) -> None:
        self.q, self.remainder, self.name = quotients(unary, name), remainder, name
        self.code, self.bit = 0, 0

    def take(self, k: torch.Tensor) -> torch.Tensor:
        n = k.numel()
        if self.code + n > self.q.numel():
            raise CountMismatchError(f"{self.name}: unary stream ends before its last code")
        q = self.q[self.code : self.code + n]
        w = widths(q, k)
        low = read_fields(self.remainder, self.bit, w, self.name)
        self.code += n
        self.bit += int(w.sum()) if n else 0
        return decode(q, k, low)

    def finish(self) -> None:
        if self.code != self.q.numel():
            raise CountMismatchError(f"{self.name}: unary stream holds codes past the last")
        check_end(self.remainder, self.bit, self.name)
