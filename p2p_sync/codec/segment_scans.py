"""Coding 4's exponent-class scans, one segment at a time: ranks (encode) and positions (decode).

A coding-4 rank counts a class's members from the start of the change's segment, not of the
tensor, so each segment is scanned on its own: on the host by coding 3's compiled kernels, one
call per segment that holds a change (segments without one are never read), on a GPU by
whole-tensor torch ops. Both give the same arrays (tests compare them on the CPU).
"""

from __future__ import annotations

import numpy as np
import torch

from p2p_sync.codec.classes import Bits, _unsigned
from p2p_sync.codec.kernels import _kernels
from p2p_sync.errors import IndexOutOfRangeError

N_CLASSES = 16


def segment_count(numel: int, span: int) -> int:
    """Segments of ``2**span`` elements that cover ``numel`` (at least one)."""
    return max(1, -(-numel >> span))


def on_host(base_bits: Bits) -> bool:
    """Whether the base's scans (and the frame's codes) run by the compiled host kernels."""
    return isinstance(base_bits, np.ndarray) and bool(_kernels()["fast"])


def as_torch(base_bits: Bits) -> torch.Tensor:
    return base_bits if isinstance(base_bits, torch.Tensor) else torch.from_numpy(base_bits)


def ranks(
    base_bits: Bits, mantissa: int, pos: torch.Tensor, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(class, rank among the class's members in the position's segment) of each sorted
    position, int64 on the host (or on the base's device)."""
    if on_host(base_bits):
        return _host_ranks(_unsigned(base_bits), mantissa, pos.numpy(), span)
    return _device_ranks(as_torch(base_bits), mantissa, pos, span)


def _bounds(pos: np.ndarray, span: int, segments: int) -> np.ndarray:
    return np.searchsorted(pos, np.arange(segments + 1, dtype=np.int64) << span)


def _host_ranks(
    u: np.ndarray, mantissa: int, pos: np.ndarray, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    scan = _kernels()["rank"]
    cls, rank = np.empty(pos.size, np.uint8), np.empty(pos.size, np.int64)
    members = np.zeros(N_CLASSES, np.int64)
    bounds = _bounds(pos, span, segment_count(u.size, span))
    for g in np.flatnonzero(np.diff(bounds)).tolist():
        lo, hi, start = bounds[g], bounds[g + 1], g << span
        seg = u[start : start + (1 << span)]
        scan(seg, mantissa, pos[lo:hi] - start, cls[lo:hi], rank[lo:hi], members)
    return torch.from_numpy(cls.astype(np.int64)), torch.from_numpy(rank)


def _classes(bits: torch.Tensor, mantissa: int) -> torch.Tensor:
    return (bits >> mantissa) & 15


def _padded_mask(cls_all: torch.Tensor, c: int, span: int) -> torch.Tensor:
    """Membership of class ``c`` as a (segments, 2**span) int32 matrix, the tail zero."""
    segments = segment_count(cls_all.numel(), span)
    mask = torch.zeros(segments << span, dtype=torch.int32, device=cls_all.device)
    mask[: cls_all.numel()] = cls_all == c
    return mask.view(segments, 1 << span)


def _device_ranks(
    bits: torch.Tensor, mantissa: int, pos: torch.Tensor, span: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cls_all = _classes(bits, mantissa)
    p = pos.to(bits.device)
    cls = cls_all[p].to(torch.int64)
    rank = torch.empty_like(p)
    for c in torch.unique(cls).tolist():
        sel = cls == c
        within = torch.cumsum(_padded_mask(cls_all, c, span), 1).view(-1)
        rank[sel] = within[p[sel]].to(torch.int64) - 1
    return cls, rank


CodeColumns = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # segment, class, rank


def select(
    base_bits: Bits, mantissa: int, span: int, codes: CodeColumns, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions named by ``codes`` (segment, class and rank of each, sorted by segment, then
    class, then rank), in ascending order, with the index of the code that named each."""
    if on_host(base_bits):
        host = tuple(np.ascontiguousarray(c.numpy()) for c in codes)
        return _host_select(_unsigned(base_bits), mantissa, span, host, name)
    return _device_select(as_torch(base_bits), mantissa, span, codes, name)


def _host_select(
    u: np.ndarray, mantissa: int, span: int, codes: tuple, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    seg, cls, rank = codes
    n = seg.size
    bounds = np.searchsorted(seg, np.arange(segment_count(u.size, span) + 1))
    out_pos, out_code = np.empty(n, np.int64), np.empty(n, np.int64)
    found = _kernels()["segment_select"](u, mantissa, span, bounds, cls, rank, out_pos, out_code)
    if found != n:
        raise IndexOutOfRangeError(f"{name}: a coded rank lies past its class's members")
    return torch.from_numpy(out_pos), torch.from_numpy(out_code)


def _device_select(
    bits: torch.Tensor, mantissa: int, span: int, codes: CodeColumns, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    cls_all = _classes(bits, mantissa)
    seg, cls, rank = (c.to(bits.device) for c in codes)
    pos = torch.empty_like(rank)
    segments = segment_count(bits.numel(), span)
    for c in torch.unique(cls).tolist():
        members = torch.nonzero(cls_all == c).view(-1)
        count = torch.bincount(members >> span, minlength=segments)
        first = torch.cumsum(count, 0) - count
        sel = cls == c
        g, r = seg[sel], rank[sel]
        if bool(torch.any(r >= count[g])):
            raise IndexOutOfRangeError(f"{name}: a coded rank lies past its class's members")
        pos[sel] = members[first[g] + r]
    pos, order = torch.sort(pos)
    return pos, order
