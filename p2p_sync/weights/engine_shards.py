"""A tensor-parallel engine's weights: each rank's blocks of the checkpoint's tensors, patched
where they live.

An engine sharded by tensor parallelism (Hugging Face ``tp_plan``, or any DTensor model) holds
each checkpoint tensor as blocks over its ranks: column-parallel along dim 0, row-parallel
along dim 1, small tensors replicated. :class:`EngineShards` is one rank's view of them. It
applies the parts of a version's changes that fall in its blocks (cut out by the rank that
decoded the version: ``shards.part_in``), in place, in O(changes), and reports how its share of
the state-hash sums moved:
added over the ranks, they give the engine's state hash without any rank holding a whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from p2p_sync.errors import LayoutMismatchError
from p2p_sync.weights.delta import Layout, TensorDelta, check_layout
from p2p_sync.weights.dtensors import block_of
from p2p_sync.weights.layout import EngineLayout
from p2p_sync.weights.shards import Block, Box, apply_part, shard_sums
from p2p_sync.weights.statehash import Sums, add
from p2p_sync.weights.tensors import TensorSpec, layout_of, layout_of_specs


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

    @classmethod
    def laid(cls, engine: Mapping[str, torch.Tensor], layout: EngineLayout) -> EngineShards:
        """This rank's blocks of an engine's local tensors, placed by ``layout``."""
        blocks = layout.blocks(engine)
        specs = [(n, b.local.dtype, b.box.global_shape) for n, b in blocks.items()]
        return cls(layout_of_specs(specs), dict(sorted(blocks.items())))

    def check(self, layout: Layout) -> None:
        """Raise ``LayoutMismatchError`` (naming the tensor) unless ``layout`` is the engine's."""
        check_layout(layout, self.layout, "engine")

    def sums(self) -> dict[str, Sums]:
        """This rank's share of every tensor's state-hash sums (zero where it does not count)."""
        return {n: _sums(n, b) for n, b in self.blocks.items()}

    def apply(self, parts: Iterable[TensorDelta]) -> dict[str, Sums]:
        """Add each part (positions in this rank's block of its tensor, several per tensor
        allowed) in place; how this rank's share of each changed tensor's sums moved
        (aliases take their tensor's)."""
        moved: dict[str, Sums] = {}
        for part in parts:
            name = part.spec.name
            block = self.blocks[self.alias.get(name, name)]
            if part.spec.shape != block.box.shape:
                raise LayoutMismatchError(f"engine: {name!r} part is not of its block's shape")
            part.validate()
            step = apply_part(block.local, block.box, part)  # a replica is patched too
            moved[name] = add(moved.get(name, (0, 0)), step if block.counts else (0, 0))
        for alias, name in self.alias.items():
            if name in moved:
                moved[alias] = moved[name]
        return moved

    def boxes(self) -> dict[str, Box]:
        """Where this rank's blocks sit (what rank 0 splits each version by)."""
        return {n: b.box for n, b in self.blocks.items() if n not in self.alias}

    def spec(self, name: str) -> TensorSpec:
        """The spec of this rank's block of tensor ``name`` (what its parts are coded in)."""
        if name not in self.blocks:
            raise LayoutMismatchError(f"engine: no tensor {name!r} to patch")
        b = self.blocks[name]
        return TensorSpec(name, b.box.shape, b.local.dtype)

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
