"""A sharded trainer publishing: every rank diffs its own blocks, rank 0 signs and announces.

``Trainer.publish(state_dict)`` with DTensors in it (FSDP2, tensor parallel) is a collective
call. Each rank diffs its blocks of every tensor on its own device against its blocks of the
last version (``weights.dtensors.ShardDiffer``); only the changes and the state-hash sum moves
travel to rank 0 (O(patch)), where they become the checkpoint patch an unsharded publish of the
same weights would make. Rank 0's node publishes it (:class:`StepPublisher`) and every rank
returns the version number.

v0 is the exception: the snapshot needs every byte, so rank 0 gathers its tensors whole, one at
a time (the other ranks send their blocks and hold no whole tensor). Rank 0 also keeps the host
copy of the last version that a publisher keeps for anchors, checkpoints and restarts (updated
per version from the patch, O(patch)); the other ranks hold their blocks of it only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from p2p_sync import codec
from p2p_sync.codec import Frame, FrameInfo
from p2p_sync.errors import BaseMismatchError, PublishError
from p2p_sync.runtime.timings import Built, PublishTimings
from p2p_sync.runtime.trainer import Publisher
from p2p_sync.trust.manifest import Manifest
from p2p_sync.weights.delta import Patch, check_layout
from p2p_sync.weights.shards import Box
from p2p_sync.weights.statehash import Sums
from p2p_sync.weights.tensors import TensorSpec, layout_of

if TYPE_CHECKING:  # torch.distributed.tensor takes ~0.5 s to import: only sharded runs pay it
    from p2p_sync.weights.dtensors import Parts, ShardDiffer

T = TypeVar("T")
SHIP_LEVEL = 1  # zstd level of the frames sent to rank 0 (it re-codes the whole patch)
Run = Callable[[Coroutine[Any, Any, T]], T]  # runs a coroutine on rank 0's node loop


def is_sharded(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether publishing ``state_dict`` is a collective call (it holds DTensors); served
    weights are asked of their originals (nothing is cast to learn it)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    if dtensor is None:
        return False
    tensors = getattr(state_dict, "tensors", state_dict)
    return any(isinstance(t, dtensor.DTensor) for t in tensors.values())


def rank() -> int:
    """This process's rank (0 outside a torch.distributed job)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class StepPublisher(Publisher):
    """A publisher fed finished patches: the ranks of a sharded trainer diffed the version."""

    def _build_step(self, step: Patch) -> tuple[int, str, Patch, list[Built]]:
        assert self.prev is not None
        version = self.next_version
        self.timings = PublishTimings(version)
        if step.base_hash != self.prev_hash:
            raise BaseMismatchError(f"v{version}: the ranks diffed against another base")
        check_layout(layout_of(self.prev), step.layout, "sharded version")
        self._moved = False  # ``_advance`` applies the step to ``prev``
        return self._coded(version, step, {})

    async def publish_step(self, step: Patch) -> list[Manifest]:
        """Publish ``step`` (against the last version) as the next version."""
        return await self._publish(lambda: self._build_step(step), None, False)


class ShardedPublishing:
    """One rank's side of publishing sharded state dicts; ``publisher`` on rank 0 only."""

    def __init__(self, publisher: StepPublisher | None, group: Any = None) -> None:
        self.publisher, self.group = publisher, group
        self.differ: ShardDiffer | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int:
        """Publish the next version, on every rank at once; every rank gets its number."""
        outcome: Any = None
        try:
            if self.differ is None:
                outcome = self._first(state_dict, run)
            else:
                outcome = self._next(state_dict, run)
        except Exception as exc:  # the other ranks are told, then it is raised here
            outcome = exc
        shared = [outcome if rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        if isinstance(outcome, Exception) or isinstance(shared[0], Exception):
            self.differ = None  # blocks may have moved part-way: the next version starts over
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(shared[0], Exception):
            raise PublishError(f"rank 0 could not publish: {shared[0]}")
        return int(shared[0])

    def _first(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int | None:
        """v0 (or the first version since start): every tensor whole at rank 0 only, one at a
        time, from the blocks the ranks count (no other rank holds a whole tensor)."""
        from p2p_sync.weights.dtensors import ShardDiffer, whole_at

        whole = {}
        for name in sorted(state_dict):
            t = whole_at(state_dict[name], 0, self.group)
            if t is not None:
                whole[name] = t
        self.differ = ShardDiffer(state_dict)
        if self.publisher is None:
            return None
        return run(self.publisher.publish(whole, owned=True))[0].version

    def _next(self, state_dict: Mapping[str, torch.Tensor], run: Run) -> int | None:
        from p2p_sync.weights.dtensors import assemble, gather_to

        assert self.differ is not None
        try:
            mine: Any = code_parts(self.differ.step(state_dict))
        except Exception as exc:  # still joins the gather: a rank missing from it hangs all
            mine = exc
        coded = gather_to(mine, 0, self.group)
        if isinstance(mine, Exception):
            raise mine
        if self.publisher is None or coded is None:
            return None
        failed = [(r, c) for r, c in enumerate(coded) if isinstance(c, Exception)]
        if failed:
            raise PublishError(f"rank {failed[0][0]} could not diff its blocks: {failed[0][1]}")
        assert self.publisher.digest is not None
        specs = {s.name: s for s in self.differ.layout}
        parts = [decode_parts(r, specs) for r in coded]
        step, target = assemble(self.differ.layout, parts, self.publisher.digest)
        step = Patch(step.layout, step.base_hash, step.target_hash, step.deltas, target)
        return run(self.publisher.publish_step(step))[0].version


def code_parts(parts: Parts) -> dict[str, tuple[Box, Frame | None, Sums]]:
    """A rank's block deltas as codec frames for the trip to rank 0 (about the patch's
    size, where raw positions and deltas take ~10 bytes per change)."""
    return {
        name: (box, None if d is None else codec.encode_frame(d.host(), SHIP_LEVEL), moved)
        for name, (box, d, moved) in parts.items()
    }


def decode_parts(
    coded: dict[str, tuple[Box, Frame | None, Sums]], specs: Mapping[str, TensorSpec]
) -> Parts:
    """A rank's frames back into block deltas (rank 0; the frames are its own ranks')."""
    out: Parts = {}
    for name, (box, frame, moved) in coded.items():
        delta = None
        if frame is not None:
            coding, count, data = frame
            local = TensorSpec(name, box.shape, specs[name].dtype)
            row = FrameInfo(local, coding, count, 0, len(data))
            delta = codec.decode_frame(row, memoryview(data))
        out[name] = (box, delta, moved)
    return out


__all__ = [
    "ShardedPublishing",
    "StepPublisher",
    "code_parts",
    "decode_parts",
    "is_sharded",
    "rank",
]
