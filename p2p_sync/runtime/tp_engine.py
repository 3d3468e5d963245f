"""A tensor-parallel engine following the swarm: one node per engine, every rank patches its
own shards.

Rank 0 runs the node. It fetches, verifies and applies each version to a host copy of the
weights: the verified head that it checkpoints, serves to peers and exports, and that the
exponent-class frames of the default patch format decode against. While applying a version it
cuts the version's changes into each rank's blocks and codes them for that rank, without a base
(:class:`FrameCollector`, off the engine's pause). The engine's ranks call ``apply_updates``
together, between generation batches, as they call ``generate``: rank 0 scatters the waiting
frames (each rank gets its part: O(patch) in all), every rank decodes and adds its part, in
place, on its device (``weights.engine_shards``), and the ranks' shares of the state-hash sums,
added up at rank 0, must give each version's signed target. When they do not, or when the
engine holds no version the node can patch from (at start, after a snapshot), rank 0 sends the
verified head whole, one tensor at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from p2p_sync import codec
from p2p_sync.codec import FrameInfo
from p2p_sync.errors import LayoutMismatchError
from p2p_sync.protocol.versions import PeerState
from p2p_sync.runtime.rollout import Update
from p2p_sync.trust.manifest import Manifest
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.dtensors import digest_of, gather_to
from p2p_sync.weights.engine_shards import EngineShards
from p2p_sync.weights.layout import EngineLayout
from p2p_sync.weights.shards import Box, part_in
from p2p_sync.weights.statehash import StateDigest, add
from p2p_sync.weights.tensors import flat_bits, layout_of

SHIP_LEVEL = 1  # zstd level of re-coded frames: they cross the engine's own fast links
QUEUE_BYTES = 1 << 30  # frames kept for an engine that does not apply; past it: whole again


@dataclass(frozen=True)
class ShippedFrame:
    """The changes of one rank's block of a tensor in a version, as they travel to that rank:
    a codec frame of positions in the block, in a coding that needs no base weights."""

    name: str
    coding: int
    count: int
    data: bytes


def decoded(frames: list[ShippedFrame], shards: EngineShards) -> Iterator[TensorDelta]:
    """The frames' changes, a block of positions at a time (never a whole tensor's)."""
    for f in frames:
        row = FrameInfo(shards.spec(f.name), f.coding, f.count, 0, len(f.data))
        yield from codec.decode_frame_blocks(row, memoryview(f.data))


class FrameCollector:
    """A version's changes cut into each rank's blocks and re-coded, as the node applies them
    (a ``restore.FrameSink``): every rank then decodes its own part only, and none needs the
    base weights that exponent-class frames are coded against."""

    def __init__(self, boxes: list[dict[str, Box]]) -> None:
        self.boxes = boxes  # per rank: where its block of each tensor sits
        self.frames: list[list[ShippedFrame]] = [[] for _ in boxes]
        self._lock = threading.Lock()  # the node applies tensors in several threads

    def __call__(self, delta: TensorDelta) -> None:
        name, once = delta.spec.name, None
        for rank, boxes in enumerate(self.boxes):
            box = boxes.get(name)
            if box is None:
                continue
            if box.whole and once is not None:  # a replicated tensor: coded once, sent to all
                shipped = once
            else:
                part = part_in(box, delta)
                if part is None:
                    continue
                shipped = ShippedFrame(name, *codec.encode_frame(part, SHIP_LEVEL))
                once = shipped if box.whole else None
            with self._lock:
                self.frames[rank].append(shipped)

    @property
    def size(self) -> int:
        return sum(len(f.data) for frames in self.frames for f in frames)


@dataclass(frozen=True)
class Queued:
    """A version the engine has not taken: its target state and its frames (per rank, at rank
    0; a rank is sent its own)."""

    version: int
    target: str
    frames: list[list[ShippedFrame]]

    @property
    def size(self) -> int:
        return sum(len(f.data) for frames in self.frames for f in frames)

    def of(self, rank: int) -> Queued:
        return Queued(self.version, self.target, [self.frames[rank]])


class EngineQueue:
    """Rank 0: the versions the node's host copy took that the engine's ranks have not."""

    def __init__(self, limit: int = QUEUE_BYTES) -> None:
        self.limit = limit
        self.boxes: list[dict[str, Box]] = []  # every rank's blocks, once the engine attached
        self.versions: list[Queued] = []
        self.whole = True  # the engine needs the head whole (until it is found to hold it)
        self.news = threading.Event()  # set while there is something to apply
        self._lock = threading.Lock()

    def collector(self) -> FrameCollector | None:
        """Where the node shows the changes of the version it applies next (None while the
        engine is to get the head whole anyway: nothing to cut)."""
        with self._lock:
            return None if self.whole or not self.boxes else FrameCollector(self.boxes)

    def took(self, m: Manifest, frames: FrameCollector | None) -> None:
        """The node applied ``m``: its frames wait for the engine (unless it goes whole)."""
        with self._lock:
            if not self.whole and frames is None:  # attached while ``m`` was being applied
                self.whole = True
            if not self.whole and frames is not None:
                self.versions.append(Queued(m.version, m.target_state, frames.frames))
                if sum(q.size for q in self.versions) > self.limit:
                    self.whole, self.versions = True, []
            self.news.set()

    def lost(self) -> None:
        """The node's copy moved without frames (a snapshot, a rebuild): send it whole."""
        with self._lock:
            self.whole, self.versions = True, []
            self.news.set()

    def take(self) -> tuple[bool, list[Queued]]:
        """What waits: whether the head goes whole first, and the versions after it."""
        with self._lock:
            whole, versions, self.versions = self.whole, self.versions, []
            self.news.clear()
            return whole, versions

    def held(self, exactly: bool) -> None:
        """The engine now holds the node's head (``exactly``), or needs it whole."""
        with self._lock:
            self.whole, self.versions = not exactly, []
            if not exactly:
                self.news.set()


@dataclass
class Shipment:
    """What rank 0 tells every rank to apply: the head whole first (``whole``), then each
    queued version's frames; ``held``: the engine is found to hold the head already."""

    whole: bool = False
    versions: list[Queued] = field(default_factory=list)
    held: PeerState | None = None


# Rank 0's way to the node's verified head: runs ``fn(weights, state)`` (weights None before
# the first version) while no version is applied to the host copy, and returns its result.
HeadReader = Callable[[Callable[[Any, PeerState], Any]], Any]


class EngineSync:
    """Every rank's side of keeping a tensor-parallel engine at its node's head; ``queue`` and
    ``head`` at rank 0 only."""

    def __init__(
        self,
        shards: EngineShards,
        group: Any = None,
        queue: EngineQueue | None = None,
        head: HeadReader | None = None,
    ) -> None:
        self.shards, self.group, self.queue, self.head = shards, group, queue, head
        self.state = PeerState()  # the engine's, as rank 0 verified it (every rank is told)
        self.digest: StateDigest | None = None  # rank 0: the engine's sums, kept in O(patch)

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if dist.get_rank(self.group) == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _read(self, fn: Callable[[Mapping[str, torch.Tensor] | None, PeerState], Any]) -> Any:
        """``fn`` on the node's head at rank 0 (None elsewhere)."""
        return self.head(fn) if self.head is not None else None

    def measure(self) -> StateDigest | None:
        """The engine's digest at rank 0 (None elsewhere): each rank hashes its blocks."""
        ranks = gather_to(self.shards.sums(), 0, self.group)
        return digest_of(self.shards.layout, ranks) if ranks is not None else None

    def attach(self) -> None:
        """At start: where every rank's blocks sit, and whether the engine already holds the
        node's head (then only patches go)."""
        boxes = gather_to(self.shards.boxes(), 0, self.group)
        if self.queue is not None and boxes is not None:
            self.queue.boxes = boxes
        self.digest = self.measure()
        self.state = self.share(self._read(self._found)) or PeerState()

    def _scatter(self, plan: Shipment | None) -> Shipment:
        """Each rank's part of rank 0's ``plan``: its own frames of every version."""
        mine: list[Any] = [None]
        parts = None
        if plan is not None:
            size = dist.get_world_size(self.group)
            parts = [replace(plan, versions=[q.of(r) for q in plan.versions]) for r in range(size)]
        dist.scatter_object_list(mine, parts, src=0, group=self.group)
        return mine[0]

    def _found(self, _: object, state: PeerState) -> PeerState | None:
        assert self.queue is not None and self.digest is not None
        if state.version is None:  # nothing yet: the first version goes whole
            return None
        exactly = state.state_hash == self.digest.hash().hex()
        self.queue.held(exactly)
        return state if exactly else None

    def ready(self, timeout: float | None) -> bool:
        """Whether there is something to apply (rank 0 waits up to ``timeout``), on every rank."""
        news = self.queue.news.wait(timeout) if self.queue is not None else None
        return bool(self.share(news))

    def apply(self) -> list[Update]:
        """Apply what waits, on every rank together; the updates made (sizes: this rank's)."""
        plan = self._scatter(self._read(self._plan))
        done: list[Update] = []
        self.state = plan.held or self.state
        if plan.whole:
            done.append(self._load_whole())
        for q in plan.versions:
            if self.state.version is not None and q.version <= self.state.version:
                continue  # the whole head already holds it
            up = self._patch(q)
            if up is None:  # the engine's sums missed the target: the head, whole
                done.append(self._load_whole())
                break
            done.append(up)
        return done

    def _plan(self, weights: object, state: PeerState) -> Shipment:
        """What waits (rank 0, the head still): nothing before the first version, and no
        whole head to an engine that holds it (one loaded from the same checkpoint)."""
        assert self.queue is not None and self.digest is not None
        if weights is None:
            return Shipment()
        whole, versions = self.queue.take()
        if whole and self.digest.hash().hex() == state.state_hash:
            self.queue.held(True)
            return Shipment(held=state)
        return Shipment(whole, versions)

    def _patch(self, q: Queued) -> Update | None:
        """Apply one queued version's frames on every rank and check the target at rank 0
        (the engine's layout is the head's: its hash matched, at start or when sent whole)."""
        t0 = time.perf_counter()
        moved = self.shards.apply(decoded(q.frames[0], self.shards))
        ranks = gather_to(moved, 0, self.group)
        ok = None
        if ranks is not None and self.digest is not None:
            for share in ranks:
                for name, m in share.items():
                    self.digest.sums[name] = add(self.digest.sums[name], m)
            ok = self.digest.hash().hex() == q.target
        if not self.share(ok):
            return None
        self.state = PeerState(q.version, q.target)
        return Update(q.version, "patch", q.size, apply_s=time.perf_counter() - t0)

    def _load_whole(self) -> Update:
        """The node's verified head into every rank's blocks, a tensor at a time, checked."""
        t0 = time.perf_counter()
        state = self._read(self._send_whole) if self.head is not None else self._send_whole()
        self.digest = self.measure()
        ok = self.digest is not None and self.digest.hash().hex() == state.state_hash
        if not self.share(ok):
            raise LayoutMismatchError("engine: its blocks of the node's head do not hash to it")
        self.state = state
        return Update(state.version or 0, "whole", 0, apply_s=time.perf_counter() - t0)

    def _send_whole(
        self, weights: Mapping[str, torch.Tensor] | None = None, state: PeerState | None = None
    ) -> PeerState:
        """Rank 0 broadcasts each tensor of ``weights`` (the head, ``state``); every rank keeps
        its block. Rank 0 runs it while the node applies nothing: the engine is then at the head."""
        error = None
        if weights is not None:
            try:
                self.shards.check(layout_of(weights))
            except LayoutMismatchError as exc:
                error = str(exc)
        error, state = self.share((error, state))
        if error is not None:
            raise LayoutMismatchError(error)
        device = _comm_device(self.group)
        for spec in self.shards.layout:
            if weights is not None:
                buf = weights[spec.name].detach().to(device).contiguous()
            else:
                buf = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.broadcast(flat_bits(buf).view(torch.uint8), src=0, group=self.group)  # any dtype
            self.shards.load(spec.name, buf)
        if self.queue is not None:
            self.queue.held(True)
        return state


class TensorParallel:
    """A Rollout's tensor-parallel side: this rank's shards, and rank 0's queue for them."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        group: Any = None,
        layout: EngineLayout | None = None,
    ) -> None:
        """``tensors``: the engine's (DTensors; or this rank's local tensors, which ``layout``
        places in the checkpoint's)."""
        self.group = group
        self.leader = dist.get_rank(group) == 0
        self.queue = EngineQueue() if self.leader else None
        shards = EngineShards.of(tensors) if layout is None else EngineShards.laid(tensors, layout)
        self.sync = EngineSync(shards, group, self.queue)

    def attach(self, head: HeadReader) -> None:
        """Every rank at once, once rank 0's node is open: where the engine stands."""
        self.sync.head = head if self.leader else None
        self.sync.attach()

    def until(self, version: int, timeout: float) -> None:
        """Apply versions as they come until the engine holds ``version`` (rank 0's clock
        decides for every rank); raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.sync.state.version
            if held is not None and held >= version:
                return
            left = self.sync.share(max(deadline - time.monotonic(), 0.0))
            if not left:
                raise TimeoutError(f"still at v{held} after {timeout:.0f} s, wanted v{version}")
            if self.sync.ready(min(left, 1.0)):
                self.sync.apply()


def _comm_device(group: Any) -> torch.device:
    """Where tensors must be to cross the group (NCCL: the current GPU; gloo: the host)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = [
    "EngineQueue",
    "EngineSync",
    "FrameCollector",
    "HeadReader",
    "Queued",
    "Shipment",
    "ShippedFrame",
    "TensorParallel",
    "decoded",
]
