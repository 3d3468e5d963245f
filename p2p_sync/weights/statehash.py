"""The state hash: which exact version a tensor set holds, computed where the tensors live and
kept current in O(patch).

Definition (format 2 of the state hash; this docstring is its spec). A tensor's bytes, in
their in-memory order (little-endian), are read as 64-bit words ``u_j``, j = 0, 1, ..., the last
one zero-padded. Each word gives two terms, one per lane::

    lane 0: fmix64(u_j XOR (j * K0 mod 2**64))        (MurmurHash3's 64-bit finalizer)
    lane 1: smix64(u_j XOR (j * K1 mod 2**64))        (SplitMix64's finalizer)

and a tensor's *sums* are the two lanes' sums of terms mod 2**64. The state hash is XXH3-128 over
a domain tag, then for every tensor in name order its layout record (name, dtype code, shape:
the same record as the layout fingerprint) and its two sums as little-endian uint64.

Why a sum of mixed words rather than a stream hash over the bytes (format 1 was XXH3 over them):

* **It runs on the tensors' device.** Every step is 64-bit integer arithmetic that torch has on
  CUDA; the sums are order-free, so a GPU reduction, a CPU loop and numba give the same bits.
  A 7B model on a GPU is hashed in place instead of copied to the host (14 GB over PCIe).
* **It updates in O(patch).** Changing word j from u to u' changes a lane's sum by
  ``term(j, u') - term(j, u)``. A node that knows its weights' sums re-reads only the words a
  patch touches, before and after writing them, and gets the new state hash without reading the
  rest of the model. That is how a rollout checks every applied patch against the signed target
  and how a trainer signs the state it publishes.

Each term is a bijection of its word for a fixed j, so any change confined to one word always
changes both sums; wider accidental changes go unnoticed with probability ~2**-128. It is not
collision-resistant against an adversary, and need not be: like format 1 it detects accidents
(a wrong base, a torn or buggy apply, a corrupt checkpoint). Authenticity comes from the signed
manifest and the SHA-256 chunk hashes of every payload, which decide every byte a node applies.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from p2p_sync.weights.hostsums import (
    _ZERO,
    ALL,
    APPLY,
    ELEMENTS,
    F1,
    F2,
    K0,
    K1,
    MASK,
    S1,
    S2,
    WORDS,
    _kernels,
)
from p2p_sync.weights.tensors import (
    Layout,
    TensorSet,
    TensorSpec,
    layout_of,
    spec_record,
    to_device,
)
from p2p_sync.weights.threads import map_workers

DOMAIN = b"p2psync state hash v2\x00"
# Words per GPU step when hashing a whole tensor: ~a dozen int64 temporaries of this size.
DEVICE_CHUNK_WORDS = 1 << 25

Sums = tuple[int, int]
_NO_WORDS = np.zeros(0, np.int64)
_NO_ELEMS = (np.zeros(0, np.int8), np.zeros(0, np.int8))
_SUMS = struct.Struct("<QQ")


# ---------------------------------------------------------------- the terms, three ways


def term_py(j: int, u: int) -> Sums:
    """Both lanes' terms of word ``u`` at index ``j``, in plain Python (the reference)."""
    x = u ^ (j * K0 & MASK)
    x ^= x >> 33
    x = x * F1 & MASK
    x ^= x >> 33
    x = x * F2 & MASK
    x ^= x >> 33
    y = u ^ (j * K1 & MASK)
    y ^= y >> 30
    y = y * S1 & MASK
    y ^= y >> 27
    y = y * S2 & MASK
    y ^= y >> 31
    return x, y


def _signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _lane_torch(
    u: torch.Tensor, j: torch.Tensor, k: int, shifts: tuple, mults: tuple
) -> torch.Tensor:
    """One lane's terms of words ``u`` (int64, ``j``'s shape or rows of it) at indices ``j``."""
    x = j * _signed(k)
    x = x ^ u
    for s, m in zip(shifts, mults):
        x ^= _shr(x, s)
        x *= _signed(m)
    x ^= _shr(x, shifts[-1])
    return x


def _lanes_torch(u: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        _lane_torch(u, j, K0, (33, 33, 33), (F1, F2)),
        _lane_torch(u, j, K1, (30, 27, 31), (S1, S2)),
    )


def _terms_torch(u: torch.Tensor, j: torch.Tensor) -> Sums:
    """Sums of the terms of words ``u`` (int64) at indices ``j``, with torch on their device
    (int64 sums wrap: they are the lanes' sums mod 2**64). One read back for both lanes."""
    a, b = torch.stack([x.sum() for x in _lanes_torch(u, j)]).tolist()
    return a & MASK, b & MASK


def _moved_torch(u: torch.Tensor, j: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """How both lanes' sums move when words ``j`` go from ``u[0]`` to ``u[1]`` (rows of int64
    words), counting only where ``keep`` is set: an int64 (2,) on the device, not read back."""
    moves = []
    for x in _lanes_torch(u, j):
        x = x[1] - x[0]
        x *= keep
        moves.append(x.sum())
    return torch.stack(moves)


def add(a: Sums, b: Sums) -> Sums:
    return (a[0] + b[0]) & MASK, (a[1] + b[1]) & MASK


def sub(a: Sums, b: Sums) -> Sums:
    return (a[0] - b[0]) & MASK, (a[1] - b[1]) & MASK


# ---------------------------------------------------------------- one tensor


@dataclass(frozen=True)
class _Words:
    """A tensor's bytes as whole 64-bit words (``body``, int64 on the tensor's device) and the
    zero-padded last partial word (``tail``, or None)."""

    body: torch.Tensor
    tail: int | None

    @property
    def count(self) -> int:
        return self.body.numel() + (self.tail is not None)


def _words(t: torch.Tensor) -> _Words:
    flat = t.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    whole = raw.numel() // 8 * 8
    tail = None
    if whole < raw.numel():
        tail = int.from_bytes(raw[whole:].cpu().numpy().tobytes(), "little")
    body = raw[:whole]
    if body.storage_offset() % 8:  # not 8-byte aligned (a view into a shared storage): copy
        body = body.clone()
    return _Words(body.view(torch.int64), tail)


def _host(body: torch.Tensor) -> np.ndarray:
    return body.numpy().view(np.uint64)


def tensor_sums(t: torch.Tensor) -> Sums:
    """The sums of a whole tensor, computed on its device."""
    w = _words(t)
    n = w.body.numel()
    if w.body.device.type == "cpu":
        a, b, *_ = _kernels()["sums"](_host(w.body), _NO_WORDS, ALL, 0, _ZERO, *_NO_ELEMS)
        sums = (int(a), int(b))
    else:
        sums = (0, 0)
        for start in range(0, n, DEVICE_CHUNK_WORDS):
            u = w.body[start : start + DEVICE_CHUNK_WORDS]
            j = torch.arange(start, start + u.numel(), device=u.device, dtype=torch.int64)
            sums = add(sums, _terms_torch(u, j))
    if w.tail is not None:
        sums = add(sums, term_py(n, w.tail))
    return sums


def word_sums(t: torch.Tensor, words: torch.Tensor) -> Sums:
    """The sums of the terms of some of a tensor's words (sorted, distinct indices)."""
    w = _words(t)
    n = w.body.numel()
    sums: Sums = (0, 0)
    if w.tail is not None and words.numel() and int(words[-1]) == n:
        sums, words = term_py(n, w.tail), words[:-1]
    if w.body.device.type == "cpu":
        a, b, *_ = _kernels()["sums"](_host(w.body), words.numpy(), WORDS, 0, _ZERO, *_NO_ELEMS)
        return add(sums, (int(a), int(b)))
    idx = words.to(w.body.device, non_blocking=True)
    return add(sums, _terms_torch(w.body[idx], idx))


_SHIFT = {1: 3, 2: 2, 4: 1, 8: 0}  # element index -> word index, by element width


def position_sums(t: torch.Tensor, positions: torch.Tensor, itemsize: int) -> Sums:
    """The sums of the distinct words holding the elements at sorted flat ``positions``: one
    pass over the positions on the host (no index arrays built), the word indices
    deduplicated on the device on a GPU."""
    if t.device.type != "cpu":
        return word_sums(t, touched_words(positions, itemsize, t.device))
    w = _words(t)
    tail = np.uint64(w.tail or 0)
    idx, shift = positions.numpy(), _SHIFT[itemsize]
    a, b, *_ = _kernels()["sums"](_host(w.body), idx, ELEMENTS, shift, tail, *_NO_ELEMS)
    return int(a), int(b)


def touched_words(positions: torch.Tensor, itemsize: int, device: torch.device) -> torch.Tensor:
    """The distinct word indices holding the elements at sorted flat ``positions``, on
    ``device`` (where the tensor lives: a GPU dedups them faster than the host)."""
    positions = positions.to(device, non_blocking=True)
    words = positions * itemsize >> 3 if itemsize < 8 else positions
    return torch.unique_consecutive(words)


# ---------------------------------------------------------------- a tensor set


@dataclass
class StateDigest:
    """Every tensor's sums, in layout order: what the state hash is made of. Kept alongside
    weights that change in place, it gives their state hash after each patch in O(patch)."""

    layout: Layout
    sums: dict[str, Sums] = field(default_factory=dict)
    # moves of sums still on a device (``move``): added into ``sums`` by ``settle``
    moved: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, tensors: TensorSet, workers: int = 1) -> StateDigest:
        """Hash every tensor in full (on its device; ``workers`` host tensors at once)."""
        layout = layout_of(tensors)
        names = [s.name for s in layout]
        found = map_workers(lambda n: tensor_sums(tensors[n]), names, workers)
        return cls(layout, dict(zip(names, found)))

    def hash(self) -> bytes:
        self.settle()
        h = xxhash.xxh3_128(DOMAIN)
        for spec in self.layout:
            h.update(spec_record(spec))
            h.update(_SUMS.pack(*self.sums[spec.name]))
        return h.digest()

    def copy(self) -> StateDigest:
        self.settle()
        return StateDigest(self.layout, dict(self.sums))

    def replace(self, name: str, before: Sums, after: Sums) -> None:
        """Word terms ``before`` of tensor ``name`` were replaced by ``after``."""
        self.sums[name] = add(sub(self.sums[name], before), after)

    def move(self, name: str, by: torch.Tensor) -> None:
        """Tensor ``name``'s sums move by ``by`` (int64 (2,), wrapping, on the tensor's
        device), read back at the next ``settle``. One thread per tensor, as in an apply."""
        held = self.moved.get(name)
        self.moved[name] = by if held is None else held + by

    def settle(self, name: str | None = None) -> None:
        """Read back the moves still on a device (``name``'s, or all) into ``sums``."""
        for n in [name] if name is not None else list(self.moved):
            by = self.moved.pop(n, None)
            if by is not None:
                a, b = by.tolist()
                self.sums[n] = add(self.sums[n], (a & MASK, b & MASK))


def state_hash(tensors: TensorSet, workers: int = 1) -> bytes:
    """The state hash of a tensor set, computed in full on the tensors' device."""
    return StateDigest.of(tensors, workers).hash()


def track(
    digest: StateDigest,
    spec: TensorSpec,
    flat: torch.Tensor,
    positions: torch.Tensor | None,
    write: Callable[[], None],
    deltas: torch.Tensor | None = None,
) -> None:
    """Run ``write`` (which changes ``flat``, tensor ``spec.name``, at sorted ``positions``;
    None: anywhere) and bring ``digest`` along: O(changed words), or O(tensor) when dense.
    On the host, ``deltas`` (what ``write`` adds at ``positions``) lets one pass do both: each
    word is summed, patched and summed again while in cache."""
    if positions is None:
        write()
        digest.sums[spec.name] = tensor_sums(flat)
        return
    if flat.device.type != "cpu":
        track_on_device(digest, spec, flat, positions, write)
        return
    if deltas is not None and _fused(digest, spec, flat, positions, deltas):
        return
    before = position_sums(flat, positions, spec.itemsize)
    write()
    digest.replace(spec.name, before, position_sums(flat, positions, spec.itemsize))


def track_on_device(
    digest: StateDigest,
    spec: TensorSpec,
    flat: torch.Tensor,
    positions: torch.Tensor,
    write: Callable[[], None],
) -> None:
    """:func:`track` for a tensor off the host (any torch device; the GPU's path), with
    ``positions`` best already there: the sums move on the device (``StateDigest.move``) and
    are read back once per tensor (``StateDigest.settle``), not once per block. A read back
    waits for every thread's queued work on the device's one stream: at 7B on an H100, 4-5
    read backs per block of 2**18 positions made applying a patch slower with more threads
    (format 1: 2.1 s with 4, 2.9 s with 16; now 1.4 and 1.9 s). Repeated words (neighbouring
    positions in one word) are masked rather than removed, which needs their count on the
    host."""
    w = _words(flat)
    if w.tail is not None or (w.body.numel() and w.body.data_ptr() != flat.data_ptr()):
        words = touched_words(positions, spec.itemsize, flat.device)  # a copy, or a tail word
        before = word_sums(flat, words)
        write()
        digest.replace(spec.name, before, word_sums(flat, words))
        return
    at = to_device(positions, flat.device)  # already there from add_delta: no copy
    words = at >> _SHIFT[spec.itemsize]
    keep = torch.ones_like(words, dtype=torch.bool)
    torch.ne(words[1:], words[:-1], out=keep[1:])  # sorted: a word's repeats are neighbours
    before = w.body[words]
    write()
    digest.move(spec.name, _moved_torch(torch.stack((before, w.body[words])), words, keep))


def _fused(
    digest: StateDigest,
    spec: TensorSpec,
    flat: torch.Tensor,
    positions: torch.Tensor,
    deltas: torch.Tensor,
) -> bool:
    """Add ``deltas`` at ``positions`` of host tensor ``flat`` (its bit view) and move the
    sums, in one pass; False (nothing done) when its words are not a view of its memory."""
    w = _words(flat)
    if not flat.is_contiguous() or (w.body.numel() and w.body.data_ptr() != flat.data_ptr()):
        return False
    idx, elems = positions.numpy(), flat.numpy()
    shift = _SHIFT[spec.itemsize]
    a, b, c, d, k = _kernels()["sums"](
        _host(w.body), idx, APPLY, shift, _ZERO, elems, deltas.numpy()
    )
    digest.replace(spec.name, (int(a), int(b)), (int(c), int(d)))
    if k < idx.size:  # the last, partial word: the two-pass way
        rest, more = positions[k:], deltas[k:]
        before = position_sums(flat, rest, spec.itemsize)
        elems[idx[k:]] += more.numpy()
        digest.replace(spec.name, before, position_sums(flat, rest, spec.itemsize))
    return True


@dataclass
class DiffScan:
    """Where :func:`scan_diff` stopped: the next word, entries listed, and the sums of the
    changed words before and after (the tensor's digest moves by ``after - before``)."""

    word: int
    count: int
    before: Sums
    after: Sums


def scan_diff(
    old: torch.Tensor,
    new: torch.Tensor,
    start: int,
    positions: np.ndarray,
    deltas: np.ndarray,
    advance: bool,
    word0: int = 0,
) -> DiffScan | None:
    """One call of the DIFF kernel over the whole words of host bit views ``old`` and ``new``
    (same shape and dtype), from word ``start``; None when a tensor's words are not a view of
    its memory (an unaligned view): the caller then diffs the two-pass way. Elements past the
    last whole word are the caller's. ``word0``: the state-hash index of word 0 (a row block)."""
    wo, wn = _words(old), _words(new)
    if any(w.body.numel() and w.body.data_ptr() != t.data_ptr() for w, t in ((wo, old), (wn, new))):
        return None
    size = old.element_size()
    elems = np.dtype(f"u{size}")  # unsigned: the kernel's subtraction wraps, as the codec's does
    w, k, a, b, c, d = _kernels()["diff"](
        _host(wo.body),
        _host(wn.body),
        start,
        8 // size,
        positions,
        deltas.view(elems),
        advance,
        word0,
    )
    return DiffScan(int(w), int(k), (int(a), int(b)), (int(c), int(d)))


def update(
    digest: StateDigest,
    spec: TensorSpec,
    old: torch.Tensor,
    new: torch.Tensor,
    positions: torch.Tensor | None,
) -> None:
    """Tensor ``spec.name`` goes from ``old`` to ``new``, which differ only at sorted flat
    ``positions`` (None: anywhere): bring ``digest`` along, reading only the changed words."""
    if positions is None:
        digest.sums[spec.name] = tensor_sums(new)
        return
    before = position_sums(old, positions, spec.itemsize)
    digest.replace(spec.name, before, position_sums(new, positions, spec.itemsize))
