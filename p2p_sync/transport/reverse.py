"""Reverse channels: a node behind NAT serves public peers over TCP connections it opened.

Why: behind a NAT nobody can dial a node, but it can dial any public peer's HTTP port. A
WebSocket it opens there carries that peer's data-plane requests back to it, and its answers
out, at about HTTP's cost: aiohttp frames WebSockets in C (loopback, both ends in one process
on 2 cores: ~500 MiB/s for 1 MiB messages), where py-libp2p's Noise and yamux in Python cost
~15x the CPU of HTTP per byte (measured 32 MiB/s). libp2p streams (``transport.streams``)
stay for what a channel cannot do: two NATed nodes meeting through a relay, and peers a
channel does not reach. The requester's client (``streams.RoutedClient``) takes a channel
when there is one, so the scheduler sees one ``p2p://<peer id>`` source either way.

Wire (a WebSocket on the public peer P's data-plane port, opened by the NATed node N)::

    N -> P  GET /reverse, Upgrade: websocket
    P -> N  text   {"challenge": 32 hex digits}
    N -> P  text   {"peer": N's peer id, "url": the URL N dialed, "key": hex of N's libp2p
                    public key (protobuf), "signature": hex of N's signature over
                    b"p2psync-reverse/1 " + the URL N dialed + b" " + challenge}
    P -> N  text   {"ok": true}, or P closes with code 4403 and the reason
    then, any number of times and interleaved:
    P -> N  binary a request frame of ``transport.frames`` with "id": int in its header
    N -> P  binary a reply frame of ``transport.frames`` with the same "id" in its header,
            carrying the first ``PIECE`` bytes of the body at most; then, while the body is
            not whole, binary {"id": the same, "at": bytes of the body sent so far} framed
            the same way, followed by the next ``PIECE`` bytes at most

P accepts when the key hashes to the claimed peer id, the signature verifies and the signed URL
is P's own (its advertised URL, or the address the connection arrived at): so no node can
claim another's name, and a peer N dialed cannot pass N's channel on to a third, which would
then blame N for whatever that peer served in its name. N answers with its own data router
(same routes, upload slots and limits as HTTP) and counts what it sent like an HTTP upload.

Bounds: P keeps at most ``max_channels`` channels (a newer one from the same peer replaces the
older); a message is at most a chunk plus its header one way, a request the other; N serves at
most ``upload_queue + max_concurrent_uploads`` requests of a channel at once (more get a 503);
a piece of a reply not sent within ``request_timeout_s`` closes the channel (as a slow HTTP
reader is cut off: a slow one that keeps reading is not, so a 4 MiB chunk may take a minute
on a shared home uplink); a request fails (PeerError) when no piece of its reply came for
``read_patience_s`` (chunks, as over HTTP) or its reply is not whole within
``request_timeout_s`` (anything else); both ends ping every ``HEARTBEAT_S`` and drop a silent
channel.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import logging
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from p2p_sync import jsonbounds
from p2p_sync.errors import ImpersonationError, PeerError
from p2p_sync.protocol.peers import PEER_ID
from p2p_sync.transport import tcp
from p2p_sync.transport.client import check_reply
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.frames import (
    MAX_REPLY_HEADER,
    FramedClient,
    encode_reply_header,
    encode_request,
    peer_url,
    reply_fields,
    request_fields,
    split_url,
)
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import HEX32, PIECE, Reply, Request, chunk_path
from p2p_sync.transport.tls import SwarmTls, tls_url

log = logging.getLogger("p2psync.reverse")
PATH = "/reverse"
CONTEXT = b"p2psync-reverse/1 "
HEARTBEAT_S = 15.0
REFUSED = 4403  # WebSocket close code: the handshake did not prove the claimed peer id
_U32 = struct.Struct(">I")


# ---------------------------------------------------------------- handshake (pure)


def handshake_message(url: str, challenge: str) -> bytes:
    """What N signs: the URL it dialed and P's fresh challenge."""
    return CONTEXT + url.encode() + b" " + challenge.encode()


def prove(key_pair: Any, peer_id: str, url: str, challenge: str) -> dict[str, str]:
    """N's answer to P's challenge, signed with its libp2p identity key."""
    signature = key_pair.private_key.sign(handshake_message(url, challenge)).hex()
    key = key_pair.public_key.serialize().hex()
    return {"peer": peer_id, "url": url, "key": key, "signature": signature}


def verify(doc: Any, challenge: str, own_url: Callable[[str], bool]) -> tuple[str, str]:
    """The proven peer id and the URL it dialed, from N's answer; ImpersonationError names
    what fails. ``own_url`` says whether a URL is this node's."""
    from libp2p.crypto.serialization import deserialize_public_key
    from libp2p.peer.id import ID

    if not isinstance(doc, dict) or not all(
        isinstance(doc.get(k), str) for k in ("peer", "key", "signature", "url")
    ):
        raise ImpersonationError("handshake needs string fields peer, key, signature and url")
    if not PEER_ID.match(doc["peer"]) or not own_url(doc["url"]):
        raise ImpersonationError(f"{doc['url']!r} is not this node's URL (a channel passed on?)")
    try:
        key = deserialize_public_key(bytes.fromhex(doc["key"]))
        proven = key.verify(
            handshake_message(doc["url"], challenge), bytes.fromhex(doc["signature"])
        )
    except Exception as exc:  # malformed hex or protobuf: both are "not proven"
        raise ImpersonationError(f"unreadable key or signature ({type(exc).__name__})") from None
    if str(ID.from_pubkey(key)) != doc["peer"] or not proven:
        raise ImpersonationError(f"the signature does not prove peer id {doc['peer']}")
    return doc["peer"], doc["url"]


def is_own_url(url: str, advertised: str | None, sockname: Any) -> bool:
    """Is ``url`` this node: its advertised URL, or the address and port the connection
    arrived at (the URL a peer on the same network dials)?"""
    if advertised is not None and url == advertised:
        return True
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not sockname:
        return False
    try:
        return (ipaddress.ip_address(parts.hostname), parts.port) == (
            ipaddress.ip_address(sockname[0]),
            sockname[1],
        )
    except ValueError:
        return False


# ---------------------------------------------------------------- messages (pure)


def split_message(data: bytes, limit: int) -> tuple[dict[str, Any], bytes]:
    """A frame's header (parsed JSON object) and body; ValueError if malformed."""
    if len(data) < _U32.size:
        raise ValueError("message shorter than its length prefix")
    (n,) = _U32.unpack_from(data)
    if n > limit or _U32.size + n > len(data):
        raise ValueError(f"header of {n} bytes: over {limit} or past the message")
    head = jsonbounds.loads(data[_U32.size : _U32.size + n])
    if not isinstance(head, dict) or not isinstance(head.get("id"), int):
        raise ValueError("header must be an object with an integer id")
    return head, data[_U32.size + n :]


# ---------------------------------------------------------------- the public peer's end


@dataclass(eq=False)
class _Reply:
    """A reply coming in over a channel, piece by piece."""

    done: asyncio.Future[bytes]
    limit: int
    progress: Callable[[], None]  # a piece came: the requester's clock starts again
    length: int | None = None  # from the first piece's header
    body: bytearray = field(default_factory=bytearray)

    def add(self, url: str, head: dict[str, Any], piece: bytes, expect: int) -> None:
        """Take one message of the reply; PeerError if it breaks the wire's rules."""
        if self.length is None:
            try:
                status, _, self.length = reply_fields(head)
            except ValueError as exc:
                raise PeerError(f"{url}: {exc}") from None
            check_reply(url, status, self.length, self.limit, expect)
        elif head.get("at") != len(self.body):
            raise PeerError(f"{url}: reverse channel: a piece out of order")
        self.body += piece
        if len(self.body) > self.length:
            raise PeerError(f"{url}: reply of {len(self.body)} bytes, header says {self.length}")
        if len(self.body) == self.length:
            self.done.set_result(bytes(self.body))
        else:
            self.progress()


class Channel:
    """P's end of one channel: requests out, replies (in pieces) matched to them by id."""

    def __init__(self, ws: web.WebSocketResponse, peer_id: str, limits: HttpLimits) -> None:
        self.ws, self.peer_id, self.limits = ws, peer_id, limits
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[_Reply, int]] = {}  # id -> the reply, its status

    async def request(
        self, frame: Callable[[int], bytes], limit: int, expect: int, bulk: bool = False
    ) -> bytes:
        """Send the request ``frame(id)``; the body of its reply if the status is
        ``expect`` and it fits ``limit``. PeerError (or PeerBusyError) otherwise. ``bulk``
        (chunks): timed by progress, ``read_patience_s`` for each piece, else the whole
        reply within ``request_timeout_s``."""
        rid, url = next(self._ids), peer_url(self.peer_id)
        loop = asyncio.get_running_loop()
        patience = self.limits.read_patience_s if bulk else self.limits.request_timeout_s
        try:
            async with asyncio.timeout(patience) as clock:

                def progress() -> None:
                    if bulk:
                        clock.reschedule(loop.time() + patience)

                reply = _Reply(loop.create_future(), limit, progress)
                self._waiting[rid] = (reply, expect)
                await self.ws.send_bytes(frame(rid))
                return await reply.done
        except (TimeoutError, ConnectionError) as exc:
            raise PeerError(f"{url}: reverse channel: {type(exc).__name__} {exc}") from None
        finally:
            self._waiting.pop(rid, None)

    async def pump(self) -> None:
        """Hand replies to their requests until the channel closes or misbehaves; then fail
        whatever still waits."""
        try:
            async for msg in self.ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    break
                head, body = split_message(msg.data, MAX_REPLY_HEADER)
                self._deliver(head, body)
        except (ValueError, UnicodeDecodeError) as exc:
            log.info("closing reverse channel of %s: %s", self.peer_id, exc)
        finally:
            await self.ws.close()
            for reply, _ in self._waiting.values():
                if not reply.done.done():
                    reply.done.set_exception(ConnectionError("channel closed"))

    def _deliver(self, head: dict[str, Any], piece: bytes) -> None:
        """One message to the request it answers (none: a late answer to one given up)."""
        waiting = self._waiting.get(head["id"])
        if waiting is None or waiting[0].done.done():
            return
        reply, expect = waiting
        try:
            reply.add(peer_url(self.peer_id), head, piece, expect)
        except PeerError as exc:
            reply.done.set_exception(exc)


class ReverseHub:
    """P's channels, by peer id: accepts them (``GET /reverse``) and lends them to the
    client. ``advertised`` gives this node's URL; ``on_channel`` learns a new peer's name."""

    def __init__(
        self,
        limits: HttpLimits,
        max_channels: int,
        advertised: Callable[[], str | None],
        on_channel: Callable[[str], None],
    ) -> None:
        self.limits, self.max_channels = limits, max_channels
        self.advertised, self.on_channel = advertised, on_channel
        self.channels: dict[str, Channel] = {}
        self.accepted = 0  # channels ever accepted (status)

    async def accept(self, request: web.Request) -> web.StreamResponse:
        """The WebSocket handler: handshake, then serve as the channel until it closes."""
        if len(self.channels) >= self.max_channels:
            return web.Response(status=503, text="no room for another reverse channel")
        ws = web.WebSocketResponse(
            heartbeat=HEARTBEAT_S,
            max_msg_size=self.limits.max_chunk_bytes + MAX_REPLY_HEADER + _U32.size,
        )
        await ws.prepare(request)
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        try:
            peer_id = await self._handshake(ws, sockname)
        except (ImpersonationError, TimeoutError, ValueError, TypeError) as exc:
            await ws.close(code=REFUSED, message=str(exc)[:120].encode())
            return ws
        await self._serve(ws, peer_id)
        return ws

    async def _handshake(self, ws: web.WebSocketResponse, sockname: Any) -> str:
        challenge = secrets.token_hex(16)
        await ws.send_json({"challenge": challenge})
        async with asyncio.timeout(self.limits.connect_timeout_s):
            doc = await ws.receive_json(loads=jsonbounds.loads)
        peer_id, _ = verify(doc, challenge, lambda u: is_own_url(u, self.advertised(), sockname))
        await ws.send_json({"ok": True})
        return peer_id

    async def _serve(self, ws: web.WebSocketResponse, peer_id: str) -> None:
        channel = Channel(ws, peer_id, self.limits)
        older = self.channels.get(peer_id)
        self.channels[peer_id] = channel
        self.accepted += 1
        if older is not None:
            await older.ws.close()
        self.on_channel(peer_url(peer_id))
        try:
            await channel.pump()
        finally:
            if self.channels.get(peer_id) is channel:
                del self.channels[peer_id]

    def has(self, url: str) -> bool:
        """Does the ``p2p://`` peer of ``url`` hold a channel here?"""
        return urlsplit(url).netloc in self.channels

    async def close(self) -> None:
        for channel in list(self.channels.values()):
            await channel.ws.close()


class ReverseClient(FramedClient):
    """The data-plane client for ``p2p://`` peers holding a channel to this node."""

    def __init__(self, hub: ReverseHub, self_url: str | None) -> None:
        self.hub, self.self_url, self.limits = hub, self_url, hub.limits

    async def _request(
        self, url: str, limit: int, method: str = "GET", body: bytes = b"", expect: int = 200
    ) -> bytes:
        peer_id, path, query = split_url(url)
        channel = self.hub.channels.get(peer_id)
        if channel is None:
            raise PeerError(f"{url}: no reverse channel")

        def frame(rid: int) -> bytes:
            return encode_request(method, path, query, self.self_url, body, id=rid)

        return await channel.request(frame, limit, expect, chunk_path(path))


# ---------------------------------------------------------------- the NATed node's end


class ReverseLinks:
    """N's channels to public peers, each answered by the node's router. ``offer`` a peer's
    URL to open one (while fewer than ``max_links`` are open); ``drop_all`` once the node is
    reachable itself (peers then dial it)."""

    RETRY_S = 5.0  # a channel that closed is opened again after this long
    GIVE_UP = 3  # ... unless it failed this many times in a row
    FORGET_S = 300.0  # a peer given up on is not linked again for this long

    def __init__(
        self,
        router: DataRouter,
        key_pair: Any,
        peer_id: str,
        max_links: int,
        tls: SwarmTls | None = None,  # a private swarm's: channels over TLS, as a member
    ) -> None:
        self.router, self.limits, self.tls = router, router.limits, tls
        self.key_pair, self.peer_id, self.max_links = key_pair, peer_id, max_links
        self.links: dict[str, asyncio.Task[None]] = {}
        self._given_up: dict[str, float] = {}  # URL -> when (loop time)
        self._dropped: set[asyncio.Task[None]] = set()  # cancelled, not yet finished
        self.open: set[str] = set()  # URLs whose channel is up now
        self.answered = 0  # requests answered whole over channels
        self.bytes_uploaded = 0  # chunk bytes among them
        self._session: aiohttp.ClientSession | None = None

    def offer(self, url: str) -> None:
        """Open a channel to ``url`` (an HTTP peer) unless one is open, the bound is reached
        or it was given up on lately. Cheap: called whenever a peer is named."""
        if not url.startswith("http://") or url in self.links or len(self.links) >= self.max_links:
            return
        given_up = self._given_up.get(url)
        if given_up is not None:  # forgotten after FORGET_S, so the record stays bounded
            if asyncio.get_running_loop().time() - given_up < self.FORGET_S:
                return
            del self._given_up[url]
        self.links[url] = asyncio.create_task(self._keep(url))

    def drop_all(self) -> None:
        """Close every channel (the node is reachable now: peers dial it)."""
        for task in self.links.values():
            task.cancel()
            self._dropped.add(task)
            task.add_done_callback(self._dropped.discard)
        self.links.clear()

    async def close(self) -> None:
        self.drop_all()
        await asyncio.gather(*list(self._dropped), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _keep(self, url: str) -> None:
        """Keep a channel to ``url`` open; forget the peer after ``GIVE_UP`` failures in a
        row, or at once when it takes no channels (a 404: a trainer or a bootstrap)."""
        failures = 0
        try:
            while failures < self.GIVE_UP:
                try:
                    await self._link(url)
                    failures = 0
                except aiohttp.WSServerHandshakeError as exc:
                    failures = self.GIVE_UP if exc.status == 404 else failures + 1
                except (aiohttp.ClientError, OSError, TimeoutError, PeerError, ValueError) as exc:
                    failures += 1
                    log.debug("reverse channel to %s: %s", url, exc)
                if failures < self.GIVE_UP:
                    await asyncio.sleep(self.RETRY_S)
            self._given_up[url] = asyncio.get_running_loop().time()
        finally:
            if self.links.get(url) is asyncio.current_task():
                del self.links[url]

    async def _link(self, url: str) -> None:
        if self._session is None:  # no total timeout: a channel lives as long as it serves
            connect = self.limits.connect_timeout_s
            timeout = aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect)
            context = None if self.tls is None else self.tls.client
            self._session = tcp.session(timeout, self.limits.tcp_congestion, context)
        async with self._session.ws_connect(
            (url if self.tls is None else tls_url(url)) + PATH,
            heartbeat=HEARTBEAT_S,
            timeout=aiohttp.ClientWSTimeout(ws_close=self.limits.connect_timeout_s),
            max_msg_size=self.limits.max_request_bytes + MAX_REPLY_HEADER,
        ) as ws:
            async with asyncio.timeout(self.limits.connect_timeout_s):
                await self._prove(ws, url)
            self.open.add(url)
            try:
                await self._answer_all(ws, url)
            finally:
                self.open.discard(url)

    async def _prove(self, ws: aiohttp.ClientWebSocketResponse, url: str) -> None:
        challenge = (await ws.receive_json(loads=jsonbounds.loads)).get("challenge")
        if not isinstance(challenge, str) or not HEX32.match(challenge):
            raise PeerError(f"{url}: no challenge on the reverse channel")
        await ws.send_json(prove(self.key_pair, self.peer_id, url, challenge))
        if await ws.receive_json(loads=jsonbounds.loads) != {"ok": True}:
            raise PeerError(f"{url}: reverse channel refused")

    async def _answer_all(self, ws: aiohttp.ClientWebSocketResponse, url: str) -> None:
        """Serve each request as it comes (several at once: long polls wait for news)."""
        tasks: set[asyncio.Task[None]] = set()
        room = self.limits.upload_queue + self.limits.max_concurrent_uploads
        remote = urlsplit(url).hostname
        try:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    break
                head, body = split_message(msg.data, self.limits.max_request_bytes)
                req = _request(
                    request_fields(head, self.limits.max_request_bytes), body, url, remote
                )
                rid = head["id"]
                answer = self._answer(ws, rid, req) if len(tasks) < room else self._refuse(ws, rid)
                task = asyncio.create_task(answer)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _answer(self, ws: aiohttp.ClientWebSocketResponse, rid: int, req: Request) -> None:
        """Route ``req`` and send the reply while its upload slot is held, as HTTP does."""
        async with self.router.serve(req) as reply:
            if not await _send_reply(ws, rid, reply, self.limits.request_timeout_s):
                return
        self.router.sent(reply)
        self.answered += 1
        self.bytes_uploaded += len(reply.body) if reply.upload else 0

    async def _refuse(self, ws: aiohttp.ClientWebSocketResponse, rid: int) -> None:
        text = b"too many requests on this channel at once"
        frame = encode_reply_header(Reply(503, text, "text/plain"), id=rid) + text
        await _send(ws, frame, self.limits.request_timeout_s)

    def status(self) -> dict[str, Any]:
        return {
            "links": sorted(self.open),
            "answered": self.answered,
            "bytes_uploaded": self.bytes_uploaded,
        }


def _request(head: dict[str, Any], body: bytes, url: str, remote: str | None) -> Request:
    """A request from the peer at ``url``: the one this node dialed names it (its claim in
    the frame is not needed), over a connection this node opened."""
    if head["body"] != len(body):
        raise ValueError(f"body of {len(body)} bytes, header says {head['body']}")
    return Request(head["method"], head["path"], head["query"], url, body, remote, True)


async def _send_reply(
    ws: aiohttp.ClientWebSocketResponse, rid: int, reply: Reply, timeout: float
) -> bool:
    """``reply`` in messages of at most ``PIECE`` body bytes, each sent within ``timeout``:
    a slow reader that keeps taking pieces gets a large chunk whole, as over HTTP."""
    body = memoryview(reply.body)
    frame = encode_reply_header(reply, id=rid) + body[:PIECE]
    for at in range(PIECE, len(body), PIECE):
        if not await _send(ws, frame, timeout):
            return False
        frame = _piece_header(rid, at) + body[at : at + PIECE]
    return await _send(ws, frame, timeout)


def _piece_header(rid: int, at: int) -> bytes:
    """The header of a reply's next piece: which reply, and where in its body it goes."""
    raw = json.dumps({"id": rid, "at": at}, separators=(",", ":")).encode()
    return _U32.pack(len(raw)) + raw


async def _send(ws: aiohttp.ClientWebSocketResponse, frame: bytes, timeout: float) -> bool:
    """One message to the peer; False if it is gone, or did not take it within ``timeout``
    (the channel is then closed: a message cannot be taken back half sent, and a reader too
    slow for a chunk loses it, as over HTTP)."""
    try:
        async with asyncio.timeout(timeout):
            await ws.send_bytes(frame)
        return True
    except TimeoutError:
        await ws.close()
    except ConnectionError:
        pass
    return False


__all__ = ["ReverseClient", "ReverseHub", "ReverseLinks", "handshake_message", "verify"]
