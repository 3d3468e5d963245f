"""The coding-3 frame: exponent-class positions and grouped values, against the base.

Encoding a tensor's changes by class rank, and decoding such a frame: its header, its coded
ranks, the base scan that turns them into positions, and the two value groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from p2p_sync.codec.classes import Bits, Selected, scan_ranks, scan_select
from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import (
    _CLASS_ROW,
    _CLASS_TAIL,
    _CLASSED_HEAD,
    _COMPLEMENT,
    _GROUP,
    _MAX_RICE,
    _VALUE_HEAD,
    CLASSED_VALUE_BITS,
    N_CLASSES,
)
from p2p_sync.codec.rice import (
    _RICE_ERRORS,
    _class_codes,
    _plane_sizes,
    _read_remainders,
    _read_unary,
)
from p2p_sync.codec.values import (
    _check_size,
    _decode_value_body,
    _value_body_size,
    _value_head,
    encode_values,
)
from p2p_sync.errors import CountMismatchError, IndexOutOfRangeError, MalformedPatchError
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.tensors import TensorSpec, bits_dtype


def _classed_streams(delta: TensorDelta, base_bits: Bits) -> list[bytes]:
    pos, d = (t.numpy() for t in delta.to_sparse())
    if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
        order = np.argsort(pos)
        pos, d = pos[order], d[order]
    cls, rank, members = scan_ranks(base_bits, delta.spec.dtype, pos)
    codes, changed, d = _class_codes(cls, rank, d, members)
    unary, planes = codes.streams()
    in_group1 = np.repeat((codes.mode & _GROUP) != 0, changed)
    values = [encode_values(d[g], CLASSED_VALUE_BITS) for g in (~in_group1, in_group1)]
    head = b"".join(
        _CLASS_ROW.pack(*row)
        for row in zip(codes.coded.tolist(), codes.k.tolist(), codes.mode.tolist())
    )
    head += _CLASS_TAIL.pack(len(unary)) + values[0][0] + values[1][0]
    return [head, unary, planes, *values[0][1], *values[1][1]]


@dataclass(frozen=True)
class _ClassHead:
    """A coding-3 frame's fixed header."""

    coded: np.ndarray
    k: np.ndarray
    mode: np.ndarray
    unary_size: int
    values: tuple[tuple[int, int], tuple[int, int]]

    @property
    def remainder_size(self) -> int:
        return sum((m + 7) // 8 for m in _plane_sizes(self.k, self.coded))

    @property
    def complement(self) -> np.ndarray:
        return (self.mode & _COMPLEMENT) != 0

    @property
    def group(self) -> np.ndarray:
        return (self.mode & _GROUP) != 0


def _classed_head(raw: memoryview, spec: TensorSpec) -> _ClassHead:
    name = spec.name
    if len(raw) < _CLASSED_HEAD:
        raise CountMismatchError(f"{name}: frame ends before its class table")
    rows = [_CLASS_ROW.unpack_from(raw, i * _CLASS_ROW.size) for i in range(N_CLASSES)]
    if max(r[0] for r in rows) > spec.numel:  # checked before any fixed-width arithmetic
        raise CountMismatchError(f"{name}: a class codes more entries than the tensor holds")
    coded, k, mode = (np.array(col, dtype=np.int64) for col in zip(*rows))
    if int(k.max()) > _MAX_RICE or int(mode.max()) > (_COMPLEMENT | _GROUP):
        raise MalformedPatchError(f"{name}: class table holds a Rice parameter or mode past range")
    off = _CLASS_ROW.size * N_CLASSES
    (unary,) = _CLASS_TAIL.unpack_from(raw, off)
    off += _CLASS_TAIL.size
    v0 = _value_head(raw[off:], spec.itemsize, name, CLASSED_VALUE_BITS)
    v1 = _value_head(raw[off + _VALUE_HEAD.size :], spec.itemsize, name, CLASSED_VALUE_BITS)
    head = _ClassHead(coded, k, mode, unary, (v0, v1))
    if len(raw) < _CLASSED_HEAD + unary + head.remainder_size:
        raise CountMismatchError(f"{name}: frame ends inside its position streams")
    return head


def _coded_ranks(raw: memoryview, head: _ClassHead, numel: int, name: str) -> np.ndarray:
    """Every class's coded ranks, class after class. Gaps are bounded by the tensor size before
    any shift or running sum, so hostile input cannot overflow them."""
    kernels = _kernels()
    if kernels["fast"]:
        off = _CLASSED_HEAD + head.unary_size
        sizes = [(m + 7) // 8 for m in _plane_sizes(head.k, head.coded)]
        unary = np.frombuffer(raw, np.uint8, head.unary_size, _CLASSED_HEAD)
        planes = np.frombuffer(raw, np.uint8, sum(sizes), off)
        plane_start = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        ranks = np.empty(int(head.coded.sum()), np.int64)
        status = kernels["rice"](unary, planes, plane_start, head.coded, head.k, numel, ranks)
        if status:
            error, what = _RICE_ERRORS[status]
            raise error(f"{name}: {what}")
        return ranks
    off = _CLASSED_HEAD
    q = _read_unary(raw[off : off + head.unary_size], int(head.coded.sum()), name)
    off += head.unary_size
    k = np.repeat(head.k, head.coded)
    if q.size and bool(np.any(q > (numel >> k))):
        raise IndexOutOfRangeError(f"{name}: a position gap exceeds the tensor's {numel} elements")
    rem = _read_remainders(raw[off:], k, _plane_sizes(head.k, head.coded))
    gaps = (q << k) | rem
    if float(gaps.sum(dtype=np.float64)) + gaps.size > N_CLASSES * numel:
        raise IndexOutOfRangeError(f"{name}: positions run past the tensor's {numel} elements")
    ends = np.cumsum(gaps + 1)
    starts = np.concatenate(([0], np.cumsum(head.coded)))
    before = np.concatenate(([0], ends))[starts[:-1]]
    return ends - 1 - np.repeat(before, head.coded)


def _classed_values(
    raw: memoryview, head: _ClassHead, found: Selected, spec: TensorSpec
) -> np.ndarray:
    """The deltas of the found elements, in position order, after the exact size check."""
    name, width, n = spec.name, spec.itemsize, found.pos.size
    changed = np.where(head.complement, found.members - head.coded, head.coded)
    group = head.group
    sizes = [int(changed[~group].sum()), int(changed[group].sum())]
    bodies = [_value_body_size(m, width, *head.values[g]) for g, m in enumerate(sizes)]
    off = _CLASSED_HEAD + head.unary_size + head.remainder_size
    _check_size(raw, off + sum(bodies), n, name)
    values = []
    for g, m in enumerate(sizes):
        bits, n_esc = head.values[g]
        values.append(_decode_value_body(raw[off : off + bodies[g]], m, width, bits, n_esc, name))
        off += bodies[g]
    # value index of a class's first changed element: groups back to back, classes in order
    first = np.zeros(N_CLASSES, np.int64)
    for g in (0, 1):
        members_of = np.flatnonzero(group == bool(g))
        first[members_of] = np.cumsum(changed[members_of]) - changed[members_of] + g * sizes[0]
    every = np.concatenate(values)
    kernels = _kernels()
    if kernels["fast"]:
        out = np.empty(n, every.dtype)
        kernels["gather"](every, first, found.cls, found.within, out)
        return out
    return every[first[found.cls] + found.within]


def _decode_classed(raw: memoryview, spec: TensorSpec, n: int, base_bits: Bits) -> TensorDelta:
    name = spec.name
    head = _classed_head(raw, spec)
    if len(raw) < _CLASSED_HEAD + head.unary_size + head.remainder_size + (n + 3) // 4:
        # n values take at least n/4 bytes: refuse before the scan sizes its output by n
        raise CountMismatchError(f"{name}: frame too short for {n} changed values")
    ranks = _coded_ranks(raw, head, spec.numel, name)
    starts = np.concatenate(([0], np.cumsum(head.coded)))
    found = scan_select(base_bits, spec.dtype, ranks, starts, head.complement, n)
    if found is not None and bool(np.any(found.consumed < head.coded)):
        raise IndexOutOfRangeError(f"{name}: a coded position lies past its class's members")
    if found is None or found.pos.size != n:
        have = "more" if found is None else found.pos.size
        raise CountMismatchError(f"{name}: classes change {have} elements, table says {n}")
    d = _classed_values(raw, head, found, spec)
    return TensorDelta(
        spec, torch.from_numpy(found.pos), torch.from_numpy(d).view(bits_dtype(spec.dtype))
    )
