"""Coding 3's exponent-class scans on the base tensor's own device (torch).

Coding 3 (see docs/format.md) names a changed element by its rank among the base
elements of its exponent class. Finding ranks (encode) and positions (decode) needs a pass over
the whole base tensor. On the host, numba does it in one branchy loop. A GPU has no use for that
loop, and copying the base to the host would cost O(model) per version (14 GB over PCIe for a
7B model), so where the weights live on a GPU these run there instead, as whole-tensor torch
ops: per class present, one compare and one prefix sum over the tensor. Only positions, ranks
and class sizes (O(patch)) come back to the host.

The results are the same arrays as the host scans give (tests compare them on the CPU, where
torch runs these too), so a patch's bytes do not depend on where it was made or applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

N_CLASSES = 16


def classes(bits: torch.Tensor, mantissa: int) -> torch.Tensor:
    """Each element's class: the low 4 bits of the field above its mantissa (uint8)."""
    return ((bits >> mantissa) & 15).to(torch.uint8)


def _prefix(mask: torch.Tensor) -> torch.Tensor:
    """Inclusive running count of ``mask`` (int32 where it fits: half the memory traffic)."""
    dtype = torch.int32 if mask.numel() < 2**31 else torch.int64
    return torch.cumsum(mask, 0, dtype=dtype)


def members_of(cls: torch.Tensor) -> np.ndarray:
    return torch.bincount(cls.to(torch.int32), minlength=N_CLASSES).cpu().numpy().astype(np.int64)


def scan_ranks(
    bits: torch.Tensor, mantissa: int, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class uint8, rank among the class's base elements int64) of each sorted position, and
    every class's size: what ``codec.scan_ranks`` returns, computed on ``bits``' device."""
    cls_all = classes(bits, mantissa)
    p = torch.from_numpy(pos).to(bits.device, non_blocking=True)
    cls = cls_all[p]
    rank = torch.empty(p.numel(), dtype=torch.int64, device=bits.device)
    for c in torch.unique(cls).tolist():
        sel = cls == c
        rank[sel] = _prefix(cls_all == c)[p[sel]].to(torch.int64) - 1
    return cls.cpu().numpy(), rank.cpu().numpy(), members_of(cls_all)


@dataclass(frozen=True)
class Selected:
    """What a select scan found (host or device): changed positions in order, each with its
    class and its index among that class's changed elements; class sizes; how many coded
    ranks each class consumed (all of them, unless a rank lies past the class's end)."""

    pos: np.ndarray
    cls: np.ndarray
    within: np.ndarray
    members: np.ndarray
    consumed: np.ndarray


def _changed_ranks(
    coded: np.ndarray, members: int, complement: bool, device: torch.device
) -> torch.Tensor:
    """The class ranks that change: the coded ones, or (complement) all the others."""
    r = torch.from_numpy(coded).to(device, non_blocking=True)
    if not complement:
        return r
    keep = torch.ones(members, dtype=torch.bool, device=device)
    keep[r] = False
    return torch.nonzero(keep).reshape(-1)


def scan_select(
    bits: torch.Tensor,
    mantissa: int,
    ranks: np.ndarray,
    starts: np.ndarray,
    complement: np.ndarray,
    cap: int,
) -> Selected | None:
    """Positions of the changed elements given each class's sorted coded ranks
    (``ranks[starts[c]:starts[c+1]]``); None when more than ``cap`` would change. Coded ranks
    at or past their class's size are not consumed (the caller refuses such a frame)."""
    cls_all = classes(bits, mantissa)
    members = members_of(cls_all)
    consumed = np.zeros(N_CLASSES, np.int64)
    parts: list[tuple[torch.Tensor, int]] = []
    total = 0
    for c in range(N_CLASSES):
        r = ranks[starts[c] : starts[c + 1]]
        r = r[: np.searchsorted(r, members[c])]
        consumed[c] = r.size
        total += int(members[c]) - r.size if complement[c] else r.size
        if total > cap:
            return None
        changed = _changed_ranks(r, int(members[c]), bool(complement[c]), bits.device)
        if changed.numel():
            parts.append((torch.nonzero(cls_all == c).reshape(-1)[changed], c))
    return _in_position_order(parts, members, consumed)


def _in_position_order(
    parts: list[tuple[torch.Tensor, int]], members: np.ndarray, consumed: np.ndarray
) -> Selected:
    """Merge each class's changed positions (ascending within the class) into one ascending
    list, keeping each element's class and its index among the class's changed ones."""
    if not parts:
        empty = np.zeros(0, np.int64)
        return Selected(empty, np.zeros(0, np.uint8), empty, members, consumed)
    pos = torch.cat([p for p, _ in parts])
    cls = torch.cat([torch.full_like(p, c, dtype=torch.uint8) for p, c in parts])
    within = torch.cat([torch.arange(p.numel(), device=p.device) for p, _ in parts])
    pos, order = torch.sort(pos)
    host = [t.cpu().numpy() for t in (pos, cls[order], within[order])]
    return Selected(*host, members, consumed)
