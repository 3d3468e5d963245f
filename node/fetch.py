"""Download one payload from the swarm: the asyncio driver of the sans-I/O scheduler.

It turns the scheduler's actions into HTTP requests and HTTP outcomes into scheduler events.
Every chunk is verified against the signed manifest before it is stored (and so relayed);
bytes that fail the hash get the serving peer banned, by the scheduler's rule.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from node.runtime import Node
from p2p_sync.chunks import verify_chunk
from p2p_sync.errors import ChunkError
from p2p_sync.manifest import Manifest
from p2p_sync.swarm import (
    Action,
    CancelRequest,
    ChunkCorrupted,
    ChunkFailed,
    ChunkVerified,
    DownloadCompleted,
    Event,
    PeerBanned,
    PeerHad,
    RequestChunk,
    Scheduler,
    SwarmConfig,
    TimerFired,
)
from p2p_sync.transport.http import PeerError, gather_quietly

log = logging.getLogger("p2psync.fetch")


class Download:
    """One payload in flight."""

    def __init__(self, node: Node, manifest: Manifest, config: SwarmConfig,
                 on_chunk: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self.node, self.m, self.on_chunk = node, manifest, on_chunk
        have = [i for i, c in enumerate(manifest.chunks) if node.store.has_chunk(c)]
        self.sched = Scheduler(len(manifest.chunks), config, have)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.requests: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.done = asyncio.Event()
        self.starved = asyncio.Event()  # nothing in flight: ask for have-maps right away

    async def _get(self, peer: str, index: int) -> None:
        assert self.node.client is not None
        url = f"{peer}/chunk/{self.m.chunks[index]}"
        try:  # one byte over the expected length, so an oversized body is seen and punished
            data = await self.node.client.get_bytes(url, self.m.chunk_length(index) + 1)
            verify_chunk(self.m, index, data)
        except PeerError:
            await self.events.put(ChunkFailed(peer, index))
            return
        except ChunkError:
            await self.events.put(ChunkCorrupted(peer, index))
            return
        # inline: a 256 KiB page-cache write (~0.25 ms) beats a thread hop under a busy loop
        self.node.store.put_chunk(data, self.m.chunks[index])
        self.node.count_download(len(data))
        if self.on_chunk is not None:
            self.on_chunk(len(data))
        await self.events.put(ChunkVerified(peer, index, len(data)))

    async def _poll_haves(self) -> None:
        assert self.node.client is not None
        while not self.done.is_set():
            peers = self.node.usable_peers()
            calls = [self.node.client.get_json(f"{p}/have/{self.m.digest}") for p in peers]
            results = await gather_quietly(calls)
            for peer, res in zip(peers, results):
                if isinstance(res, dict) and isinstance(res.get("have"), list):
                    idx = frozenset(i for i in res["have"] if isinstance(i, int))
                    await self.events.put(PeerHad(peer, idx))
            self.starved.clear()
            try:
                await asyncio.wait_for(self.starved.wait(), self.node.cfg.have_poll_s)
            except TimeoutError:
                pass
            await asyncio.sleep(0.05)  # at most 20 rounds a second even when starved

    async def _tick(self) -> None:
        while not self.done.is_set():
            await asyncio.sleep(0.25)
            await self.events.put(TimerFired())

    def _act(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, RequestChunk):
                task = asyncio.create_task(self._get(a.peer, a.index))
                self.requests[(a.peer, a.index)] = task
                task.add_done_callback(lambda _t, k=(a.peer, a.index): self.requests.pop(k, None))
            elif isinstance(a, CancelRequest):
                task = self.requests.pop((a.peer, a.index), None)
                if task is not None:
                    task.cancel()
            elif isinstance(a, PeerBanned):
                self.node.ban(a.peer, a.reason)
            elif isinstance(a, DownloadCompleted):
                self.done.set()
        if not self.sched.complete and not self.sched.requests_in_flight():
            self.starved.set()  # idle: ask for have-maps now (not whenever a chunk lacks a
            # source: in a young swarm that is nearly always true, and polls would swamp CPUs)

    async def run(self) -> bytes:
        loop = asyncio.get_running_loop()
        helpers = [asyncio.create_task(self._poll_haves()), asyncio.create_task(self._tick())]
        try:
            self._act(self.sched.handle(TimerFired(), loop.time()))
            while not self.done.is_set():
                event = await self.events.get()
                self._act(self.sched.handle(event, loop.time()))
        finally:
            self.done.set()
            pending = [*helpers, *self.requests.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        payload = await asyncio.to_thread(self.node.store.payload, self.m)
        if payload is None:  # a stored chunk vanished (disk corruption): fetch again
            return await Download(self.node, self.m, self.sched.config, self.on_chunk).run()
        return payload


async def fetch_payload(
    node: Node,
    manifest: Manifest,
    config: SwarmConfig | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> bytes:
    # A random tie-break seed per download: peers start on different chunks, so they have
    # something to trade from the first second.
    config = config or SwarmConfig(seed=random.getrandbits(31))
    return await Download(node, manifest, config, on_chunk).run()
