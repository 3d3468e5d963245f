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
from p2p_sync.store import StoreError
from p2p_sync.swarm import (
    Action,
    CancelRequest,
    ChunkCorrupted,
    ChunkFailed,
    ChunkVerified,
    DownloadCompleted,
    Event,
    PeerBanned,
    PeerBusy,
    PeerHad,
    RequestChunk,
    Scheduler,
    SwarmConfig,
    TimerFired,
)
from p2p_sync.transport.http import PeerBusyError, PeerError

log = logging.getLogger("p2psync.fetch")
MAX_ATTEMPTS = 3  # downloads of one payload when stored chunks fail their hash on re-read


class Download:
    """One payload in flight."""

    def __init__(
        self,
        node: Node,
        manifest: Manifest,
        config: SwarmConfig,
        on_chunk: Callable[[int], None] | None = None,
        attempt: int = 1,
    ) -> None:
        self.attempt = attempt
        self.node, self.m, self.on_chunk = node, manifest, on_chunk
        have = node.store.have_indices(manifest)
        self.sched = Scheduler(len(manifest.chunks), config, have)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.requests: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.done = asyncio.Event()
        self.followers: dict[str, asyncio.Task[None]] = {}

    async def _get(self, peer: str, index: int) -> None:
        assert self.node.client is not None
        url = f"{peer}/chunk/{self.m.chunks[index]}"
        try:  # one byte over the expected length, so an oversized body is seen and punished
            data = await self.node.client.get_bytes(url, self.m.chunk_length(index) + 1)
            verify_chunk(self.m, index, data)
        except PeerBusyError:
            await self.events.put(PeerBusy(peer, index))
            return
        except PeerError:
            await self.events.put(ChunkFailed(peer, index))
            return
        except ChunkError:
            await self.events.put(ChunkCorrupted(peer, index))
            return
        # inline: a 256 KiB page-cache write (~0.25 ms) beats a thread hop under a busy loop
        self.node.store.put_chunk(data, self.m.chunks[index])
        self.node.peer_served(peer)
        self.node.notify_have()
        self.node.count_download(len(data))
        if self.on_chunk is not None:
            self.on_chunk(len(data))
        await self.events.put(ChunkVerified(peer, index, len(data)))

    async def _follow(self, peer: str) -> None:
        """Long-poll one peer's have-map: each answer comes as soon as it holds more."""
        assert self.node.client is not None
        known, failures = -1, 0
        while not self.done.is_set() and peer in self.node.peers and failures < 3:
            query = "" if known < 0 else f"?known={known}"  # the first answer comes at once
            try:
                res = await self.node.client.get_json(f"{peer}/have/{self.m.digest}{query}")
            except PeerError:
                failures += 1
                await asyncio.sleep(self.node.cfg.have_poll_s * failures)
                continue
            if not (isinstance(res, dict) and isinstance(res.get("have"), list)):
                failures += 1
                await asyncio.sleep(self.node.cfg.have_poll_s * failures)
                continue
            failures = 0
            have = [i for i in res["have"] if isinstance(i, int)]
            known = len(have)
            await self.events.put(PeerHad(peer, frozenset(have)))

    async def _poll_haves(self) -> None:
        """Keep one have-map follower per usable peer (peers come and go during a download)."""
        while not self.done.is_set():
            for peer in self.node.usable_peers():
                task = self.followers.get(peer)
                if task is None or task.done():
                    self.followers[peer] = asyncio.create_task(self._follow(peer))
            await asyncio.sleep(self.node.cfg.have_poll_s)

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

    async def run(self) -> None:
        """Fetch every missing chunk; on return the whole payload is in the store, verified."""
        loop = asyncio.get_running_loop()
        helpers = [asyncio.create_task(self._poll_haves()), asyncio.create_task(self._tick())]
        try:
            self._act(self.sched.handle(TimerFired(), loop.time()))
            while not self.done.is_set():
                event = await self.events.get()
                self._act(self.sched.handle(event, loop.time()))
        finally:
            self.done.set()
            pending = [*helpers, *self.requests.values(), *self.followers.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if await asyncio.to_thread(self.node.store.verify_pack, self.m):
            return
        if self.attempt >= MAX_ATTEMPTS:  # the disk keeps losing what we store: stop, loudly
            raise StoreError(
                f"{self.m.digest}: chunks stored for this payload keep failing "
                f"their hash on disk ({self.attempt} downloads)"
            )
        # a stored chunk vanished or rotted on disk: fetch what is missing again
        await Download(self.node, self.m, self.sched.config, self.on_chunk, self.attempt + 1).run()


async def fetch_payload(
    node: Node,
    manifest: Manifest,
    config: SwarmConfig | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    # A random tie-break seed per download: peers start on different chunks, so they have
    # something to trade from the first second.
    cfg = node.cfg
    config = config or SwarmConfig(
        max_requests_per_peer=cfg.max_requests_per_peer,
        min_requests_per_peer=cfg.min_requests_per_peer,
        max_requests_total=cfg.max_requests_total,
        min_request_timeout_s=cfg.min_request_timeout_s,
        seed=random.getrandbits(31),
    )
    await Download(node, manifest, config, on_chunk).run()
