"""Sparse patches between two versions of a tensor set: diff, apply, merge.

A patch records, per tensor, which elements' bit patterns changed and by how much, as the
wrapping integer difference ``new_bits - old_bits``. Working on bits (not float values) makes
every dtype exact, and the integer difference is what makes values cheap to code: one bf16 ulp
is a delta of +-1. Applying adds the deltas back with the same wrapping arithmetic, so the result
is bit-identical to the target, and undoing an apply is subtracting them.

Diffs and applies run on the tensors' own device (CUDA when the weights live there); only the
changed positions and deltas travel to the host.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from p2p_sync.codec import jit
from p2p_sync.errors import (
    BaseMismatchError,
    ChainBrokenError,
    IndexOutOfRangeError,
    LayoutMismatchError,
    MalformedPatchError,
    TargetMismatchError,
)
from p2p_sync.weights.statehash import (
    StateDigest,
    Sums,
    add,
    position_sums,
    scan_diff,
    tensor_sums,
    track,
    update,
)
from p2p_sync.weights.tensors import (
    Layout,
    TensorSet,
    TensorSpec,
    bits_dtype,
    flat_bits,
    layout_fingerprint,
    layout_of,
    to_device,
)
from p2p_sync.weights.threads import map_workers

# A tensor whose changed fraction exceeds this is held dense in memory: a sparse entry costs
# 8 bytes of position plus the delta, a dense one just the delta.
DENSE_IN_MEMORY_FRACTION = 0.25
# Changed elements the host diff kernel lists per call, into a worker's reused buffers (~10 MB).
SCAN_ENTRIES = 1 << 20


def _extremes(values: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty int tensor: numpy's SIMD reductions on the host (torch's int64
    min and max each took ~10x longer there, and every patch validates its positions several
    times a version), one ``aminmax`` (one device sync) elsewhere."""
    if values.device.type == "cpu":
        v = values.numpy()
        return int(v.min()), int(v.max())
    lo, hi = torch.aminmax(values)
    return int(lo), int(hi)


@dataclass(frozen=True, eq=False)
class TensorDelta:
    """The change of one tensor: sorted flat positions and their bit deltas, or dense deltas.

    ``positions`` is None for the dense form, where ``deltas`` has one entry per element (zero
    where unchanged). Both live on the host as int64 positions and ``bits_dtype`` deltas.
    """

    spec: TensorSpec
    positions: torch.Tensor | None
    deltas: torch.Tensor

    @property
    def dense(self) -> bool:
        return self.positions is None

    @property
    def count(self) -> int:
        """How many elements change."""
        if self.positions is None:
            return int(torch.count_nonzero(self.deltas))
        return int(self.positions.numel())

    def validate(self) -> None:
        """Raise unless applying this delta stays inside its tensor."""
        spec, want = self.spec, bits_dtype(self.spec.dtype)
        if self.deltas.dtype != want or self.deltas.dim() != 1:
            raise MalformedPatchError(f"{spec.name}: deltas must be a flat {want} tensor")
        if self.positions is None:
            if self.deltas.numel() != spec.numel:
                raise MalformedPatchError(
                    f"{spec.name}: dense delta has {self.deltas.numel()} entries, "
                    f"tensor has {spec.numel}"
                )
            return
        self._validate_positions()

    def _validate_positions(self) -> None:
        pos, spec = self.positions, self.spec
        assert pos is not None
        if pos.dtype != torch.int64 or pos.dim() != 1 or pos.numel() != self.deltas.numel():
            raise MalformedPatchError(
                f"{spec.name}: positions must be flat int64 matching the deltas"
            )
        if not pos.numel():
            return
        lo, hi = _extremes(pos)
        if lo < 0 or hi >= spec.numel:
            raise IndexOutOfRangeError(
                f"{spec.name}: position range [{lo}, {hi}] outside a tensor of {spec.numel} "
                "elements"
            )

    def host(self) -> TensorDelta:
        """This delta with its tensors on the host (itself when they already are)."""
        if self.deltas.device.type == "cpu":
            return self
        pos = None if self.positions is None else self.positions.cpu()
        return TensorDelta(self.spec, pos, self.deltas.cpu())

    def to_sparse(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and deltas of the changed elements only."""
        if self.positions is not None:
            return self.positions, self.deltas
        pos = np.flatnonzero(self.deltas.numpy() != 0)  # a bool mask is numpy's fast path
        return torch.from_numpy(pos), torch.from_numpy(self.deltas.numpy()[pos])

    def to_dense(self) -> torch.Tensor:
        """Deltas for every element (zero where unchanged)."""
        if self.positions is None:
            return self.deltas
        out = torch.zeros(self.spec.numel, dtype=self.deltas.dtype)
        out[self.positions] = self.deltas
        return out

    def same_change(self, other: TensorDelta) -> bool:
        """True when both describe the identical change (whatever their in-memory form)."""
        if self.spec != other.spec:
            return False
        return bool(torch.equal(self.to_dense(), other.to_dense()))


def canonical_delta(spec: TensorSpec, positions: torch.Tensor, deltas: torch.Tensor) -> TensorDelta:
    """Choose the in-memory form by density, so equal changes always look alike."""
    if positions.numel() > DENSE_IN_MEMORY_FRACTION * spec.numel:
        out = torch.zeros(spec.numel, dtype=deltas.dtype)
        out[positions] = deltas
        return TensorDelta(spec, None, out)
    return TensorDelta(spec, positions, deltas)


@dataclass(frozen=True, eq=False)
class Patch:
    """A complete patch: the base it applies to, the target it produces, per-tensor changes.

    ``deltas`` holds only tensors with at least one change, keyed by name.
    """

    layout: Layout
    base_hash: bytes
    target_hash: bytes
    deltas: Mapping[str, TensorDelta] = field(default_factory=dict)
    # The target's per-tensor sums when a diff computed them (never on the wire).
    target_digest: StateDigest | None = field(default=None, repr=False)

    @property
    def fingerprint(self) -> bytes:
        return layout_fingerprint(self.layout)

    @property
    def changed(self) -> int:
        return sum(d.count for d in self.deltas.values())

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.layout)

    def validate(self) -> None:
        specs = {s.name: s for s in self.layout}
        for name, delta in self.deltas.items():
            if specs.get(name) != delta.spec:
                raise MalformedPatchError(f"{name}: delta does not match the patch layout")
            delta.validate()


def check_layout(expected: Layout, actual: Layout, what: str) -> None:
    if expected == actual:
        return
    want = {s.name: s for s in expected}
    have = {s.name: s for s in actual}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            w = want[name].describe() if name in want else "absent"
            h = have[name].describe() if name in have else "absent"
            raise LayoutMismatchError(f"{what}: tensor {name!r} is {h}, expected {w}")
    raise LayoutMismatchError(f"{what}: tensor order differs")


def _diff_host(
    spec: TensorSpec, old: torch.Tensor, cur: torch.Tensor, scratch: np.ndarray
) -> TensorDelta | None:
    # numpy's compare + flatnonzero is ~3x faster than torch's on one CPU core, and comparing
    # into a reused buffer avoids page-faulting a fresh mask for every tensor (4x slower).
    o, c = old.numpy(), cur.numpy()
    mask = scratch[: o.size]
    np.not_equal(o, c, out=mask)
    changed = np.flatnonzero(mask)
    if changed.size == 0:
        return None
    if changed.size > DENSE_IN_MEMORY_FRACTION * spec.numel:
        return TensorDelta(spec, None, torch.from_numpy(c - o))  # numpy ints wrap
    return TensorDelta(spec, torch.from_numpy(changed), torch.from_numpy(c[changed] - o[changed]))


def _diff_device(spec: TensorSpec, old: torch.Tensor, cur: torch.Tensor) -> TensorDelta | None:
    """The change on the tensors' device; it stays there until :meth:`TensorDelta.host`, so
    the state digest can be brought along from device positions first."""
    changed = torch.nonzero(old != cur).reshape(-1)
    if changed.numel() == 0:
        return None
    if changed.numel() > DENSE_IN_MEMORY_FRACTION * spec.numel:
        return TensorDelta(spec, None, cur - old)
    return TensorDelta(spec, changed, cur[changed] - old[changed])


def diff_tensor(
    spec: TensorSpec, base: torch.Tensor, new: torch.Tensor, scratch: np.ndarray | None = None
) -> TensorDelta | None:
    """The change from ``base`` to ``new`` (same spec), computed on ``base``'s device (where
    it stays: call :meth:`TensorDelta.host` before coding it)."""
    old = flat_bits(base.detach())
    cur = flat_bits(new.detach().to(base.device, non_blocking=True))
    if old.device.type != "cpu":
        return _diff_device(spec, old, cur)
    if scratch is None or scratch.size < spec.numel:
        scratch = np.empty(spec.numel, dtype=bool)
    return _diff_host(spec, old.contiguous(), cur.contiguous(), scratch)


def diff(
    base: TensorSet,
    new: TensorSet,
    digest: StateDigest | None = None,
    workers: int = 1,
    advance: bool = False,
) -> Patch:
    """The patch that turns ``base`` into ``new`` (equal layouts required). ``digest``, the
    caller's record of ``base``'s sums, makes the state hashes O(patch): the target's comes from
    the words that changed, not from hashing ``new`` whole. ``workers > 1`` diffs tensors in
    parallel threads (the kernels release the GIL). The target's digest rides along as
    ``Patch.target_digest``. With ``advance``, ``base`` is made equal to ``new`` in the same
    pass (a publisher's copy of the last version, moved on without a second pass over it); a
    failure part-way then leaves ``base`` partly moved."""
    layout = layout_of(base)
    check_layout(layout, layout_of(new), "new version")
    before = digest if digest is not None else StateDigest.of(base, workers)
    after = before.copy()
    scratch = DiffScratch()

    def one(spec: TensorSpec) -> TensorDelta | None:
        delta = diff_tracked(spec, base[spec.name], new[spec.name], after, scratch, advance)
        return delta.host() if delta is not None else None

    found = map_workers(one, layout, workers)
    deltas = {spec.name: d for spec, d in zip(layout, found) if d is not None}
    return Patch(layout, before.hash(), after.hash(), deltas, after)


class DiffScratch(threading.local):
    """A worker thread's reused host buffers for diffing (each thread gets its own): the
    kernel's output lists, and a compare mask for the two-pass way. Fresh buffers per tensor
    cost more than the diff itself in page faults."""

    def __init__(self) -> None:
        self.positions = np.empty(SCAN_ENTRIES, np.int64)
        self._deltas = np.empty(SCAN_ENTRIES * 8, np.uint8)
        self._mask = np.empty(0, bool)

    def deltas(self, itemsize: int) -> np.ndarray:
        return self._deltas.view(np.dtype(f"u{itemsize}"))[:SCAN_ENTRIES]

    def mask(self, numel: int) -> np.ndarray:
        if self._mask.size < numel:
            self._mask = np.empty(numel, bool)
        return self._mask


def diff_tracked(
    spec: TensorSpec,
    base: torch.Tensor,
    new: torch.Tensor,
    digest: StateDigest,
    scratch: DiffScratch | None = None,
    advance: bool = False,
) -> TensorDelta | None:
    """The change from ``base`` to ``new`` (on ``base``'s device), with ``digest`` moved to
    ``new``'s sums and, with ``advance``, ``base`` made equal to ``new``. On the host one
    kernel pass does all three while each word is in cache; on a device, or for a view whose
    words are not its memory, the diff, the sums and the copy are separate steps."""
    scratch = scratch if scratch is not None else DiffScratch()
    old = flat_bits(base.detach())
    cur = flat_bits(new.detach().to(base.device, non_blocking=True))
    if old.device.type == "cpu" and base.is_contiguous() and cur.is_contiguous():
        scanned = _diff_scanned(spec, old, cur, digest, scratch, advance)
        if scanned is not False:
            return scanned
    delta = diff_tensor(spec, base, new, scratch.mask(spec.numel))
    if delta is not None:
        update(digest, spec, base, new, delta.positions)
        if advance:
            base.detach().copy_(new)
    return delta


def _diff_scanned(
    spec: TensorSpec,
    old: torch.Tensor,
    cur: torch.Tensor,
    digest: StateDigest,
    scratch: DiffScratch,
    advance: bool,
) -> TensorDelta | None | bool:
    """The one-pass host diff (``diff_tracked``); False when the kernel cannot see the
    tensors' memory as words (nothing done)."""
    scanned = _scan_words(spec, old, cur, scratch, advance)
    if scanned is None:
        return False
    parts, moved, whole = scanned
    count = sum(p.size for p, _ in parts)
    tail = _diff_tail(spec, old, cur, whole * 8 // spec.itemsize) if whole >= 0 else None
    if tail is None or count + tail[0].size > DENSE_IN_MEMORY_FRACTION * spec.numel:
        return _dense_after_scan(spec, old, cur, digest, parts, advance)  # from what is listed
    positions, deltas, before, after = tail
    if positions.size and advance:
        old.numpy()[positions] = cur.numpy()[positions]
    parts.append((positions, deltas))
    digest.replace(spec.name, add(moved[0], before), add(moved[1], after))
    positions = np.concatenate([p for p, _ in parts])
    if positions.size == 0:
        return None
    deltas = np.concatenate([d for _, d in parts]).view(np.dtype(f"i{spec.itemsize}"))
    return TensorDelta(spec, torch.from_numpy(positions), torch.from_numpy(deltas))


def _scan_words(
    spec: TensorSpec, old: torch.Tensor, cur: torch.Tensor, scratch: DiffScratch, advance: bool
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[Sums, Sums], int] | None:
    """Run the DIFF kernel over the whole words until they end or the changes grow past a
    sparse delta: (listed entries, sums moved, whole words, or -1 when it stopped early).
    None when the kernel cannot see the tensors' memory as words."""
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    moved: tuple[Sums, Sums] = ((0, 0), (0, 0))
    whole, word, count = spec.numel * spec.itemsize // 8, 0, 0
    out = scratch.deltas(spec.itemsize)
    while word < whole and count <= DENSE_IN_MEMORY_FRACTION * spec.numel:
        scan = scan_diff(old, cur, word, scratch.positions, out, advance)
        if scan is None:
            return None
        moved = (add(moved[0], scan.before), add(moved[1], scan.after))
        parts.append((scratch.positions[: scan.count].copy(), out[: scan.count].copy()))
        word, count = scan.word, count + scan.count
    return parts, moved, whole if word == whole else -1


def _diff_tail(
    spec: TensorSpec, old: torch.Tensor, cur: torch.Tensor, first: int
) -> tuple[np.ndarray, np.ndarray, Sums, Sums]:
    """The elements from ``first``, past the last whole word (at most 7), the two-pass way,
    and their word's terms before and after."""
    o, c = old.numpy(), cur.numpy()
    positions = np.flatnonzero(o[first:] != c[first:]) + first
    deltas = (c[positions] - o[positions]).view(np.dtype(f"u{spec.itemsize}"))
    if positions.size == 0:
        return positions, deltas, (0, 0), (0, 0)
    at = torch.from_numpy(positions)
    before = position_sums(old, at, spec.itemsize)
    return positions, deltas, before, position_sums(cur, at, spec.itemsize)


def _dense_after_scan(
    spec: TensorSpec,
    old: torch.Tensor,
    cur: torch.Tensor,
    digest: StateDigest,
    parts: list[tuple[np.ndarray, np.ndarray]],
    advance: bool,
) -> TensorDelta:
    """A tensor found to change too much for a sparse delta, part-way through the scan: the
    dense delta, with the words the scan already advanced (equal now) filled in from the
    entries it listed."""
    o, c = old.numpy(), cur.numpy()
    deltas = c - o  # numpy ints wrap
    for positions, listed in parts:
        deltas[positions] = listed.view(deltas.dtype)
    if advance:
        np.copyto(o, c)
    digest.sums[spec.name] = tensor_sums(cur)
    return TensorDelta(spec, None, torch.from_numpy(deltas))


def require_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise LayoutMismatchError(f"tensor {name!r} is not contiguous; cannot patch it in place")


def add_delta(
    flat: torch.Tensor, delta: TensorDelta, sign: int, digest: StateDigest | None = None
) -> None:
    """Add ``sign * delta`` to ``flat`` (a tensor's bit view) in place; with ``digest``, its
    sums follow in O(changed words) (on the host in the same pass as the adds)."""
    positions, deltas = delta.positions, to_device(delta.deltas, flat.device)
    if positions is not None:  # once per block (track's words and the write share it)
        positions = to_device(positions, flat.device)
    if sign < 0:
        deltas = -deltas  # wrapping negation: exact inverse of the wrapping add
    write = functools.partial(_write, flat, positions, deltas)
    with torch.no_grad():
        if digest is None:
            write()
        else:
            track(digest, delta.spec, flat, positions, write, deltas)


def _write(flat: torch.Tensor, positions: torch.Tensor | None, deltas: torch.Tensor) -> None:
    if positions is None:
        flat += deltas
    elif flat.device.type == "cpu":
        view = flat.numpy()  # numpy's fancy-index add is ~2x faster than torch's on CPU
        view[positions.numpy()] += deltas.numpy()
    else:
        flat[positions.to(flat.device, non_blocking=True)] += deltas


def aliases(weights: TensorSet, names: Iterable[str]) -> dict[str, str]:
    """Each of ``names`` whose memory an earlier name already covers (tied weights, e.g. an LM
    head sharing the embedding's storage), mapped to that name."""
    first: dict[tuple[int, int, torch.dtype], str] = {}
    out = {}
    for name in names:
        t = weights[name]
        key = (t.data_ptr(), t.numel(), t.dtype) if t.numel() else (id(t), 0, t.dtype)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def distinct_tensors(weights: TensorSet, names: Iterable[str]) -> list[str]:
    """``names`` less their aliases: tied weights are patched once, or the delta would add
    twice."""
    names = list(names)
    tied = aliases(weights, names)
    return [n for n in names if n not in tied]


def follow_aliases(weights: TensorSet, names: Iterable[str], digest: StateDigest) -> None:
    """Give each alias the sums of the tensor it shares memory with (the same bytes)."""
    digest.settle()  # moves still on a device (a GPU's apply) first
    for alias, name in aliases(weights, names).items():
        digest.sums[alias] = digest.sums[name]


def add_all(
    weights: TensorSet, patch: Patch, sign: int = 1, digest: StateDigest | None = None
) -> None:
    """Add ``sign * patch`` to ``weights`` in place, tied tensors once, with no checks (the
    caller made them); ``digest`` follows when given."""
    for name in distinct_tensors(weights, patch.deltas):
        add_delta(flat_bits(weights[name]), patch.deltas[name], sign, digest)
    if digest is not None:
        follow_aliases(weights, patch.deltas, digest)


def check_applicable(weights: TensorSet, patch: Patch) -> None:
    """Raise before any write unless ``patch`` fits ``weights``: same names, shapes and dtypes
    (the message names the first tensor that differs), positions in range, tensors patchable
    in place."""
    check_layout(patch.layout, layout_of(weights), "weights")
    patch.validate()
    for name in patch.deltas:
        require_contiguous(weights[name], name)


def apply(
    weights: TensorSet,
    patch: Patch,
    verify_target: bool = True,
    digest: StateDigest | None = None,
) -> StateDigest:
    """Apply ``patch`` to ``weights`` in place, all-or-nothing; returns the weights' digest.

    Everything is checked before the first write: the layout, every position's range and the
    base state hash. ``digest`` is the caller's record of ``weights``' sums (a node that verified
    its last apply has it, and it is brought along in place): with it, both hashes cost
    O(patch); without it the base is hashed whole once. If the result does not hash to the
    target (only possible with a patch whose content is inconsistent with its own header, or a
    wrong ``digest``), the writes are undone exactly and :class:`TargetMismatchError` is raised,
    so the weights are never left half-changed.
    """
    check_applicable(weights, patch)
    digest = digest if digest is not None else StateDigest.of(weights)
    have = digest.hash()
    if have != patch.base_hash:
        raise BaseMismatchError(
            f"weights hash to {have.hex()}, patch was made for base {patch.base_hash.hex()}"
        )
    add_all(weights, patch, +1, digest)
    if verify_target and digest.hash() != patch.target_hash:
        add_all(weights, patch, -1, digest)
        raise TargetMismatchError(
            f"patched weights do not hash to target {patch.target_hash.hex()}; apply undone"
        )
    return digest


def invert(patch: Patch) -> Patch:
    """The patch that undoes ``patch`` (target -> base): the same positions, negated deltas."""
    deltas = {k: TensorDelta(d.spec, d.positions, -d.deltas) for k, d in patch.deltas.items()}
    return Patch(patch.layout, patch.target_hash, patch.base_hash, deltas)


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


def _merge_windows_py(
    pos: np.ndarray,
    dels: np.ndarray,
    starts: np.ndarray,
    out_pos: np.ndarray,
    out_del: np.ndarray,
    de_bruijn: np.ndarray,
) -> int:
    """Sum the parts ``pos[starts[i]:starts[i+1]]`` (with ``dels``; each part's positions
    strictly increasing) into sorted ``out``, dropping sums of zero (changes that cancel).
    Returns the entries written, or -1 as soon as a part's positions do not increase.

    Why windows and not a merge: a merge picks its next entry by a comparison that goes either
    way at random (positions of different steps interleave), so it stalls on mispredicted
    branches and on a chain of dependent loads (~8 ns an entry here), and pairwise merging
    passes every entry once per level. Here each window of ``MERGE_WINDOW`` elements takes
    every part's entries in it (sequential reads, adds into an L1-resident array and a bitmap
    of touched elements), then lists the touched ones in order from the bitmap, a set bit at
    a time: one pass, ~7 ns an entry. Four steps of a 262M-element tensor: 0.23-0.34 s against
    0.6-1.3 s merged pairwise and ~2.5 s sorted together by ``torch.unique``."""
    window = MERGE_WINDOW
    parts = len(starts) - 1
    acc = np.zeros(window, dels.dtype)
    touched = np.zeros(window // 64, np.uint64)
    cur = starts[:-1].copy()
    last = np.full(max(parts, 1), -(1 << 62), np.int64)
    k = 0
    while True:
        head, more = 0, False  # the lowest position not yet taken, if any
        for p in range(parts):
            if cur[p] < starts[p + 1] and (not more or pos[cur[p]] < head):
                head, more = pos[cur[p]], True
        if not more:
            return k
        lo = head - head % window
        for p in range(parts):
            c, end, prev = cur[p], starts[p + 1], last[p]
            while c < end and pos[c] < lo + window:
                if pos[c] <= prev:
                    return -1
                prev = pos[c]
                x = prev - lo
                acc[x] += dels[c]  # the store wraps to the deltas' width
                touched[x >> 6] |= np.uint64(1) << np.uint64(x & 63)
                c += 1
            cur[p], last[p] = c, prev
        for w in range(window // 64):
            bits = touched[w]
            touched[w] = 0
            while bits:
                low = bits & (~bits + np.uint64(1))
                x = w * 64 + de_bruijn[(low * np.uint64(_DE_BRUIJN_MUL)) >> np.uint64(58)]
                out_pos[k], out_del[k] = lo + x, acc[x]
                k += acc[x] != 0
                acc[x] = 0
                bits ^= low


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
