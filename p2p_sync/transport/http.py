"""HTTP data plane (aiohttp): where the bulk bytes flow between peers.

Why HTTP and not libp2p streams for chunks: on 2 cores aiohttp moves ~700 MiB/s at ~1 CPU-s/GiB,
py-libp2p ~50-90 MiB/s at ~11 CPU-s/GiB (architecture guide, section 3).

The routes and what they answer are ``transport.dataplane``'s (one router, also behind the
in-memory network); this module only carries requests and replies over aiohttp, streaming a
chunk in pieces: a reader that takes no piece for ``request_timeout_s`` loses it (and frees
its upload slot), a slow one that keeps reading does not. The client's clock works the same
way for chunks (no byte for twice ``request_timeout_s``: the server's 503 for a slot not
granted in time comes first), so a transfer that keeps moving is never cut: a 4 MiB chunk
shared 16 ways on a 10 Mbit/s uplink takes ~54 s, and only the scheduler's adaptive timeout
(``p2p_sync.protocol.swarm``) decides whether that is worth waiting for.

The server holds a bounded number of connections (``transport.connections``: one over the cap
gets a 503 and is closed), and closes one whose request header is not whole
``header_timeout_s`` after it opened or after that request's first byte (slow-loris), or that
waits ``idle_timeout_s`` with no request in progress (aiohttp's keep-alive timeout). It
accepts connections itself: when an accept fails (a process out of descriptors) it waits a
while, longer while they keep failing. Refusals and failed accepts are logged one line a
minute at most, each saying how many it stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from p2p_sync.errors import PeerBusyError, PeerError, PeerLacksError, PeerUnreachableError
from p2p_sync.protocol.ratelimit import RepeatedLine
from p2p_sync.transport import tcp
from p2p_sync.transport.announcement import (
    ANNOUNCE_TYPE,
    announce_doc,
    frame_announce,
    read_announce_head,
)
from p2p_sync.transport.client import check_reply, parse_json
from p2p_sync.transport.connections import ConnectionGate, address_key
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import PEER_HEADER, PIECE, Refused, Reply, Request, chunk_path
from p2p_sync.transport.nodeview import NodeView
from p2p_sync.transport.reverse import PATH as REVERSE
from p2p_sync.transport.reverse import ReverseHub
from p2p_sync.transport.sessions import RenewedPools
from p2p_sync.transport.tls import SwarmTls, tls_url

__all__ = ["DataClient", "DataServer", "HttpLimits", "PeerBusyError", "PeerError"]

log = logging.getLogger("p2psync.http")
LOG_EVERY_S = 60.0  # one line a minute at most for what a peer can repeat at will
# the answer to a connection over the cap, sent as it is accepted (no request read)
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
BACKLOG = 128  # connections the kernel holds ready to accept (aiohttp's default)
ACCEPT_PAUSE_S = (0.05, 1.0)  # after a failed accept, then doubled while accepts fail
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


class _Connection(web.RequestHandler):
    """aiohttp's handler of one accepted connection, counted in the server's gate until it
    closes, and timed while it waits for a request header: ``header_timeout_s`` from the
    connection's start, then from the first byte of each later request. aiohttp (3.14) times
    idle keep-alive connections but has no header timeout: this reads two fields of its
    handler, ``_waiter`` (set while it waits for a request) and ``_request_count`` (headers
    parsed)."""

    __slots__ = ("_owner", "_key", "counted", "_clock")

    def __init__(self, owner: DataServer, key: str, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._owner, self._key = owner, key  # the address it counts against
        self.counted = False  # from connection_made to connection_lost
        self._clock: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.counted = True
        super().connection_made(transport)
        self._start_clock()

    def data_received(self, data: bytes) -> None:
        if self._clock is None and data and self._waiting():  # a later request begins
            self._start_clock()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a header is whole
            self._stop_clock()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.counted:
            self.counted = False
            self._owner.gate.release(self._key)
        self._stop_clock()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _start_clock(self) -> None:
        limit = self._owner.limits.header_timeout_s
        self._clock = self._loop.call_later(limit, self._header_late)

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    def _header_late(self) -> None:
        self._clock = None
        self.force_close()


class _Site(web.BaseSite):
    """A listening socket that ``accept`` (a task) serves, stopped with the runner as any
    aiohttp site. aiohttp's ``TCPSite`` leaves accepting to asyncio, whose loop (3.11) logs
    each accept that finds no free descriptor, traceback and all, up to ``backlog`` times a
    turn, and sets a retry timer for each; measured with 4 connections waiting: 100 lines in
    the first second, 600 to 800 a second from the third on."""

    __slots__ = ("_sock", "_accept", "_task")

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        accept: Callable[[socket.socket], Awaitable[None]],
    ) -> None:
        super().__init__(runner)
        self._sock, self._accept = sock, accept
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        self._task = asyncio.create_task(self._accept(self._sock))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close()
        await super().stop()


async def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on the first address ``host`` names (an IP address in practice);
    port 0 picks a free one."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, address = infos[0]
    sock = socket.create_server(address, family=family, backlog=BACKLOG)
    sock.setblocking(False)
    return sock


class DataServer:
    """The aiohttp application serving one node's router, on connections it accepts itself
    (bounded by its gate, their headers and idleness timed: the module's docstring)."""

    def __init__(
        self, node: NodeView, limits: HttpLimits = HttpLimits(), tls: SwarmTls | None = None
    ) -> None:
        self.router, self.limits, self.tls = DataRouter(node, limits), limits, tls
        gate = [] if tls is None else [self._members_only]
        self.app = web.Application(client_max_size=limits.max_request_bytes, middlewares=gate)
        self.app.add_routes(
            [web.get(REVERSE, self._reverse), web.route("*", "/{tail:.*}", self._handle)]
        )
        self._runner: web.AppRunner | None = None
        self.gate = ConnectionGate.of(limits)
        self.refusals = RepeatedLine(LOG_EVERY_S)
        self.accept_failures = RepeatedLine(LOG_EVERY_S)
        self.reverse: ReverseHub | None = None  # NATed peers' channels (``transport.reverse``)
        self.tcp: dict[str, Any] | None = None  # its sockets' congestion control (tcp.report)

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0 picks a free one); returns the bound port."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = await _listen(host, port)
        wanted = self.limits.tcp_congestion
        # accepted connections inherit the listener's congestion control
        self.tcp = tcp.report(tcp.apply(sock, wanted))
        tcp.announce(self.tcp, wanted)
        await _Site(self._runner, sock, self._accept_loop).start()
        return int(sock.getsockname()[1])

    async def _accept_loop(self, sock: socket.socket) -> None:
        """Accept connections as they come; after a failed accept (no free descriptor, most
        likely) wait ``ACCEPT_PAUSE_S``, doubled while accepts keep failing. A TLS handshake
        waits on its client (a round trip, or ``header_timeout_s`` for one that sends
        nothing), so each runs in a task of its own: the next accept never waits for it."""
        loop, pause = asyncio.get_running_loop(), ACCEPT_PAUSE_S[0]
        async with asyncio.TaskGroup() as handshakes:  # cancelled with this loop
            while True:
                try:
                    conn, peer = await loop.sock_accept(sock)
                except ConnectionAbortedError:
                    continue  # gone before it was accepted
                except OSError as exc:
                    self._accept_failed(exc)
                    await asyncio.sleep(pause)  # back off: not synchronization
                    pause = min(2 * pause, ACCEPT_PAUSE_S[1])
                    continue
                pause = ACCEPT_PAUSE_S[0]
                if self.tls is None:
                    await self._take(conn, peer)
                else:
                    handshakes.create_task(self._take(conn, peer))

    async def _take(self, conn: socket.socket, peer: Any) -> None:
        """Serve an accepted connection if the gate admits it, else answer 503 and close it."""
        key = address_key(str(peer[0]) if isinstance(peer, tuple) else "")
        if not self._admit(key):
            with contextlib.suppress(OSError):
                conn.send(BUSY)
            conn.close()
            return
        made: list[_Connection] = []

        def handler() -> _Connection:
            made.append(self._connection(key))
            return made[0]

        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                handler, conn, **self._tls_args()
            )
        except Exception as exc:  # a failed handshake, a reset: this connection's end only
            log.debug("data plane: connection from %s lost at once: %r", key, exc)
            if not (made and made[0].counted):  # else its connection_lost releases it
                self.gate.release(key)
            conn.close()

    def _tls_args(self) -> dict[str, Any]:
        """A private swarm's connections are TLS, their handshake timed as a request header."""
        if self.tls is None:
            return {}
        return {"ssl": self.tls.server, "ssl_handshake_timeout": self.limits.header_timeout_s}

    @web.middleware
    async def _members_only(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A private swarm's gate, on every request: a member (``SwarmTls.member``) is
        served; anyone else gets a bare health answer on ``GET /status`` and 403 elsewhere."""
        assert self.tls is not None
        if self.tls.member(request.transport) is not None:
            return await handler(request)
        if request.method == "GET" and request.path == "/status":
            return web.json_response({"ok": True, "private": True})
        return web.Response(status=403, text="members only")

    def _connection(self, key: str) -> _Connection:
        assert self._runner is not None and self._runner.server is not None
        return _Connection(
            self,
            key,
            self._runner.server,
            loop=asyncio.get_running_loop(),
            keepalive_timeout=self.limits.server_idle_s(self.tls is not None),
            access_log=None,
        )

    def _admit(self, key: str) -> bool:
        """Whether a connection from ``key`` may stay (counted if so); refusals are logged
        one line per ``LOG_EVERY_S`` at most, saying how many it stands for."""
        why = self.gate.admit(key)
        if why is None:
            return True
        if count := self.refusals.hit(time.monotonic()):
            log.warning(
                "data plane: refused a connection from %s: %s (%d refused since the last"
                " such line)",
                key,
                why,
                count,
            )
        return False

    def _accept_failed(self, exc: OSError) -> None:
        if not (count := self.accept_failures.hit(time.monotonic())):
            return
        hint = ""
        if exc.errno in OUT_OF_DESCRIPTORS:
            hint = ": raise the process's limit (ulimit -n) or lower [http] max_connections"
        log.warning(
            "data plane: accepting a connection failed (%s; %d failed since the last such"
            " line), trying again shortly%s",
            exc.strerror or exc,
            count,
            hint,
        )

    async def stop(self) -> None:
        self.router.close()
        if self.reverse is not None:  # its WebSocket handlers would hold the server open
            await self.reverse.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _reverse(self, request: web.Request) -> web.StreamResponse:
        if self.reverse is None:
            return web.Response(status=404, text="this node takes no reverse channels")
        return await self.reverse.accept(request)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        rest = None
        if request.method == "POST" and request.content_type == ANNOUNCE_TYPE:
            try:  # the JSON now, the chunks behind it as the router reads them
                body = await read_announce_head(request.content, self.limits)
            except Refused as r:
                return web.Response(status=r.status, text=r.text)
            rest = request.content
        else:
            body = await request.read() if request.method == "POST" else b""  # capped: a 413
        peer = request.headers.get(PEER_HEADER)
        req = Request(
            request.method, request.path, request.query, peer, body, request.remote, rest=rest
        )
        async with self.router.serve(req) as reply:
            if reply.feed is not None:
                return await self._feed(request, reply, reply.feed)
            if not reply.upload:
                return web.Response(
                    status=reply.status, body=reply.body, content_type=reply.content_type
                )
            return await self._stream(request, reply)

    async def _feed(
        self, request: web.Request, reply: Reply, feed: AsyncGenerator[bytes, None]
    ) -> web.StreamResponse:
        """``reply.body``, then each line of ``feed`` as it comes (chunked encoding), until
        the feed ends or the requester goes (it stopped following, or its download ended)."""
        response = web.StreamResponse(headers={"Content-Type": reply.content_type})
        try:
            await response.prepare(request)
            await response.write(reply.body)
            async for line in feed:
                await response.write(line)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the follower hung up: nothing to answer
        finally:
            await feed.aclose()
        return response

    async def _stream(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": reply.content_type})
        response.content_length = len(reply.body)
        body, limit = memoryview(reply.body), self.limits.request_timeout_s
        try:  # a reader that takes no piece in time loses the chunk, and frees the slot
            async with asyncio.timeout(limit) as clock:
                await response.prepare(request)
                for at in range(0, len(body), PIECE):
                    clock.reschedule(asyncio.get_running_loop().time() + limit)
                    await response.write(body[at : at + PIECE])
                await response.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.close()
            return response
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            return response  # the requester gave up (cancelled in endgame, or timed out)
        self.router.sent(reply)
        return response


class DataClient:
    """Client side of the data plane, with size and time limits on every response."""

    def __init__(
        self, self_url: str | None, limits: HttpLimits = HttpLimits(), tls: SwarmTls | None = None
    ) -> None:
        self.limits, self.self_url = limits, self_url  # self_url changes once reachability is known
        timeout = aiohttp.ClientTimeout(
            total=limits.request_timeout_s, sock_connect=limits.connect_timeout_s
        )
        context, keep = (None, None) if tls is None else (tls.client, limits.tls_keepalive_s)
        self.tls = tls
        self.sessions = RenewedPools(
            lambda: tcp.session(timeout, limits.tcp_congestion, context, keep),
            lambda: 0 if tls is None else tls.adopted,
        )
        self._bulk = aiohttp.ClientTimeout(  # chunks: cut only when no byte moves
            total=None,
            sock_connect=limits.connect_timeout_s,
            sock_read=limits.read_patience_s,
        )

    @property
    def _headers(self) -> dict[str, str]:
        return {PEER_HEADER: self.self_url} if self.self_url else {}

    def _wire(self, url: str) -> str:
        """The URL a request goes to: in a private swarm over TLS, with the revocation list
        looked at first (a revoked server gets no new connection)."""
        if self.tls is None:
            return url
        self.tls.refresh(time.time())
        return tls_url(url)

    async def close(self) -> None:
        await self.sessions.close()

    async def _get(
        self,
        url: str,
        limit: int,
        bulk: bool = False,
        moved: Callable[[int], None] | None = None,
    ) -> bytes:
        extra = {"timeout": self._bulk} if bulk else {}  # else the session's total limit
        try:
            async with self.sessions.request(
                "GET", self._wire(url), headers=self._headers, **extra
            ) as resp:
                check_reply(url, resp.status, resp.content_length or 0, limit)
                if moved is not None:  # a chunk whose progress is watched
                    return await _read_moving(url, resp.content, limit, moved)
                if resp.content_length is not None:  # the common case: one read, no copies
                    return await resp.read()
                body = bytearray()  # chunked encoding: accumulate up to the limit
                async for piece in resp.content.iter_chunked(1 << 16):
                    body += piece
                    if len(body) > limit:
                        raise PeerError(f"{url}: response over {limit} bytes")
                return bytes(body)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _peer_error(url, exc) from None

    async def get_json(self, url: str) -> Any:
        return parse_json(url, await self._get(url, self.limits.max_json_bytes))

    async def get_feed(self, url: str) -> AsyncIterator[Any]:
        """A have feed's answers, each parsed as soon as its line is in. Held open without
        a total limit, as long as something arrives within ``have_wait_s`` plus
        ``request_timeout_s`` (the server ends a silent feed after ``have_wait_s``); a line
        over ``max_json_bytes``, or one that is not JSON, is the peer's fault."""
        limit = self.limits.max_json_bytes
        patient = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.limits.connect_timeout_s,
            sock_read=self.limits.have_wait_s + self.limits.request_timeout_s,
        )
        try:
            async with self.sessions.request(
                "GET", self._wire(url), headers=self._headers, timeout=patient
            ) as resp:
                check_reply(url, resp.status, resp.content_length or 0, limit)
                pending = bytearray()
                async for piece in resp.content.iter_any():
                    pending += piece
                    while (end := pending.find(b"\n")) >= 0:
                        line = bytes(pending[:end])
                        del pending[: end + 1]
                        yield parse_json(url, line)
                    if len(pending) > limit:
                        raise PeerError(f"{url}: feed line over {limit} bytes")
                if pending.strip():  # a server that answers once, without a newline
                    yield parse_json(url, bytes(pending))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _peer_error(url, exc) from None

    async def get_bytes(
        self, url: str, limit: int | None = None, moved: Callable[[int], None] | None = None
    ) -> bytes:
        """A chunk (cut only when no byte arrives for a while: the scheduler's adaptive
        timeout bounds a slow one; ``moved`` hears how many bytes are in as they come) or a
        signed manifest (the whole-request limit: nothing else would stop a peer that
        trickles one byte at a time)."""
        bulk = chunk_path(url)
        return await self._get(url, limit or self.limits.max_chunk_bytes, bulk, moved)

    async def get_parts(self, url: str, sizes: list[int]) -> AsyncIterator[bytes]:
        """A run of chunks (``/chunks``), each handed on as soon as its bytes are in (a relay
        can offer it while the rest is on its way), timed as one chunk is. Its length is
        judged after the parts (as ``split_parts`` does): bytes failing their hash get the
        peer banned even when it sends too many."""
        try:
            async with self.sessions.request(
                "GET", self._wire(url), headers=self._headers, timeout=self._bulk
            ) as resp:
                check_reply(url, resp.status, resp.content_length or 0, self.limits.max_chunk_bytes)
                for size in sizes:
                    first = await resp.content.read(1)
                    if not first:  # the peer stopped before this chunk: it lacks it
                        return
                    yield first + await resp.content.readexactly(size - 1)
                if await resp.content.read(1):
                    raise PeerError(f"{url}: reply over the chunks' length")
        except PeerLacksError:  # it lacks the first
            return
        except asyncio.IncompleteReadError:
            raise PeerError(f"{url}: reply ends within a chunk") from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _peer_error(url, exc) from None

    async def post_json(self, url: str, doc: Any) -> Any:
        return parse_json(url, await self._post(url, doc, 200))

    async def announce(
        self,
        peer: str,
        digests: list[str],
        extra: Mapping[str, Any] | None = None,
        chunks: list[bytes] | None = None,
        manifests: bytes = b"",
    ) -> None:
        doc = announce_doc(self.self_url, digests, extra)
        if not (chunks or manifests):
            await self._post(f"{peer}/announce", doc, 202)
            return
        body = {"data": frame_announce(doc, chunks or [], manifests), "timeout": self._bulk}
        await self._post(f"{peer}/announce", None, 202, body, {"Content-Type": ANNOUNCE_TYPE})

    async def _post(
        self,
        url: str,
        doc: Any,
        expect: int,
        raw: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        """POST ``doc`` as JSON, or ``raw``'s data (and its timeout) as it is."""
        limit = self.limits.max_json_bytes
        body = raw or {"json": doc}
        headers = {**self._headers, **(headers or {})}
        try:
            async with self.sessions.request(
                "POST", self._wire(url), headers=headers, **body
            ) as resp:
                check_reply(url, resp.status, resp.content_length or 0, limit, expect)
                return await resp.content.read(limit)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _peer_error(url, exc) from None


async def _read_moving(
    url: str, content: aiohttp.StreamReader, limit: int, moved: Callable[[int], None]
) -> bytes:
    """A body read as its pieces come, up to ``limit``, each piece told to ``moved`` (the
    bytes in so far): one copy at the end, as ``ClientResponse.read`` makes."""
    pieces, got = [], 0
    async for piece in content.iter_any():
        pieces.append(piece)
        got += len(piece)
        if got > limit:
            raise PeerError(f"{url}: response over {limit} bytes")
        moved(got)
    return b"".join(pieces)


def _peer_error(url: str, exc: BaseException) -> PeerError:
    """A failed request as a PeerError; PeerUnreachableError when no connection was made
    (a shortcut to that address is then worth dropping: ``transport.lan``)."""
    unreachable = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
    kind = PeerUnreachableError if isinstance(exc, unreachable) else PeerError
    return kind(f"{url}: {type(exc).__name__} {exc}")
