"""Merging consecutive patches into one: per tensor, the sum of every step's deltas.

The sparse parts of a tensor are summed in one compiled pass over windows of positions (see
:func:`_merge_windows_py`); dense parts, or inputs whose positions do not increase, take
torch's sort instead. Changes that cancel out drop from the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from p2p_sync import jit
from p2p_sync.errors import ChainBrokenError
from p2p_sync.weights.delta import Patch, TensorDelta, canonical_delta, check_layout
from p2p_sync.weights.tensors import TensorSpec, bits_dtype


def merge_tensor(spec: TensorSpec, parts: list[TensorDelta]) -> TensorDelta | None:
    """One tensor's changes in ``parts`` (in order) as one delta; ``None`` if they cancel out."""
    if len(parts) == 1:
        return parts[0]
    if any(p.dense for p in parts):
        acc = torch.zeros(spec.numel, dtype=bits_dtype(spec.dtype))
        for p in parts:
            if p.positions is None:
                acc += p.deltas
            else:
                acc[p.positions] += p.deltas
        pos = torch.nonzero(acc).reshape(-1)
        return canonical_delta(spec, pos, acc[pos]) if pos.numel() else None
    pos = torch.cat([p.positions for p in parts if p.positions is not None])
    starts = np.cumsum([0] + [p.deltas.numel() for p in parts], dtype=np.int64)
    return merge_concatenated(spec, pos, torch.cat([p.deltas for p in parts]), starts)


def merge_concatenated(
    spec: TensorSpec, pos: torch.Tensor, dels: torch.Tensor, starts: np.ndarray
) -> TensorDelta | None:
    """:func:`merge_tensor` of sparse parts laid end to end: part ``i`` is
    ``pos[starts[i]:starts[i+1]]`` with its ``dels`` (a caller that decodes the parts can write
    them there directly, holding them once instead of once decoded and once concatenated).
    Summed in one compiled pass where every part's positions increase, as every decoded
    frame's and diff's do (:func:`_merge_windows_py`); else, or without numba, sorted with
    ``torch.unique`` (6 s of a 1B model's 4-step catch-up where the pass takes 1 s)."""
    kernel = _merge_kernel() if pos.device.type == "cpu" else None
    n = -1
    if kernel is not None:
        p, d = pos.numpy(), dels.numpy()
        out_pos, out_del = np.empty_like(p), np.empty_like(d)
        n = kernel(p, d, starts, out_pos, out_del, _DE_BRUIJN)
    if n >= 0:
        merged = torch.from_numpy(out_pos[:n]), torch.from_numpy(out_del[:n])
    else:
        uniq, inverse = torch.unique(pos, return_inverse=True)
        sums = torch.zeros(uniq.numel(), dtype=bits_dtype(spec.dtype), device=pos.device)
        sums.index_add_(0, inverse, dels)
        keep = sums != 0  # changes that cancel out are no change at all
        merged = uniq[keep], sums[keep]
    return canonical_delta(spec, *merged) if merged[0].numel() else None


# The index of a 64-bit word's lowest set bit, by multiplying that bit with a de Bruijn
# sequence: the top 6 bits of the product differ for each of the 64 bits.
_DE_BRUIJN_MUL = 0x03F79D71B4CB0A89
_DE_BRUIJN = np.zeros(64, np.int64)
_DE_BRUIJN[[((_DE_BRUIJN_MUL << b) & (2**64 - 1)) >> 58 for b in range(64)]] = np.arange(64)
MERGE_WINDOW = 4096  # elements summed at once: its deltas stay in L1 (8 KB for bf16)


# Why windows and not a merge: a merge picks its next entry by a comparison that goes either way
# at random (positions of different steps interleave), so it stalls on mispredicted branches and
# on a chain of dependent loads (~8 ns an entry here), and pairwise merging passes every entry
# once per level. Here each window of MERGE_WINDOW elements takes every part's entries in it
# (sequential reads, adds into an L1-resident array and a bitmap of touched elements), then
# lists the touched ones in order from the bitmap, a set bit at a time: one pass, ~7 ns an
# entry. Four steps of a 262M-element tensor: 0.23-0.34 s against 0.6-1.3 s merged pairwise and
# ~2.5 s sorted together by ``torch.unique``.


def _merge_windows_py(
    pos: np.ndarray,
    dels: np.ndarray,
    starts: np.ndarray,
    out_pos: np.ndarray,
    out_del: np.ndarray,
    de_bruijn: np.ndarray,
) -> int:
    """Kernel: sum the parts ``pos[starts[i]:starts[i+1]]`` (with ``dels``; each part's
    positions strictly increasing) into sorted ``out``, dropping sums of zero (changes that
    cancel), a window at a time. Returns the entries written, or -1 as soon as a part's
    positions do not increase."""
    parts = len(starts) - 1
    acc = np.zeros(MERGE_WINDOW, dels.dtype)
    touched = np.zeros(MERGE_WINDOW // 64, np.uint64)
    cur = starts[:-1].copy()
    last = np.full(max(parts, 1), -(1 << 62), np.int64)
    k = 0
    while True:
        head, more = _next_head(pos, starts, cur, parts)
        if not more:
            return k
        lo = head - head % MERGE_WINDOW
        for p in range(parts):
            c, prev = _add_window(pos, dels, cur[p], starts[p + 1], last[p], lo, acc, touched)
            if c < 0:
                return -1
            cur[p], last[p] = c, prev
        k = _list_window(lo, acc, touched, de_bruijn, out_pos, out_del, k)


@jit.step
def _next_head(pos: np.ndarray, starts: np.ndarray, cur: np.ndarray, parts: int) -> tuple:
    """(the lowest position not yet taken, whether there is one) over the parts."""
    head, more = 0, False
    for p in range(parts):
        if cur[p] < starts[p + 1] and (not more or pos[cur[p]] < head):
            head, more = pos[cur[p]], True
    return head, more


@jit.step
def _add_window(
    pos: np.ndarray,
    dels: np.ndarray,
    c: int,
    end: int,
    prev: int,
    lo: int,
    acc: np.ndarray,
    touched: np.ndarray,
) -> tuple[int, int]:
    """Add one part's entries from ``c`` (before ``end``) that fall in the window at ``lo``
    into ``acc``, marking them in ``touched``: (its next entry, its last position), or
    (-1, ...) when its positions do not increase (``prev``: the last before the window)."""
    while c < end and pos[c] < lo + MERGE_WINDOW:
        if pos[c] <= prev:
            return -1, prev
        prev = pos[c]
        x = prev - lo
        acc[x] += dels[c]  # the store wraps to the deltas' width
        touched[x >> 6] |= np.uint64(1) << np.uint64(x & 63)
        c += 1
    return c, prev


@jit.step
def _list_window(
    lo: int,
    acc: np.ndarray,
    touched: np.ndarray,
    de_bruijn: np.ndarray,
    out_pos: np.ndarray,
    out_del: np.ndarray,
    k: int,
) -> int:
    """List the window's touched elements in order into ``out`` from entry ``k``, a set bit
    at a time, clearing ``acc`` and ``touched``; sums of zero are not kept. The next entry."""
    for w in range(MERGE_WINDOW // 64):
        bits = touched[w]
        touched[w] = 0
        while bits:
            low = bits & (~bits + np.uint64(1))
            x = w * 64 + de_bruijn[(low * np.uint64(_DE_BRUIJN_MUL)) >> np.uint64(58)]
            out_pos[k], out_del[k] = lo + x, acc[x]
            k += acc[x] != 0
            acc[x] = 0
            bits ^= low
    return k


_MERGE: dict[str, object] = {}


def _merge_kernel():  # noqa: ANN202 - a numba dispatcher, or None without numba
    """The windowed merge compiled by numba on first use; None without numba (a Python loop
    per element would take minutes: then ``torch.unique`` sorts instead)."""
    if "windows" not in _MERGE:
        compiled = jit.compile_kernels({"windows": _merge_windows_py})
        _MERGE["windows"] = compiled["windows"] if compiled else None
    return _MERGE["windows"]


def merge(patches: Sequence[Patch]) -> Patch:
    """One patch equal to applying ``patches`` in order (the same as diffing first to last)."""
    if not patches:
        raise ValueError("merge needs at least one patch")
    first = patches[0]
    for prev, nxt in zip(patches, patches[1:]):
        check_layout(first.layout, nxt.layout, "patch to merge")
        if prev.target_hash != nxt.base_hash:
            raise ChainBrokenError(
                f"patch with base {nxt.base_hash.hex()} does not follow "
                f"one with target {prev.target_hash.hex()}"
            )
    deltas = {}
    for spec in first.layout:
        parts = [p.deltas[spec.name] for p in patches if spec.name in p.deltas]
        merged = merge_tensor(spec, parts) if parts else None
        if merged is not None:
            deltas[spec.name] = merged
    return Patch(first.layout, first.base_hash, patches[-1].target_hash, deltas)
