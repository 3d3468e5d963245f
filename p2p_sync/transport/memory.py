"""An in-memory network: many nodes in one process, one event loop, no sockets.

The py-ipv8 way of testing a P2P protocol: N real nodes (their stores, trust gates, peer
directories, learners, download drivers and routers) in one process, with only the wire
replaced. Requests go straight to the target node's :class:`~p2p_sync.transport.dataplane.
DataRouter`, the code that answers HTTP requests in a real node, so what a test checks here is
what a node serves; gossip goes through each receiver's :class:`~p2p_sync.transport.gossip.
GossipValidator`, the code a libp2p host runs inside gossipsub validation.

What it does not model: bandwidth, connection set-up, partial reads (the simulator and the
netns tier cover those). What it adds for tests: ``cut`` / ``restore`` a node's reachability,
an optional one-way ``latency_s``, and a count of requests by route.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from p2p_sync.errors import PeerError
from p2p_sync.transport.announcement import announce_body, announce_doc
from p2p_sync.transport.client import check_reply, parse_json, split_parts
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.gossip import GossipValidator, Judge, OnAccept, OnKnown
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import Request

SUFFIX = ".mem"


class MemoryNetwork:
    """Named data planes and one gossip topic, shared by the nodes of one test."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.routers: dict[str, DataRouter] = {}
        self.gossip: dict[str, MemoryGossipHost] = {}
        self.down: set[str] = set()
        self.requests = collections.Counter[str]()  # route name -> requests made
        self._next_port = 1

    def listen(self, router: DataRouter, name: str) -> str:
        """Attach a node's router; returns its URL (``http://<name>.mem:<port>``)."""
        url = f"http://{name}{SUFFIX}:{self._next_port}"
        self._next_port += 1
        self.routers[url] = router
        return url

    def close(self, url: str) -> None:
        router = self.routers.pop(url, None)
        if router is not None:
            router.close()

    def cut(self, url: str) -> None:
        """Make ``url`` unreachable (its requests and gossip fail) until :meth:`restore`."""
        self.down.add(url)

    def restore(self, url: str) -> None:
        self.down.discard(url)

    def router(self, url: str) -> DataRouter:
        base = f"http://{urlsplit(url).netloc}"
        router = self.routers.get(base)
        if router is None or base in self.down:
            raise PeerError(f"{base}: connection refused")
        return router

    async def travel(self) -> None:
        """One way across the network: the latency, or at least one turn of the loop."""
        await asyncio.sleep(self.latency_s)


async def _pump(
    feed: AsyncGenerator[bytes, None], lines: asyncio.Queue[tuple[float, bytes] | None]
) -> None:
    """Run a router's feed as its server would, each line stamped with when it was written;
    None once it ends (closed here: cancelling the pump closes it)."""
    loop = asyncio.get_running_loop()
    try:
        async for line in feed:
            lines.put_nowait((loop.time(), line))
    finally:
        lines.put_nowait(None)
        await feed.aclose()


class MemoryClient:
    """A node's client over the memory network (the face of ``http.DataClient``)."""

    def __init__(
        self, network: MemoryNetwork, self_url: str | None, limits: HttpLimits = HttpLimits()
    ) -> None:
        self.network, self.self_url, self.limits = network, self_url, limits
        # the requester's address as a server sees it: its name's host (a public network)
        self.address = urlsplit(self_url).hostname if self_url else None

    def _req(self, method: str, url: str, body: bytes = b"") -> Request:
        """``url`` as the router sees it (counted by route)."""
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self.network.requests[parts.path.strip("/").split("/")[0]] += 1
        return Request(method, parts.path, query, self.self_url, body, self.address)

    async def _back(self, url: str) -> None:
        """An answer's way back: the latency, and lost if we were cut meanwhile."""
        await self.network.travel()
        if self.self_url in self.network.down:
            raise PeerError(f"{url}: connection lost")

    async def _request(
        self, method: str, url: str, limit: int, body: bytes = b"", expect: int = 200
    ) -> bytes:
        req = self._req(method, url, body)
        await self.network.travel()
        router = self.network.router(url)
        async with router.serve(req) as reply:
            check_reply(url, reply.status, len(reply.body), limit, expect)
        await self._back(url)
        router.sent(reply)
        return reply.body

    async def get_feed(self, url: str) -> AsyncIterator[Any]:
        """As over HTTP: the first answer, then each line of the router's feed, each a
        latency after the router wrote it (the router writes on while lines travel)."""
        req = self._req("GET", url)
        await self.network.travel()
        async with self.network.router(url).serve(req) as reply:
            check_reply(url, reply.status, len(reply.body), self.limits.max_json_bytes)
            lines: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
            pump = asyncio.create_task(_pump(reply.feed, lines)) if reply.feed else None
            try:
                await self._back(url)
                yield parse_json(url, reply.body)
                while pump is not None and (item := await lines.get()) is not None:
                    await self._arrive(url, item[0])
                    yield parse_json(url, item[1])
            finally:
                if pump is not None:
                    pump.cancel()
                    await asyncio.gather(pump, return_exceptions=True)

    async def _arrive(self, url: str, written: float) -> None:
        """A line written at ``written`` (loop time) arrives a latency later."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, written + self.network.latency_s - loop.time()))
        down = self.network.down
        if self.self_url in down or f"http://{urlsplit(url).netloc}" in down:
            raise PeerError(f"{url}: connection lost")

    async def get_json(self, url: str) -> Any:
        return parse_json(url, await self._request("GET", url, self.limits.max_json_bytes))

    async def get_bytes(
        self, url: str, limit: int | None = None, moved: Callable[[int], None] | None = None
    ) -> bytes:
        """A reply comes whole, a latency after it was written: nothing to tell ``moved``."""
        return await self._request("GET", url, limit or self.limits.max_chunk_bytes)

    def get_parts(self, url: str, sizes: list[int]) -> AsyncIterator[bytes]:
        return split_parts(self.get_bytes(url), url, sizes)

    async def post_json(self, url: str, doc: Any) -> Any:
        body = json.dumps(doc).encode()
        return parse_json(url, await self._request("POST", url, self.limits.max_json_bytes, body))

    async def announce(
        self,
        peer: str,
        digests: list[str],
        extra: Mapping[str, Any] | None = None,
        chunks: list[bytes] | None = None,
        manifests: bytes = b"",
    ) -> None:
        doc = announce_doc(self.self_url, digests, extra)
        body = announce_body(doc, chunks, manifests)
        await self._request("POST", f"{peer}/announce", 1024, body, 202)

    async def close(self) -> None:
        pass


class MemoryGossipHost:
    """A libp2p host's face (``start``, ``stop``, ``publish``, ``status``) over the memory
    network: every host subscribed to one topic, each message validated by every receiver."""

    def __init__(
        self,
        network: MemoryNetwork,
        url: str,
        judge: Judge,
        on_accept: OnAccept,
        on_peer_url: Callable[[str, bool], None],
        known: Callable[[str], bool],
        on_known: OnKnown | None = None,
        max_rejects: int = 3,
        seen_digests: int = 4096,
    ) -> None:
        self.network, self.url, self.on_peer_url = network, url, on_peer_url
        self.gate = GossipValidator(
            judge, on_accept, known, on_known, self._schedule, max_rejects, seen_digests
        )
        self.blacklist: set[str] = set()
        self.addr = f"/memory/{url[7:]}"
        self._loop: asyncio.AbstractEventLoop | None = None

    def _schedule(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon(fn, *args)

    async def start(self) -> str:
        """Join the topic; every member learns every other's URL (as signed peer records
        carry them over libp2p)."""
        self._loop = asyncio.get_running_loop()
        for other in self.network.gossip.values():
            other._schedule(other.on_peer_url, self.url, False)
            self._schedule(self.on_peer_url, other.url, False)
        self.network.gossip[self.url] = self
        return self.addr

    async def stop(self) -> None:
        self.network.gossip.pop(self.url, None)

    def advertise(self, http_url: str | None, behind_nat: bool = False) -> None:
        """Every node of the memory network is reachable by its URL: nothing changes."""

    async def publish(self, data: bytes) -> None:
        """Deliver to every other member not cut off and not blacklisting us."""
        await self.network.travel()
        for host in list(self.network.gossip.values()):
            if host is self or self.url in host.blacklist or host.url in self.network.down:
                continue
            if host.gate.validate(data, self.url, self.url).blacklist:
                host.blacklist.add(self.url)

    def status(self) -> dict[str, Any]:
        counts = self.gate.counts
        return {
            "peer_id": self.url,
            "connected": len(self.network.gossip) - 1,
            "mesh_peers": len(self.network.gossip) - 1,  # every member meshed with every other
            "blacklisted": len(self.blacklist),
            "accepted": counts["accept"],
            "rejected": counts["reject"],
            "ignored": counts["ignore"],
        }
