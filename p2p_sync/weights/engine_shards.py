"""A tensor-parallel engine's weights: each rank's blocks of the checkpoint's tensors, patched
where they live.

An engine sharded by tensor parallelism (Hugging Face ``tp_plan``, or any DTensor model) holds
each checkpoint tensor as blocks over its ranks: column-parallel along dim 0, row-parallel
along dim 1, small tensors replicated. :class:`EngineShards` is one rank's view of them. It
applies a version's changes (deltas in checkpoint coordinates) to the positions that fall in
its blocks, in place, in O(changes), and reports how its share of the state-hash sums moved:
added over the ranks, they give the engine's state hash without any rank holding a whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from p2p_sync.errors import LayoutMismatchError
from p2p_sync.weights.delta import Layout, TensorDelta, check_layout
from p2p_sync.weights.dtensors import Block, block_of
from p2p_sync.weights.shards import shard_apply, shard_sums
from p2p_sync.weights.statehash import Sums, add
from p2p_sync.weights.tensors import layout_of


class EngineShards:
    """One rank's blocks of an engine's weights (DTensors, or plain tensors every rank holds)."""

    def __init__(self, layout: Layout, blocks: Mapping[str, Block]) -> None:
        self.layout = layout
        self.blocks = dict(blocks)
        self.alias = _aliases(self.blocks)  # tied tensors: patched once, through the first

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> EngineShards:
        """This rank's blocks of ``tensors`` (DTensors report their global shapes)."""
        return cls(layout_of(tensors), {n: block_of(tensors[n]) for n in sorted(tensors)})

    def check(self, layout: Layout) -> None:
        """Raise ``LayoutMismatchError`` (naming the tensor) unless ``layout`` is the engine's."""
        check_layout(layout, self.layout, "engine")

    def sums(self) -> dict[str, Sums]:
        """This rank's share of every tensor's state-hash sums (zero where it does not count)."""
        return {n: _sums(n, b) for n, b in self.blocks.items()}

    def apply(self, deltas: Iterable[TensorDelta]) -> dict[str, Sums]:
        """Add the changes (whole-tensor deltas, several per tensor allowed) that fall in this
        rank's blocks, in place; how this rank's share of each changed tensor's sums moved
        (aliases take their tensor's)."""
        moved: dict[str, Sums] = {}
        for delta in deltas:
            name = delta.spec.name
            if name not in self.blocks:
                raise LayoutMismatchError(f"engine: no tensor {name!r} to patch")
            delta.validate()
            block = self.blocks[self.alias.get(name, name)]
            step = shard_apply(block.local, block.box, delta)  # a replica is patched too
            moved[name] = add(moved.get(name, (0, 0)), step if block.counts else (0, 0))
        for alias, name in self.alias.items():
            if name in moved:
                moved[alias] = moved[name]
        return moved

    def load(self, name: str, whole: torch.Tensor) -> None:
        """Copy this rank's block of ``whole`` (the checkpoint tensor ``name``) into place."""
        if name in self.alias:
            return
        b = self.blocks[name]
        region = tuple(slice(o, o + s) for o, s in zip(b.box.offsets, b.box.shape))
        b.local.copy_(whole[region] if region else whole)


def _sums(name: str, b: Block) -> Sums:
    return shard_sums(b.local, b.box, name) if b.counts else (0, 0)


def _aliases(blocks: Mapping[str, Block]) -> dict[str, str]:
    """Names whose block shares memory with an earlier name's (tied weights) -> that name."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    out = {}
    for name, b in blocks.items():
        key = (b.local.data_ptr(), b.box.offsets)
        if b.local.numel() and key in first:
            out[name] = first[key]
        else:
            first.setdefault(key, name)
    return out


__all__ = ["EngineShards"]
