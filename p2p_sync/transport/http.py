"""HTTP data plane (aiohttp): where the bulk bytes flow between peers.

Why HTTP and not libp2p streams for chunks: on 2 cores aiohttp moves ~700 MiB/s at ~1 CPU-s/GiB,
py-libp2p ~50-90 MiB/s at ~11 CPU-s/GiB (architecture guide, section 3).

Routes (all responses are small JSON except chunk bodies and metrics):

=========================  ==================================================================
GET  /chunk/{sha256}        the chunk's bytes (re-verified from the store), 404 if absent; at
                            most ``max_concurrent_uploads`` at once, up to ``upload_queue``
                            more wait their turn, beyond that (or after waiting
                            ``request_timeout_s``) 503; a reader slower than
                            ``request_timeout_s`` is cut off
GET  /manifests             [{digest, version, kind, base_version, payload_size}] known here;
                            ``?version=N`` lists only that version's manifests
GET  /manifest/{digest}     the signed manifest bytes, as received from the trainer
GET  /have/{digest}         {"have": [chunk indices this node can serve for that manifest]};
                            with ``?known=N`` a long poll: the answer waits (up to
                            ``have_wait_s``) until the list is no longer N long, so news
                            of a chunk reaches peers one latency after it is verified
GET  /peers                 {"peers": [base URLs this node knows]}
POST /announce              {"url": sender base URL or null, "digests": [...]} -> 202
GET  /status                JSON: version, state_hash, peers, bytes_uploaded, bytes_downloaded...
GET  /metrics               Prometheus text exposition
=========================  ==================================================================

Everything a peer sends is untrusted: path parameters are validated before use, request bodies
are capped (``max_request_bytes``), and any malformed request gets a 4xx without touching state.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from p2p_sync.errors import PeerBusyError, PeerError  # noqa: F401 (re-exported)
from p2p_sync.ratelimit import TokenBucket

HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of the data plane, on both sides."""

    max_concurrent_uploads: int = 16
    max_request_bytes: int = 64 * 1024
    max_json_bytes: int = 16 * 2**20
    max_chunk_bytes: int = 64 * 2**20
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 3.0
    max_upload_mbps: float = 0.0  # cap on chunk bytes served, Mbit/s (0: no cap)
    upload_queue: int = 64  # chunk requests waiting for an upload slot; more get a 503
    have_wait_s: float = 5.0  # longest hold of a long-polled have-map (< request_timeout_s)


class NodeView(Protocol):
    """What the data plane needs from a node (implemented by ``node.runtime.Node``)."""

    def manifest_index(self) -> list[dict[str, Any]]: ...
    def manifest_bytes(self, digest: str) -> bytes | None: ...
    def have(self, digest: str, requester: str | None) -> list[int] | None: ...
    async def have_changed(self, timeout: float) -> None: ...
    def chunk(self, sha256: str) -> bytes | None: ...
    def peer_urls(self) -> list[str]: ...
    def status(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...
    def count_upload(self, nbytes: int) -> None: ...
    def on_announce(self, url: str | None, digests: list[str]) -> None: ...
    def add_peer(self, url: str) -> None: ...


def _requester(request: web.Request) -> str | None:
    return request.headers.get("X-P2PSync-Peer")


class DataServer:
    """The aiohttp application serving one node."""

    def __init__(self, node: NodeView, limits: HttpLimits = HttpLimits()) -> None:
        self.node, self.limits = node, limits
        self._uploads = asyncio.Semaphore(limits.max_concurrent_uploads)
        self._queued = 0
        rate = limits.max_upload_mbps * 1e6 / 8 or None
        self._bucket = TokenBucket(rate, max(rate / 10, 1 << 20)) if rate else None
        self.app = web.Application(
            client_max_size=limits.max_request_bytes, middlewares=[self._learn_requester]
        )
        self.app.add_routes(
            [
                web.get("/chunk/{sha}", self.get_chunk),
                web.get("/manifests", self.get_manifests),
                web.get("/manifest/{digest}", self.get_manifest),
                web.get("/have/{digest}", self.get_have),
                web.get("/peers", self.get_peers),
                web.post("/announce", self.post_announce),
                web.get("/status", self.get_status),
                web.get("/metrics", self.get_metrics),
            ]
        )
        self._runner: web.AppRunner | None = None

    @web.middleware
    async def _learn_requester(self, request: web.Request, handler) -> web.StreamResponse:
        """Peers name their own data-plane URL in a header: that is how a node that only knew
        the trainer becomes known to everyone (via the trainer's /peers list)."""
        url = _requester(request)
        if url is not None and valid_peer_url(url):
            self.node.add_peer(url)
        return await handler(request)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0 picks a free one); returns the bound port."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = site._server  # aiohttp exposes the bound sockets only here
        assert server is not None and server.sockets
        return int(server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @staticmethod
    def _hex_param(request: web.Request, name: str) -> str:
        value = request.match_info[name]
        if not HEX64.match(value):
            raise web.HTTPBadRequest(text=f"{name} must be 64 lowercase hex digits")
        return value

    async def _upload_slot(self) -> None:
        """Wait for an upload slot (bounded queue, bounded wait) or refuse with 503."""
        if self._uploads.locked() and self._queued >= self.limits.upload_queue:
            raise web.HTTPServiceUnavailable(text="upload queue full")
        self._queued += 1
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                await self._uploads.acquire()
        except TimeoutError:
            raise web.HTTPServiceUnavailable(text="no upload slot in time") from None
        finally:
            self._queued -= 1

    async def get_chunk(self, request: web.Request) -> web.StreamResponse:
        sha = self._hex_param(request, "sha")
        await self._upload_slot()
        try:
            return await self._send_chunk(request, sha)
        finally:
            self._uploads.release()

    async def _send_chunk(self, request: web.Request, sha: str) -> web.StreamResponse:
        data = self.node.chunk(sha)  # inline: ~0.3 ms (read + re-hash), less than a thread hop
        if data is None:
            raise web.HTTPNotFound(text="no such chunk here")
        if self._bucket is not None:  # upload cap: wait our turn before sending
            await asyncio.sleep(self._bucket.reserve(len(data), time.monotonic()))
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = len(data)
        try:  # a reader too slow to take the chunk in time loses it, and frees the slot
            async with asyncio.timeout(self.limits.request_timeout_s):
                await response.prepare(request)
                await response.write(data)
                await response.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.close()
            return response
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            return response  # the requester gave up (cancelled in endgame, or timed out)
        self.node.count_upload(len(data))
        return response

    async def get_manifests(self, request: web.Request) -> web.Response:
        index = self.node.manifest_index()
        if "version" in request.query:  # manifests of one version (patch, snapshot, catch-ups)
            try:
                version = int(request.query["version"])
            except ValueError:
                raise web.HTTPBadRequest(text="version must be an integer") from None
            index = [m for m in index if m["version"] == version]
        return web.json_response(index)

    async def get_manifest(self, request: web.Request) -> web.Response:
        data = self.node.manifest_bytes(self._hex_param(request, "digest"))
        if data is None:
            raise web.HTTPNotFound(text="no such manifest here")
        return web.Response(body=data, content_type="application/json")

    async def get_have(self, request: web.Request) -> web.Response:
        digest, requester = self._hex_param(request, "digest"), _requester(request)
        known = request.query.get("known")
        if known is not None and not (known.isdigit() and len(known) < 9):
            raise web.HTTPBadRequest(text="known must be a small non-negative integer")
        have = self.node.have(digest, requester)
        deadline = time.monotonic() + self.limits.have_wait_s
        while have is not None and known is not None and len(have) == int(known):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self.node.have_changed(left)
            have = self.node.have(digest, requester)
        if have is None:
            raise web.HTTPNotFound(text="no such manifest here")
        return web.json_response({"have": have})

    async def get_peers(self, request: web.Request) -> web.Response:
        return web.json_response({"peers": self.node.peer_urls()})

    async def post_announce(self, request: web.Request) -> web.Response:
        try:
            doc = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):  # an oversized body is a 413
            raise web.HTTPBadRequest(text="body must be JSON of at most 64 KiB") from None
        url, digests = (doc.get("url"), doc.get("digests")) if isinstance(doc, dict) else (0, 0)
        if not (url is None or isinstance(url, str)) or not isinstance(digests, list):
            raise web.HTTPBadRequest(text="expected {url, digests}")
        if not all(isinstance(d, str) and HEX64.match(d) for d in digests):
            raise web.HTTPBadRequest(text="digests must be 64 hex digits each")
        if url is not None and not valid_peer_url(url):
            raise web.HTTPBadRequest(text="url must be http://host:port")
        self.node.on_announce(url, digests)
        return web.json_response({"ok": True}, status=202)

    async def get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.node.status())

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.node.metrics_text(), content_type="text/plain")


URL = re.compile(r"^http://[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def valid_peer_url(url: str) -> bool:
    return bool(URL.match(url)) and len(url) < 256


class DataClient:
    """Client side of the data plane, with size and time limits on every response."""

    def __init__(self, self_url: str | None, limits: HttpLimits = HttpLimits()) -> None:
        self.limits, self.self_url = limits, self_url
        headers = {"X-P2PSync-Peer": self_url} if self_url else {}
        timeout = aiohttp.ClientTimeout(
            total=limits.request_timeout_s, sock_connect=limits.connect_timeout_s
        )
        self.session = aiohttp.ClientSession(timeout=timeout, headers=headers)

    async def close(self) -> None:
        await self.session.close()

    async def _get(self, url: str, limit: int) -> bytes:
        try:
            async with self.session.get(url) as resp:
                if resp.status == 503:
                    raise PeerBusyError(f"{url}: busy")
                if resp.status != 200:
                    raise PeerError(f"{url}: HTTP {resp.status}")
                if (resp.content_length or 0) > limit:
                    raise PeerError(f"{url}: response of {resp.content_length} bytes over limit")
                if resp.content_length is not None:  # the common case: one read, no copies
                    return await resp.read()
                body = bytearray()  # chunked encoding: accumulate up to the limit
                async for piece in resp.content.iter_chunked(1 << 16):
                    body += piece
                    if len(body) > limit:
                        raise PeerError(f"{url}: response over {limit} bytes")
                return bytes(body)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise PeerError(f"{url}: {type(exc).__name__} {exc}") from None

    async def get_json(self, url: str) -> Any:
        body = await self._get(url, self.limits.max_json_bytes)
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise PeerError(f"{url}: not JSON") from None

    async def get_bytes(self, url: str, limit: int | None = None) -> bytes:
        return await self._get(url, limit or self.limits.max_chunk_bytes)

    async def announce(self, peer: str, digests: list[str]) -> None:
        try:
            async with self.session.post(
                f"{peer}/announce", json={"url": self.self_url, "digests": digests}
            ) as resp:
                if resp.status != 202:
                    raise PeerError(f"{peer}: announce got HTTP {resp.status}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise PeerError(f"{peer}: {type(exc).__name__} {exc}") from None


async def gather_quietly(calls: list[Awaitable[Any]]) -> list[Any]:
    """Run calls concurrently; a PeerError becomes None in the result (peers come and go)."""

    async def one(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except PeerError:
            return None

    return list(await asyncio.gather(*(one(c) for c in calls)))
