"""The coding-4 frame: exponent classes per segment, capped Rice codes, no zstd.

A tensor is cut into segments of 2^span elements; a changed element is named by its rank among
its exponent class's members in its segment, so segments encode and decode apart (threads on
the host, blocks of a GPU, a tensor-parallel rank's own rows). Every stream is a Rice code or
raw bits, packed and read by whole-tensor torch ops on the base's own device.
docs/format.md, "Format version 3", is the specification.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from p2p_sync.codec import bitstreams, segment_scans
from p2p_sync.codec.classes import Bits
from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import MANTISSA_BITS, N_CLASSES
from p2p_sync.codec.segment_host import read_host
from p2p_sync.errors import CountMismatchError, IndexOutOfRangeError, MalformedPatchError
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.tensors import TensorSpec, bits_dtype

# per class: the Rice parameters of its five streams (file order), then its mode
_CLASS = struct.Struct("<BBBBBB")
_HEAD = struct.Struct("<B")
_TAIL = struct.Struct("<QQ")
HEAD_SIZE = _HEAD.size + N_CLASSES * _CLASS.size + _TAIL.size
WIDE = 1  # mode bit: every value's magnitude is coded (else only those of size 2 or more)
MIN_SPAN, MAX_SPAN = 12, 30
# changes a segment holds on average: its counts then cost ~0.3% of its bits, and a 7B model
# still has tens of thousands of segments to decode at once
SEGMENT_CHANGES = 4096


def span_for(numel: int, count: int) -> int:
    """log2 of the segment length: ~SEGMENT_CHANGES changes per segment."""
    if count == 0:
        return MAX_SPAN
    want = max(1, numel * SEGMENT_CHANGES // count)
    return min(MAX_SPAN, max(MIN_SPAN, want.bit_length() - 1))


@dataclass(frozen=True)
class _Params:
    """Per class: the Rice parameters of [counts, escape counts, rank gaps, escape gaps,
    magnitudes] (the file's order), and the mode."""

    k: torch.Tensor  # (16, 5) int64
    mode: torch.Tensor  # (16,) int64

    def head(self, span: int, unary: int, remainder: int) -> bytes:
        rows = torch.cat([self.k, self.mode[:, None]], 1).tolist()
        body = b"".join(_CLASS.pack(*row[:5], row[5]) for row in rows)
        return _HEAD.pack(span) + body + _TAIL.pack(unary, remainder)


def _group_gaps(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Gap of each entry after the previous one of its group (the first after -1); groups are
    runs of equal ``key``, ``x`` ascends within each."""
    prev = torch.cat([x.new_tensor([-1]), x[:-1]])
    fresh = torch.cat([key.new_tensor([True], dtype=torch.bool), key[1:] != key[:-1]])
    return x - torch.where(fresh, -1, prev) - 1


@dataclass(frozen=True)
class _Coded:
    """A tensor's changes in code order (segment, class, position): every group's size, each
    change's class, rank gap, magnitude and sign; per group the changes whose magnitude is
    not 1, their index gaps within the group and their classes (what a narrow class escapes)."""

    groups: torch.Tensor
    cls: torch.Tensor
    gap: torch.Tensor
    mag: torch.Tensor
    neg: torch.Tensor
    esc_counts: torch.Tensor
    esc_gaps: torch.Tensor
    esc_cls: torch.Tensor


def _coded_ops(
    pos: torch.Tensor,
    cls: torch.Tensor,
    rank: torch.Tensor,
    d: torch.Tensor,
    span: int,
    segments: int,
) -> _Coded:
    """:class:`_Coded` by torch ops on the scans' device (a stable sort by group)."""
    key, order = torch.sort((pos.to(cls.device) >> span) * N_CLASSES + cls, stable=True)
    groups = torch.bincount(key, minlength=segments * N_CLASSES)
    value = d.to(cls.device).to(torch.int64)[order]
    mag, cls = value.abs(), key & 15
    first = torch.cumsum(groups, 0) - groups
    within = torch.arange(key.numel(), device=key.device) - first[key]
    esc = mag != 1
    esc_counts = torch.bincount(key[esc], minlength=groups.numel())
    esc_gaps = _group_gaps(within[esc], key[esc])
    gap = _group_gaps(rank[order], key)
    return _Coded(groups, cls, gap, mag, value < 0, esc_counts, esc_gaps, cls[esc])


def _coded_host(
    pos: np.ndarray, cls: np.ndarray, rank: np.ndarray, d: np.ndarray, span: int, segments: int
) -> _Coded:
    """:class:`_Coded` by the compiled kernels (a counting sort by group)."""
    kernels, n = _kernels(), pos.size
    key = (pos >> span) * N_CLASSES + cls
    groups = np.bincount(key, minlength=segments * N_CLASSES)
    gap, mag, neg = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.bool_)
    kernels["gather_codes"](key, rank, d, np.cumsum(groups) - groups, gap, mag, neg)
    esc_counts, esc_gaps = np.zeros_like(groups), np.empty(n, np.int64)
    e = kernels["escape_codes"](groups, mag, esc_counts, esc_gaps)
    col = np.arange(groups.size, dtype=np.int64) & 15
    code_cls = np.repeat(col, groups)
    parts = (groups, code_cls, gap, mag, neg, esc_counts, esc_gaps[:e], np.repeat(col, esc_counts))
    return _Coded(*(torch.from_numpy(p) for p in parts))


def _coded(delta: TensorDelta, base_bits: Bits, span: int) -> _Coded:
    pos, d = delta.to_sparse()
    cls, rank = segment_scans.ranks(base_bits, MANTISSA_BITS[delta.spec.dtype], pos, span)
    segments = segment_scans.segment_count(delta.spec.numel, span)
    if segment_scans.on_host(base_bits):
        return _coded_host(pos.numpy(), cls.numpy(), rank.numpy(), d.numpy(), span, segments)
    return _coded_ops(pos, cls, rank, d, span, segments)


def _parts(c: _Coded, wide: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The five code streams, in file order, as (values, class of each): every group's change
    count; each narrow class's escape count where its group changes; rank gaps; escape gaps
    (index gaps among the group's changes); magnitudes (|v| - 1 in a wide class, |v| - 2 for a
    narrow class's escapes). ``wide``: bool per class."""
    col = torch.arange(c.groups.numel(), device=c.cls.device) & 15
    is_wide = wide[c.cls]
    coded = is_wide | (c.mag != 1)
    present = ~wide[col] & (c.groups > 0)
    narrow = ~wide[c.esc_cls]
    return [
        (c.groups, col),
        (c.esc_counts[present], col[present]),
        (c.gap, c.cls),
        (c.esc_gaps[narrow], c.esc_cls[narrow]),
        (torch.where(is_wide, c.mag - 1, c.mag - 2)[coded], c.cls[coded]),
    ]


def _params(c: _Coded) -> tuple[_Params, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each class's mode (WIDE where coding every magnitude costs fewer bits than escaping the
    ones that are not 1), the Rice parameters, and the streams they code. A class's streams
    depend on its own mode only, and a wide class codes nothing but magnitudes, so each class
    is costed once per mode."""
    device = c.cls.device
    parts = _parts(c, torch.zeros(N_CLASSES, dtype=torch.bool, device=device))
    narrow = [bitstreams.best_k(v, cl, N_CLASSES) for v, cl in parts]
    wide = bitstreams.best_k(c.mag - 1, c.cls, N_CLASSES)
    is_wide = wide[1].cpu() < sum(narrow[i][1] for i in (1, 3, 4)).cpu()
    k = [n[0].cpu() for n in narrow]
    k[4] = torch.where(is_wide, wide[0].cpu(), k[4])
    if bool(is_wide.any()):
        parts = _parts(c, is_wide.to(device))
    return _Params(torch.stack(k, 1), is_wide.to(torch.int64)), parts


def encode_segmented(delta: TensorDelta, base_bits: Bits) -> bytes:
    """A coding-4 frame of ``delta`` against the base's bits (host numpy or device tensor)."""
    span = span_for(delta.spec.numel, delta.count)
    coded = _coded(delta, base_bits, span)
    params, parts = _params(coded)
    ks = [params.k[:, i].contiguous() for i in range(len(parts))]
    unary, remainder = bitstreams.encode(parts, ks, segment_scans.on_host(base_bits))
    signs = bitstreams.pack_bits(coded.neg.to(torch.uint8))
    head = params.head(span, unary.numel(), remainder.numel())
    return head + b"".join(t.cpu().numpy().tobytes() for t in (unary, remainder, signs))


@dataclass(frozen=True)
class _Head:
    span: int
    k: torch.Tensor
    mode: torch.Tensor
    unary: int
    remainder: int


def _read_head(raw: memoryview, spec: TensorSpec, count: int) -> _Head:
    name = spec.name
    if len(raw) < HEAD_SIZE:
        raise CountMismatchError(f"{name}: frame ends before its class table")
    (span,) = _HEAD.unpack_from(raw)
    rows = [_CLASS.unpack_from(raw, _HEAD.size + c * _CLASS.size) for c in range(N_CLASSES)]
    unary, remainder = _TAIL.unpack_from(raw, HEAD_SIZE - _TAIL.size)
    k = torch.tensor([r[:5] for r in rows], dtype=torch.int64)
    mode = torch.tensor([r[5] for r in rows], dtype=torch.int64)
    if not MIN_SPAN <= span <= MAX_SPAN:
        raise MalformedPatchError(f"{name}: segment span 2^{span} out of range")
    if int(k.max()) > bitstreams.MAX_K or int(mode.max()) > WIDE:
        raise MalformedPatchError(f"{name}: class table holds a parameter or mode past range")
    if len(raw) != HEAD_SIZE + unary + remainder + (count + 7) // 8:
        raise CountMismatchError(f"{name}: frame size does not match its streams and count")
    if segment_scans.segment_count(spec.numel, span) * N_CLASSES > 8 * unary:
        # every group's count takes a unary bit at least: refused before anything is sized by
        # the number of groups, which the tensor's shape, not the frame, declares
        raise CountMismatchError(f"{name}: unary stream too short for its segments' counts")
    return _Head(span, k, mode, unary, remainder)


def _segment_sizes(numel: int, span: int, device: torch.device) -> torch.Tensor:
    segments = segment_scans.segment_count(numel, span)
    size = torch.full((segments,), 1 << span, dtype=torch.int64, device=device)
    size[-1] = numel - ((segments - 1) << span)
    return size


def _running(gaps: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Values from their gaps within each group (runs of ``groups[i]`` entries)."""
    ends = torch.cumsum(gaps + 1, 0)
    first = torch.cumsum(groups, 0) - groups
    before = torch.cat([ends.new_zeros(1), ends])[first]
    return ends - 1 - torch.repeat_interleave(before, groups)


def _bounded_running(
    gaps: torch.Tensor, groups: torch.Tensor, limit: torch.Tensor, what: str
) -> torch.Tensor:
    """:func:`_running`, after checking every group's values stay below its ``limit`` (summed
    in float64, so hostile gaps cannot overflow before the check)."""
    group = torch.repeat_interleave(torch.arange(groups.numel(), device=gaps.device), groups)
    span = torch.zeros(groups.numel(), dtype=torch.float64, device=gaps.device)
    span.index_add_(0, group, gaps.to(torch.float64) + 1)
    if bool(torch.any(span > limit.to(torch.float64))):
        raise IndexOutOfRangeError(f"{what} runs past the end of its segment or group")
    return _running(gaps, groups)


def _read_counts(
    reader: bitstreams.OpsReader, head: _Head, spec: TensorSpec, count: int, device: torch.device
) -> torch.Tensor:
    """Every group's change count, checked against its segment and the row's count."""
    sizes = _segment_sizes(spec.numel, head.span, device)
    col = torch.arange(sizes.numel() * N_CLASSES, device=sizes.device) & 15
    groups = reader.take(head.k[:, 0].to(col.device)[col])
    per_segment = groups.view(-1, N_CLASSES).sum(1)
    if bool(torch.any(per_segment > sizes)) or int(groups.sum()) != count:
        raise CountMismatchError(f"{spec.name}: group counts do not add up to {count} changes")
    return groups


def _read_escape_counts(
    reader: bitstreams.OpsReader, head: _Head, groups: torch.Tensor
) -> torch.Tensor:
    """How many of each group's changes a narrow class escapes (0 in wide classes)."""
    col = torch.arange(groups.numel(), device=groups.device) & 15
    present = (head.mode.to(groups.device)[col] != WIDE) & (groups > 0)
    escapes = torch.zeros_like(groups)
    escapes[present] = reader.take(head.k[:, 1].to(groups.device)[col[present]])
    if bool(torch.any(escapes > groups)):
        raise CountMismatchError(f"{reader.name}: a group escapes more values than it changes")
    return escapes


def _read_magnitudes(
    reader: bitstreams.OpsReader, head: _Head, groups: torch.Tensor, escapes: torch.Tensor
) -> torch.Tensor:
    """Every change's magnitude in code order, from the escape gaps and magnitude codes."""
    device, name = groups.device, reader.name
    k = head.k.to(device)
    col = torch.arange(groups.numel(), device=device) & 15
    cls = torch.repeat_interleave(col, groups)
    gaps = reader.take(k[torch.repeat_interleave(col, escapes), 3])
    index = _bounded_running(gaps, escapes, groups, f"{name}: an escape index")
    first = torch.cumsum(groups, 0) - groups
    escaped = torch.zeros(cls.numel(), dtype=torch.bool, device=device)
    escaped[torch.repeat_interleave(first, escapes) + index] = True
    wide = (head.mode.to(device) == WIDE)[cls]
    coded = wide | escaped
    mag = torch.ones_like(cls)
    mag[coded] = reader.take(k[cls[coded], 4]) + torch.where(wide[coded], 1, 2)
    return mag


def _signed(mag: torch.Tensor, signs: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Deltas from magnitudes and sign bits, refused outside the dtype's signed range."""
    n = mag.numel()
    bits = bitstreams.unpack_bits(signs)
    if bool(torch.any(bits[n:])):
        raise MalformedPatchError(f"{spec.name}: sign stream pads with one bits")
    negative = bits[:n].bool()
    top = 1 << (8 * spec.itemsize - 1)
    if bool(torch.any(mag > torch.where(negative, top, top - 1))):
        raise MalformedPatchError(f"{spec.name}: a delta lies outside its dtype's range")
    return torch.where(negative, -mag, mag)


@dataclass(frozen=True)
class Codes:
    """A coding-4 frame read without its base: each change's segment, class, rank and delta,
    in code order, and the segment span."""

    span: int
    segment: torch.Tensor
    cls: torch.Tensor
    rank: torch.Tensor
    value: torch.Tensor


def read_codes(raw: memoryview, spec: TensorSpec, count: int, device: torch.device | None) -> Codes:
    """Every stream of a coding-4 frame decoded and checked: all that needs no base. On the
    host by the compiled kernels (``device`` None), else by torch ops on ``device``."""
    head = _read_head(raw, spec, count)
    if device is None and _kernels()["fast"]:
        return _read_on_host(raw, head, spec, count)
    data = torch.frombuffer(bytearray(raw[HEAD_SIZE:]), dtype=torch.uint8)
    data = data if device is None else data.to(device)
    unary, rest = data[: head.unary], data[head.unary :]
    reader = bitstreams.OpsReader(unary, rest[: head.remainder], spec.name)
    device = data.device
    groups = _read_counts(reader, head, spec, count, device)
    escapes = _read_escape_counts(reader, head, groups)
    col = torch.arange(groups.numel(), device=device)
    cls = torch.repeat_interleave(col & 15, groups)
    gaps = reader.take(head.k[:, 2].to(device)[cls])
    limit = _segment_sizes(spec.numel, head.span, device).repeat_interleave(N_CLASSES)
    rank = _bounded_running(gaps, groups, limit, f"{spec.name}: a class rank")
    mag = _read_magnitudes(reader, head, groups, escapes)
    reader.finish()
    value = _signed(mag, rest[head.remainder :], spec)
    segment = torch.repeat_interleave(col >> 4, groups)
    return Codes(head.span, segment, cls, rank, value)


def _read_on_host(raw: memoryview, head: _Head, spec: TensorSpec, count: int) -> Codes:
    """:func:`read_codes` by the compiled kernels (:mod:`p2p_sync.codec.segment_host`)."""
    unary = np.frombuffer(raw, np.uint8, head.unary, HEAD_SIZE)
    rem = np.frombuffer(raw, np.uint8, head.remainder, HEAD_SIZE + head.unary)
    sizes = _segment_sizes(spec.numel, head.span, torch.device("cpu")).numpy()
    wide = (head.mode == WIDE).numpy()
    seg, cls, rank, mag, bits = read_host(unary, rem, head.k.numpy(), wide, sizes, count, spec.name)
    bitstreams.check_end(rem, bits, spec.name)
    signs = torch.frombuffer(
        bytearray(raw[HEAD_SIZE + head.unary + head.remainder :]), dtype=torch.uint8
    )
    value = _signed(torch.from_numpy(mag), signs, spec)
    return Codes(head.span, *(torch.from_numpy(a) for a in (seg, cls, rank)), value)


def decode_segmented(raw: memoryview, spec: TensorSpec, count: int, base_bits: Bits) -> TensorDelta:
    """Decode and fully validate a coding-4 frame against the base's bits."""
    host = segment_scans.on_host(base_bits)
    device = None if host else segment_scans.as_torch(base_bits).device
    got = read_codes(raw, spec, count, device)
    device = got.value.device
    mantissa = MANTISSA_BITS[spec.dtype]
    codes = (got.segment, got.cls, got.rank)
    pos, order = segment_scans.select(base_bits, mantissa, got.span, codes, spec.name)
    d = got.value[order.to(device)].to(bits_dtype(spec.dtype)).cpu()
    return TensorDelta(spec, pos.cpu(), d)
