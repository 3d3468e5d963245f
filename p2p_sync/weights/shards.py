"""Shards of a tensor: a rank's block of a checkpoint tensor, diffed and patched where it lives.

Sharded trainers (FSDP2, tensor parallel: DTensor) and tensor-parallel engines hold each
checkpoint tensor as blocks spread over ranks. A :class:`Box` says where one rank's block sits
in the whole tensor; with it a rank diffs its block into a delta in checkpoint coordinates
(:func:`shard_diff`) and applies the part of a checkpoint patch that falls in its block
(:func:`shard_apply`), in O(changes), never holding the whole tensor.

The state hash is a sum of per-word terms (``statehash``), so it splits over ranks: each rank
sums the terms of its own words at their global word indices (:func:`shard_sums`), and the
whole tensor's sums are the ranks' sums added up. That needs every block to own whole 64-bit
words of the tensor's bytes, which holds for the shapes models use (row and column counts that
are multiples of 4 for 16-bit dtypes); a block that would split a word raises
``ShardLayoutError`` naming the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from p2p_sync.errors import ShardLayoutError
from p2p_sync.weights.delta import TensorDelta, canonical_delta
from p2p_sync.weights.hostsums import _kernels
from p2p_sync.weights.patch import add_delta, diff_tensor, diff_tracked
from p2p_sync.weights.statehash import (
    StateDigest,
    Sums,
    _lanes_torch,
    add,
    position_sums,
    sub,
    tensor_sums,
)
from p2p_sync.weights.tensors import TensorSpec, flat_bits

CHUNK_WORDS = 1 << 22  # words summed per step: a few int64 temporaries of this size


@dataclass(frozen=True)
class Box:
    """Rank-local block ``[offsets, offsets + shape)`` of a tensor of ``global_shape``."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def of_whole(cls, shape: tuple[int, ...]) -> Box:
        return cls(tuple(shape), (0,) * len(shape), tuple(shape))

    def _strides(self, shape: tuple[int, ...]) -> list[int]:
        out, step = [], 1
        for d in reversed(shape):
            out.append(step)
            step *= d
        return out[::-1]

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """Flat positions in the block -> flat positions in the whole tensor (order kept)."""
        if not self.shape:  # a scalar
            return local.clone()
        if self.shape[1:] == self.global_shape[1:]:  # whole rows (FSDP's blocks): a shift
            return local + self.offsets[0] * self._strides(self.global_shape)[0]
        out = torch.zeros_like(local)
        rest = local
        for stride, offset, gstride in zip(
            self._strides(self.shape), self.offsets, self._strides(self.global_shape)
        ):
            coord = torch.div(rest, stride, rounding_mode="floor")
            rest = rest - coord * stride
            out += (coord + offset) * gstride
        return out

    def to_local(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of flat positions in the whole tensor, which fall in the block (a mask) and their
        flat positions in the block (for those)."""
        keep = torch.ones_like(positions, dtype=torch.bool)
        local = torch.zeros_like(positions)
        rest = positions
        for size, offset, gstride, stride in zip(
            self.shape, self.offsets, self._strides(self.global_shape), self._strides(self.shape)
        ):
            coord = torch.div(rest, gstride, rounding_mode="floor")
            rest = rest - coord * gstride
            keep &= (coord >= offset) & (coord < offset + size)
            local += (coord - offset) * stride
        return keep, local[keep]

    @property
    def flat_range(self) -> tuple[int, int] | None:
        """(start, length) of the block in the whole tensor's flat order when its elements
        are one run there (whole rows: FSDP2's blocks, a whole tensor); None otherwise."""
        if not self.shape:
            return 0, 1
        if self.shape[1:] != self.global_shape[1:]:
            return None
        row = math.prod(self.shape[1:])
        return self.offsets[0] * row, self.shape[0] * row

    @property
    def region(self) -> tuple[slice, ...]:
        """The block's place in the whole tensor, as an index."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape))

    def runs(self) -> tuple[int, np.ndarray]:
        """The block as runs of the whole tensor's flat order: (elements a run, the whole
        tensor's flat index where each run starts, in the block's own flat order). Row blocks
        are one run; a block of columns, one per row."""
        if not self.shape:
            return 1, np.zeros(1, dtype=np.int64)
        split = [k for k, (a, b) in enumerate(zip(self.shape, self.global_shape)) if a != b]
        if not split:
            return math.prod(self.shape), np.zeros(1, dtype=np.int64)
        d, g = split[-1], self._strides(self.global_shape)
        starts = np.full(math.prod(self.shape[:d]), self.offsets[d] * g[d], dtype=np.int64)
        for k, index in enumerate(np.indices(self.shape[:d], dtype=np.int64)):
            starts += (self.offsets[k] + index.reshape(-1)) * g[k]
        return self.shape[d] * g[d], starts

    @property
    def whole(self) -> bool:
        """The block is the whole tensor (a replicated or unsharded one)."""
        return self.shape == self.global_shape

    def check_words(self, itemsize: int, name: str) -> None:
        """Raise unless every run of the block's elements (in the whole tensor's flat order)
        starts and ends on a 64-bit word: then each word of the state hash is one rank's."""
        if self.whole:
            return
        per_word, g = max(8 // itemsize, 1), self._strides(self.global_shape)
        d = max(k for k in range(len(self.shape)) if self.shape[k] != self.global_shape[k])
        between = self.global_shape[d] * g[d] if d else 0  # from one run's base to the next
        if (
            (self.offsets[d] * g[d]) % per_word
            or (self.shape[d] * g[d]) % per_word
            or (between % per_word)
        ):
            raise ShardLayoutError(
                f"{name}: shard {self.offsets}+{self.shape} of {self.global_shape} splits "
                f"the {8 // itemsize * itemsize}-byte words of the state hash"
            )


@dataclass(frozen=True)
class Block:
    """One rank's part of one tensor: its local values, where they sit, and whether this rank
    is the one that counts them (replicas other than the first do not)."""

    local: torch.Tensor
    box: Box
    counts: bool


def _word_index(box: Box, local_words: torch.Tensor, per_word: int) -> torch.Tensor:
    """Global word indices of the block's local words (each a whole global word)."""
    return torch.div(box.to_global(local_words * per_word), per_word, rounding_mode="floor")


def _terms(u: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Both lanes' sums of the terms of words ``u`` at global indices ``j``: int64 (2,)."""
    return torch.stack([x.sum() for x in _lanes_torch(u, j)])


def _read(sums: torch.Tensor) -> Sums:
    a, b = sums.tolist()
    return a & (2**64 - 1), b & (2**64 - 1)


def _words(local: torch.Tensor) -> torch.Tensor:
    flat = local.detach().reshape(-1)
    return flat.view(torch.uint8).view(torch.int64) if flat.numel() else flat.view(torch.int64)


def shard_sums(local: torch.Tensor, box: Box, name: str = "tensor") -> Sums:
    """The state-hash sums of the block's words at their places in the whole tensor."""
    if box.whole:  # a replicated tensor: the statehash's own sums (its padded tail too)
        return tensor_sums(local)
    box.check_words(local.element_size(), name)
    words = _words(local)
    per_word = max(8 // local.element_size(), 1)
    total: Sums = (0, 0)
    for start in range(0, words.numel(), CHUNK_WORDS):
        u = words[start : start + CHUNK_WORDS]
        idx = torch.arange(start, start + u.numel(), dtype=torch.int64)
        total = add(total, _pair_sums(u, _word_index(box, idx, per_word)))
    return total


def _pair_sums(u: torch.Tensor, j: torch.Tensor) -> Sums:
    """Both lanes' sums of the terms of words ``u`` at global indices ``j`` (host indices):
    the host kernel on the CPU (one pass), torch on a device."""
    if u.device.type == "cpu":
        a, b = _kernels()["pairs"](u.numpy().view(np.uint64), j.numpy().view(np.uint64))
        return int(a), int(b)
    return _read(_terms(u, j.to(u.device)))


def _sums_at(t: torch.Tensor, box: Box, local_pos: torch.Tensor) -> Sums:
    """The sums of the block's words holding sorted ``local_pos``, at their global indices."""
    if box.whole:
        return position_sums(t, local_pos, t.element_size())
    per_word = max(8 // t.element_size(), 1)
    idx = torch.unique_consecutive(torch.div(local_pos, per_word, rounding_mode="floor"))
    return _pair_sums(_words(t)[idx.to(t.device)], _word_index(box, idx, per_word))


def shard_diff(
    spec: TensorSpec,
    box: Box,
    old: torch.Tensor,
    new: torch.Tensor,
    scratch: np.ndarray | None = None,
    advance: bool = False,
) -> tuple[TensorDelta | None, Sums]:
    """The block's change from ``old`` to ``new`` (positions in the block; ``to_whole`` puts
    them in the whole tensor ``spec``), and how the block's sums move; with ``advance`` ``old``
    moves to ``new`` by the change (in the diff's own pass for a row block on the host), else
    it is left as it was. ``scratch``: a bool array of at least the block's size, reused."""
    box.check_words(spec.itemsize, spec.name)
    local = TensorSpec(spec.name, box.shape, spec.dtype)
    word0 = _row_block_word0(box, local, old, new)
    if word0 is not None:  # one fused pass, as an unsharded diff: changes and sums together
        return _diff_rows(local, box, old, new, word0, advance)
    delta = diff_tensor(local, old, new, scratch)
    if delta is None:
        return None, (0, 0)
    positions = _sparse(delta)[0].cpu()
    moved = sub(_sums_at(new.to(old.device), box, positions), _sums_at(old, box, positions))
    if advance:
        add_delta(flat_bits(old), delta, +1)
    return delta, moved


def _row_block_word0(
    box: Box, local: TensorSpec, old: torch.Tensor, new: torch.Tensor
) -> int | None:
    """The state-hash index of the block's first word, when the host kernel can diff it in
    one pass: a block of whole rows (FSDP2's) of whole words, both tensors contiguous on the
    host. None otherwise."""
    if box.whole or box.shape[1:] != box.global_shape[1:] or not box.shape:
        return None
    if (local.numel * local.itemsize) % 8 or old.device.type != "cpu":
        return None
    if not (old.is_contiguous() and new.is_contiguous() and new.device.type == "cpu"):
        return None
    row = local.numel // box.shape[0] if box.shape[0] else 0
    return box.offsets[0] * row * local.itemsize // 8


def _diff_rows(
    local: TensorSpec, box: Box, old: torch.Tensor, new: torch.Tensor, word0: int, advance: bool
) -> tuple[TensorDelta | None, Sums]:
    """:func:`shard_diff` of a row block by the host kernel, its sums at their global words."""
    moves = StateDigest((local,), {local.name: (0, 0)})
    delta = diff_tracked(local, old, new, moves, advance=advance, word0=word0)
    if delta is None:
        return None, (0, 0)
    if delta.positions is None:  # dense: the kernel's sums were the block's own, recount
        before = old if not advance else _before(old, delta)
        return delta, sub(shard_sums(new, box, local.name), shard_sums(before, box, local.name))
    return delta, moves.sums[local.name]


def _before(now: torch.Tensor, delta: TensorDelta) -> torch.Tensor:
    """The block as it was before a dense ``delta`` moved it (a dense change is rare)."""
    bits = flat_bits(now) - delta.deltas.to(now.device)  # wrapping, as the delta was taken
    return bits.view(now.dtype).reshape(now.shape)


def _sparse(delta: TensorDelta) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta's changed positions and their deltas (a dense delta's nonzero entries)."""
    if delta.positions is None:
        positions = torch.nonzero(delta.deltas).reshape(-1)
        return positions, delta.deltas[positions]
    return delta.positions, delta.deltas


def to_whole(spec: TensorSpec, box: Box, local: TensorDelta) -> TensorDelta:
    """A block's delta as a delta of the whole tensor ``spec`` (sorted global positions)."""
    positions, deltas = _sparse(local)
    return TensorDelta(spec, box.to_global(positions.cpu()), deltas.cpu())


def shard_apply(local: torch.Tensor, box: Box, delta: TensorDelta) -> Sums:
    """Add the part of ``delta`` (a whole-tensor delta) that falls in the block to ``local``
    in place; returns how the block's sums moved."""
    part = part_in(box, delta)
    return apply_part(local, box, part) if part is not None else (0, 0)


def part_in(box: Box, delta: TensorDelta) -> TensorDelta | None:
    """The part of ``delta`` (a whole-tensor delta) that falls in the block, at positions in
    the block (sorted, as the whole tensor's are); None when nothing does."""
    positions, deltas = _sparse(delta)
    spec = TensorSpec(delta.spec.name, box.shape, delta.spec.dtype)
    if box.shape and box.shape[1:] == box.global_shape[1:]:  # whole rows: one slice of them
        row = spec.numel // box.shape[0] if box.shape[0] else 0
        lo, hi = box.offsets[0] * row, (box.offsets[0] + box.shape[0]) * row
        ends = torch.searchsorted(positions, torch.tensor([lo, hi], dtype=positions.dtype))
        a, b = int(ends[0]), int(ends[1])
        return TensorDelta(spec, positions[a:b] - lo, deltas[a:b]) if b > a else None
    keep, local_pos = box.to_local(positions)
    if not local_pos.numel():
        return None
    return TensorDelta(spec, local_pos, deltas[keep])


def apply_part(local: torch.Tensor, box: Box, part: TensorDelta) -> Sums:
    """Add ``part`` (positions in the block) to ``local`` in place; how the block's sums moved."""
    positions = _sparse(part)[0]
    before = _sums_at(local, box, positions)
    add_delta(flat_bits(local), part, +1)  # the library's in-place add (numpy's on the host)
    return sub(_sums_at(local, box, positions), before)


def merge_blocks(spec: TensorSpec, parts: list[TensorDelta | None]) -> TensorDelta | None:
    """The ranks' deltas of one tensor (disjoint blocks) as one delta, positions sorted."""
    found = [p for p in parts if p is not None and p.positions is not None and p.count]
    if not found:
        return None
    found.sort(key=lambda p: int(p.positions[0]))  # type: ignore[index]
    positions = torch.cat([p.positions for p in found])  # type: ignore[misc]
    deltas = torch.cat([p.deltas for p in found])
    ends = [(int(a.positions[-1]), int(b.positions[0])) for a, b in zip(found, found[1:])]  # type: ignore[index]
    if any(last >= first for last, first in ends):  # blocks interleave (columns): sort
        order = torch.argsort(positions, stable=True)
        positions, deltas = positions[order], deltas[order]
    return canonical_delta(spec, positions, deltas)


def add_sums(parts: list[Sums]) -> Sums:
    """The whole tensor's sums (or moves) from its blocks'."""
    total: Sums = (0, 0)
    for p in parts:
        total = add(total, p)
    return total


__all__ = [
    "Block",
    "Box",
    "add_sums",
    "apply_part",
    "merge_blocks",
    "part_in",
    "shard_apply",
    "shard_diff",
    "shard_sums",
    "to_whole",
]
