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
from collections.abc import Iterable

import numpy as np
import torch

from p2p_sync.errors import BaseMismatchError, LayoutMismatchError, TargetMismatchError
from p2p_sync.weights.delta import DENSE_IN_MEMORY_FRACTION, Patch, TensorDelta, check_layout

# merging has its own module; callers keep importing it from here
from p2p_sync.weights.merge import merge, merge_concatenated, merge_tensor  # noqa: F401
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
from p2p_sync.weights.tensors import TensorSet, TensorSpec, flat_bits, layout_of, to_device
from p2p_sync.weights.threads import map_workers

# Changed elements the host diff kernel lists per call, into a worker's reused buffers (~10 MB).
SCAN_ENTRIES = 1 << 20


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
    word0: int = 0,
) -> TensorDelta | None:
    """The change from ``base`` to ``new`` (on ``base``'s device), with ``digest`` moved to
    ``new``'s sums and, with ``advance``, ``base`` made equal to ``new``. On the host one
    kernel pass does all three while each word is in cache; on a device, or for a view whose
    words are not its memory, the diff, the sums and the copy are separate steps. ``word0``
    (host only): the tensors are a row block whose first word is word ``word0`` of the whole."""
    scratch = scratch if scratch is not None else DiffScratch()
    old = flat_bits(base.detach())
    cur = flat_bits(new.detach().to(base.device, non_blocking=True))
    if old.device.type == "cpu" and base.is_contiguous() and cur.is_contiguous():
        scanned = _diff_scanned(spec, old, cur, digest, scratch, advance, word0)
        if scanned is not False:
            return scanned
    if word0:
        raise ValueError("a row block is diffed by the host kernel only")
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
    word0: int = 0,
) -> TensorDelta | None | bool:
    """The one-pass host diff (``diff_tracked``); False when the kernel cannot see the
    tensors' memory as words (nothing done)."""
    scanned = _scan_words(spec, old, cur, scratch, advance, word0)
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
    spec: TensorSpec,
    old: torch.Tensor,
    cur: torch.Tensor,
    scratch: DiffScratch,
    advance: bool,
    word0: int = 0,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], tuple[Sums, Sums], int] | None:
    """Run the DIFF kernel over the whole words until they end or the changes grow past a
    sparse delta: (listed entries, sums moved, whole words, or -1 when it stopped early).
    None when the kernel cannot see the tensors' memory as words."""
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    moved: tuple[Sums, Sums] = ((0, 0), (0, 0))
    whole, word, count = spec.numel * spec.itemsize // 8, 0, 0
    out = scratch.deltas(spec.itemsize)
    while word < whole and count <= DENSE_IN_MEMORY_FRACTION * spec.numel:
        scan = scan_diff(old, cur, word, scratch.positions, out, advance, word0)
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


def untied(weights: TensorSet) -> dict[str, torch.Tensor]:
    """``weights`` with every name in its own memory (tied tensors cloned apart), for a copy
    moved in place name by name: a second name on the same memory would see no change."""
    tied = aliases(weights, sorted(weights))
    return {k: v.clone() if k in tied else v for k, v in weights.items()}


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
