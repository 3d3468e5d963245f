"""The data plane over libp2p streams, for nodes nobody can dial (behind a NAT).

Why: a volunteer behind a home router or a carrier-grade NAT can dial out but cannot be dialed,
so its HTTP URL is useless to others. Its libp2p connections are ones it opened itself, and a
libp2p connection carries streams both ways: a peer it dialed opens a stream back over that
connection and fetches chunks from it. Two NATed nodes meet through a circuit relay (a public
node forwarding a stream) when neither can dial the other.

Such a node is named ``p2p://<peer-id>`` wherever an HTTP node is named by its URL (peer lists,
the ``X-P2PSync-Peer`` header, announcements), and :class:`RoutedClient` sends each request
down the matching transport: the reverse channel the peer opened to this node when there is
one (``transport.reverse``, a WebSocket at about HTTP's CPU cost), else a stream. The requests
and answers are the data plane's own (``transport.dataplane``: same routes, limits, upload
slots and verification), so a chunk served over a stream is judged exactly like one served
over HTTP.

The wire format of protocol ``/p2psync/data/1.0.0`` is ``transport.frames``'s. A stream carries
one request at a time and any number in sequence (as HTTP/1.1 keep-alive does): a new stream
costs a protocol negotiation, one more round trip per chunk, and most of the CPU of a small
request. The requester keeps a few idle streams per peer (:class:`StreamPool`, at most
``POOL_PER_PEER``, none older than ``IDLE_S``); the server closes a stream idle for ``2 *
IDLE_S``. The requester's peer id is authenticated by the connection (Noise): a ``p2p://`` name
it claims must be its own. Bounds: a request (header and body) is at most
``max_request_bytes``, a reply header at most ``MAX_REPLY_HEADER``, a reply body at most what
the caller expects (checked before it is read). Time: a reply starts within
``request_timeout_s``, and a chunk's body is then timed by progress, as over HTTP
(``transport.http``): each ``PIECE`` written within ``request_timeout_s`` (else the stream is
reset), each read within twice that; a slow transfer that keeps moving is never cut.

Only the asyncio classes at the bottom touch the event loop; the trio functions run in the
libp2p host's thread (``transport.p2p``) and only move bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

if TYPE_CHECKING:
    from p2p_sync.transport.lan import LanShortcuts

from p2p_sync.errors import PeerError, PeerUnreachableError
from p2p_sync.transport.client import PeerClient, check_reply
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.frames import (
    MAX_REPLY_HEADER,
    SCHEME,
    U32,
    FramedClient,
    encode_reply_header,
    encode_request,
    parse_reply_header,
    parse_request_header,
    peer_url,
    split_url,
)
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import PIECE, Reply, Request, chunk_path

PROTOCOL = "/p2psync/data/1.0.0"
IDLE_S = 15.0  # a requester reuses an idle stream this long; the server keeps it twice as long
POOL_PER_PEER = 8  # idle streams a requester keeps per peer
T = TypeVar("T")


# ---------------------------------------------------------------- stream I/O (trio thread)


async def read_exactly(stream: Any, n: int, progress: Callable[[], None] | None = None) -> bytes:
    """``n`` bytes from the stream; EOFError if it ends first. ``progress`` is called before
    each read (a caller that times by progress moves its deadline there)."""
    parts, got = [], 0
    while got < n:
        if progress is not None:
            progress()
        piece = await stream.read(min(n - got, PIECE))
        if not piece:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        parts.append(piece)
        got += len(piece)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_framed(stream: Any, limit: int, first: bytes = b"") -> bytes:
    """One ``u32 n | n bytes`` frame of at most ``limit`` bytes (``first``: its first bytes,
    already read)."""
    (n,) = U32.unpack(first + await read_exactly(stream, U32.size - len(first)))
    if n > limit:
        raise ValueError(f"frame of {n} bytes, over the limit of {limit}")
    return await read_exactly(stream, n)


async def next_request(stream: Any, peer_id: str, limits: HttpLimits) -> Request | None:
    """The stream's next request; None when the requester closed it or left it idle for
    ``2 * IDLE_S``. ValueError / EOFError / TooSlowError: malformed, cut or too slow."""
    with trio.move_on_after(2 * IDLE_S):
        try:
            first = await stream.read(U32.size)
        except Exception:  # closed or reset by the requester
            return None
        if not first:
            return None
        with trio.fail_after(limits.request_timeout_s):
            return await read_request(stream, peer_id, limits, first)
    return None


async def read_request(
    stream: Any, peer_id: str, limits: HttpLimits, first: bytes = b""
) -> Request:
    """A request as the data router takes it (``first``: bytes of it already read). The
    connection proved the requester's peer id, so a ``p2p://`` name it claims must be its own
    (another one is dropped, not learned)."""
    limit = limits.max_request_bytes
    head = parse_request_header(await read_framed(stream, limit, first), limit)
    body = await read_exactly(stream, head["body"]) if head["body"] else b""
    claim, address = head["peer"], stream.get_remote_address()
    if claim is not None and claim.startswith(SCHEME) and claim != peer_url(peer_id):
        claim = None
    opened = getattr(stream.muxed_conn, "is_initiator", False)
    return Request(
        head["method"],
        head["path"],
        head["query"],
        claim,
        body,
        address[0] if address else peer_url(peer_id),
        bool(opened() if callable(opened) else opened),
    )


async def write_reply(stream: Any, reply: Reply, timeout: float) -> bool:
    """Send ``reply`` (the stream stays open for the next request), ``PIECE`` by ``PIECE``;
    False when the requester took no piece within ``timeout`` (the stream is reset, so its
    upload slot frees now). A slow requester that keeps reading gets it all."""
    data = encode_reply_header(reply) + reply.body
    for at in range(0, len(data), PIECE):
        if not await _write_within(stream, data[at : at + PIECE], timeout):
            await reset(stream)
            return False
    return True


async def _write_within(stream: Any, piece: bytes, timeout: float) -> bool:
    with trio.move_on_after(timeout):
        try:
            await stream.write(piece)
            return True
        except Exception:  # reset or broken by the requester: it gave up
            pass
    return False


class StreamPool:
    """Idle data streams to each peer, for the next request (Trio side): a bounded number per
    peer, none older than ``IDLE_S``, so the server (which waits twice as long) has not closed
    them."""

    def __init__(self) -> None:
        self._idle: dict[Any, list[tuple[Any, float]]] = {}

    def take(self, peer: Any, usable: Callable[[Any], bool] = lambda _: True) -> Any | None:
        """An idle stream to ``peer`` that is young enough and ``usable``; the others are
        dropped (the server closes them when they idle out)."""
        idle, now = self._idle.get(peer, []), trio.current_time()
        while idle:
            stream, since = idle.pop()
            if now - since < IDLE_S and usable(stream):
                return stream
        self._idle.pop(peer, None)
        return None

    def give_back(self, peer: Any, stream: Any) -> bool:
        idle = self._idle.setdefault(peer, [])
        if len(idle) >= POOL_PER_PEER:
            return False
        idle.append((stream, trio.current_time()))
        return True


async def exchange(
    p2p: Any,
    peer_id: str,
    request: bytes,
    limit: int,
    expect: int,
    limits: HttpLimits,
    bulk: bool = False,
) -> bytes:
    """One request to ``peer_id`` on an idle stream or a new one (over a live connection, or
    one dialed directly or through a relay: ``P2PHost.reach``); the reply's body if its status
    is ``expect``. PeerError (or PeerBusyError) otherwise. With ``bulk`` (a chunk), the body
    may take as long as it keeps coming: each read gets twice ``request_timeout_s``."""
    from libp2p.peer.id import ID  # the host's thread already imported libp2p

    with trio.move_on_after(limits.request_timeout_s) as scope:
        moving = partial(_extend, scope, limits.read_patience_s) if bulk else None
        try:
            peer = ID.from_base58(peer_id)
            return await _exchange(p2p, peer, request, (limit, expect), limits, moving)
        except PeerError:
            raise
        except Exception as exc:  # libp2p raises many kinds: all mean "no answer"
            raise PeerError(f"{peer_url(peer_id)}: {type(exc).__name__} {exc}") from None
    assert scope.cancelled_caught
    raise PeerError(f"{peer_url(peer_id)}: no answer within {limits.request_timeout_s}s")


def _extend(scope: trio.CancelScope, patience: float) -> None:
    """Move ``scope``'s deadline ``patience`` seconds on (a chunk's bytes keep coming)."""
    scope.deadline = trio.current_time() + patience


async def _exchange(
    p2p: Any,
    peer: Any,
    request: bytes,
    bounds: tuple[int, int],
    limits: HttpLimits,
    progress: Callable[[], None] | None,
) -> bytes:
    """An idle stream may have died meanwhile: if it fails before any reply, once more on a
    new one. An idle stream through a relay is not reused once a hole is punched to the peer
    (the relay's hops and bandwidth cap would stay on every request otherwise)."""
    from p2p_sync.transport.relay import direct_connection

    direct = direct_connection(p2p.libp2p, peer)
    stream = p2p.streams.take(peer, lambda s: direct is None or s.muxed_conn is direct.muxed_conn)
    if stream is not None:
        try:
            return await _on_stream(p2p, peer, stream, request, bounds, progress)
        except _Unanswered:
            pass
    await p2p.reach(peer, limits.connect_timeout_s)
    with trio.fail_after(limits.connect_timeout_s):
        stream = await p2p.libp2p.new_stream(peer, [PROTOCOL])
    try:
        return await _on_stream(p2p, peer, stream, request, bounds, progress)
    except _Unanswered as exc:
        raise PeerError(f"{peer_url(str(peer))}: {exc.__cause__!r}") from None


async def direct_address(p2p: Any, peer_id: str) -> str | None:
    """Trio side: the remote IP of a live direct (not relayed) connection to ``peer_id``, or
    None (``transport.lan`` looks for the peer's HTTP port there)."""
    from libp2p.peer.id import ID

    from p2p_sync.transport.relay import direct_connection

    conn = direct_connection(p2p.libp2p, ID.from_base58(peer_id))
    remote = conn.muxed_conn.get_remote_address() if conn is not None else None
    return str(remote[0]) if remote else None


class _Unanswered(Exception):
    """The stream failed before any byte of the reply came back."""


async def _on_stream(
    p2p: Any,
    peer: Any,
    stream: Any,
    request: bytes,
    bounds: tuple[int, int],
    progress: Callable[[], None] | None,
) -> bytes:
    try:
        try:
            await stream.write(request)
            first = await stream.read(U32.size)
            if not first:
                raise EOFError("stream closed")
        except Exception as exc:
            raise _Unanswered() from exc
        status, _, length = parse_reply_header(await read_framed(stream, MAX_REPLY_HEADER, first))
        check_reply(peer_url(str(peer)), status, length, *bounds)
        body = await read_exactly(stream, length, progress)
    except BaseException:
        await reset(stream)
        raise
    if not p2p.streams.give_back(peer, stream):
        await stream.close()
    return body


async def reset(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.reset()
        except Exception:  # already gone
            pass


# ---------------------------------------------------------------- asyncio side


class StreamServer:
    """Answers data-plane requests arriving on libp2p streams with the node's own router
    (the one its HTTP server uses: one set of upload slots for both)."""

    def __init__(self, router: DataRouter, host: Any) -> None:
        self.router, self.host = router, host
        self.answered = 0  # requests answered whole over streams
        self.bytes_uploaded = 0  # chunk bytes among them

    async def answer(self, stream: Any, req: Request) -> bool:
        """Route ``req``; the reply is written in the host's thread while the upload slot is
        held, as the HTTP server does."""
        async with self.router.serve(req) as reply:
            sent = await self.host.call(
                write_reply, stream, reply, self.router.limits.request_timeout_s
            )
        if sent:
            self.router.sent(reply)
            self.answered += 1
            self.bytes_uploaded += len(reply.body) if reply.upload else 0
        return bool(sent)


class StreamClient(FramedClient):
    """The data-plane client for ``p2p://`` peers (requests on pooled streams: ``exchange``)."""

    def __init__(self, host: Any, self_url: str | None, limits: HttpLimits) -> None:
        self.host, self.self_url, self.limits = host, self_url, limits

    async def _request(
        self, url: str, limit: int, method: str = "GET", body: bytes = b"", expect: int = 200
    ) -> bytes:
        peer_id, path, query = split_url(url)
        request = encode_request(method, path, query, self.self_url, body)
        return await self.host.call(
            exchange, self.host, peer_id, request, limit, expect, self.limits, chunk_path(path)
        )


class ChannelHub(Protocol):
    """The reverse channels peers opened to this node: does one lead to ``url`` now?"""

    def has(self, url: str) -> bool: ...


class ChannelClient(PeerClient, Protocol):
    """A client over those channels (``transport.reverse.ReverseClient``): named here by what
    the router uses of it, so this module need not import the channels' own."""

    hub: ChannelHub


class RoutedClient:
    """One client for all peers: ``p2p://`` names go over their LAN shortcut when one holds
    (``transport.lan``: plain HTTP on the peer's own network), else over the reverse channel
    the peer opened to this node (``transport.reverse``: HTTP's cost), else over libp2p
    streams, looking for a shortcut meanwhile; the rest over HTTP."""

    def __init__(
        self,
        http: PeerClient,
        streams: StreamClient,
        reverse: ChannelClient | None = None,
        lan: LanShortcuts | None = None,
    ) -> None:
        self.http, self.streams, self.reverse, self.lan = http, streams, reverse, lan
        self.limits = http.limits

    @property
    def self_url(self) -> str | None:
        return self.http.self_url

    @self_url.setter
    def self_url(self, url: str | None) -> None:
        """How this node names itself to peers (it changes once reachability is known)."""
        self.http.self_url = self.streams.self_url = url
        if self.reverse is not None:
            self.reverse.self_url = url

    def _for(self, url: str) -> tuple[PeerClient, str]:
        """The client for ``url``, and the URL to ask it (a shortcut's, for a LAN peer)."""
        if not url.startswith(SCHEME):
            return self.http, url
        shortcut = self.lan.route(url) if self.lan is not None else None
        if shortcut is not None:
            return self.http, shortcut
        if self.reverse is not None and self.reverse.hub.has(url):
            return self.reverse, url
        if self.lan is not None:
            self.lan.consider(url)
        return self.streams, url

    async def _routed(
        self, url: str, op: Callable[[PeerClient, str], Awaitable[T]]
    ) -> tuple[T, bool]:
        """``op`` on the client for ``url``; True if it went over a LAN shortcut (dropped
        when it no longer connects)."""
        client, target = self._for(url)
        if target == url or self.lan is None:
            return await op(client, url), False
        try:
            return await op(client, target), True
        except PeerUnreachableError:
            self.lan.drop(url)
            raise

    async def get_json(self, url: str) -> Any:
        return (await self._routed(url, lambda c, u: c.get_json(u)))[0]

    async def get_bytes(
        self, url: str, limit: int | None = None, moved: Callable[[int], None] | None = None
    ) -> bytes:
        if moved is None:
            data, shortcut = await self._routed(url, lambda c, u: c.get_bytes(u, limit))
        else:
            data, shortcut = await self._routed(url, lambda c, u: c.get_bytes(u, limit, moved))
        if shortcut and self.lan is not None and chunk_path(url):  # chunks, as uploads count
            self.lan.bytes_downloaded += len(data)
        return data

    def get_parts(self, url: str, sizes: list[int]) -> AsyncIterator[bytes]:
        """Runs go to ``http://`` peers only (``download.DataPlaneSource.runs``), so this is
        the HTTP client's; a ``p2p://`` URL gets its own client's whole-reply split."""
        client, target = self._for(url)
        return client.get_parts(target, sizes)

    def get_feed(self, url: str) -> AsyncIterator[Any]:
        """A have feed over the client for ``url`` (whole replies over streams)."""
        client, target = self._for(url)
        return client.get_feed(target)

    async def post_json(self, url: str, doc: Any) -> Any:
        return (await self._routed(url, lambda c, u: c.post_json(u, doc)))[0]

    async def announce(
        self,
        peer: str,
        digests: list[str],
        extra: Mapping[str, Any] | None = None,
        chunks: list[bytes] | None = None,
        manifests: bytes = b"",
    ) -> None:
        await self._routed(peer, lambda c, u: c.announce(u, digests, extra, chunks, manifests))

    async def close(self) -> None:
        if self.lan is not None:
            await self.lan.close()
        await self.http.close()
        await self.streams.close()


__all__ = ["PROTOCOL", "SCHEME", "RoutedClient", "StreamClient", "StreamServer"]
