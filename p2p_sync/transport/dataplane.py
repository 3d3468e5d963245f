"""The data plane's requests and answers, apart from any server library.

Routes (all responses are small JSON except chunk bodies and metrics):

=========================  ==================================================================
GET  /chunk/{sha256}        the chunk's bytes (re-verified from the store), 404 if absent; at
                            most ``max_concurrent_uploads`` at once, up to ``upload_queue``
                            more wait their turn (a freed slot goes to the requester with
                            the fewest uploads in progress: ``p2p_sync.protocol.uploads``), beyond
                            that (or after waiting ``request_timeout_s``) 503; a reader
                            that takes no bytes for ``request_timeout_s`` is cut off (a slow
                            one that keeps reading is not: a large chunk on a shared home
                            uplink may take a minute)
GET  /chunks/{sha256...}     several chunks in one request: their digests concatenated (at
                            most ``MAX_RUN``), their bytes back to back in that order, as
                            ``/chunk`` serves one (one upload slot for the run); it stops
                            before the first chunk not held here (404 if that is the first),
                            or once ``max_chunk_bytes`` are in: the requester, who knows each
                            chunk's length from the signed manifest, takes what came
GET  /manifests             [{digest, version, kind, base_version, payload_size}] known here;
                            ``?version=N`` lists only that version's manifests
GET  /manifest/{digest}     the signed manifest bytes, as received from the trainer
GET  /have/{digest}         {"have": [chunk indices this node can serve for that manifest],
                            "from": 0, "log": ID}: ID names this have-map's log, its
                            chunks in arrival order (``p2p_sync.protocol.havelog``); with
                            ``?known=N&log=ID`` a long poll: the answer waits (up to
                            ``have_wait_s``) until the log is longer than N, and lists
                            only its entries from N on ("from": N), so news of a chunk
                            reaches peers one latency after it is verified and each index
                            crosses the wire once per follower; a log no longer kept (a
                            chunk left the map, the node restarted) is answered at once
                            with the whole map ("from": 0, a new ID). A seed answers its
                            offer to the requester named by the peer header, whole, with
                            no "log" (an offer can shrink): ``?known=N`` waits until it
                            is no longer N long (it grows when a chunk handed to that
                            requester is served; what time alone frees shows at the next
                            answer). With ``&feed=1`` (``FEED``, newline-delimited JSON) the
                            response stays open: that answer, then each later one on its
                            own line as soon as there is news (news waits one latency, not
                            the two on average of a poll per answer), until ``have_wait_s``
                            without news or ``have_feed_s`` in all; the follower then asks
                            again from where the last line left it. Over transports that
                            send whole replies (libp2p streams, reverse channels) the
                            first answer alone. A feed for a manifest not here yet
                            waits for it (up to ``have_wait_s``: the node learns manifests
                            hop by hop, so a follower may hear of one first), then
                            answers with "held_ms": how long it waited (the asker takes
                            it from the round trip it times); 404 if it does not come. An
                            answer listing chunks this node forwards to the asker unasked
                            (``p2p_sync.runtime.forwarding``: a framed ``POST /announce``) names
                            them
                            in "pushed": the asker waits for the push and does not request
                            them (the news and the push leave together; a request sent on
                            the news alone fetched every forwarded chunk twice)
GET  /peers                 {"peers": [names]}: the peers this node vouches for (given,
                            proven, or checked by itself: ``PeerDirectory.shared``)
POST /announce              {"url": sender base URL or null, "digests": [...], and
                            optionally "offers": {digest: [chunk indices]}, what the sender's
                            ``GET /have/{digest}`` would answer the receiver now (the trainer
                            pushes each follower the chunks it hands it, so the follower
                            requests them at once instead of asking first: a round trip
                            less before the trainer's uplink starts; kept only when the
                            request came from the host of ``url``: else anyone could make
                            every rollout fetch everything from the trainer), "manifests": {digest:
                            signed manifest text} (no ``GET /manifest`` round trip; each one
                            passes the receiver's trust gate as if fetched from ``url``: so
                            kept only when the request came from its host too; the trainer
                            sends them packed in the framed form, below), "gossiped":
                            true (the same news went out by gossip, manifests inline: a node
                            on the gossip mesh keeps the offers and the inline manifests and
                            takes the other manifests from gossip, not from ``url`` by a
                            round trip over the trainer's uplink), "pushing": [[digest,
                            index, length], ...]: chunks of the offer sent in the same body
                            after the JSON (below)} -> 202
                            **Framed, with packed manifests and chunks**: a body that starts
                            with ``ANNOUNCE_MAGIC`` (Content-Type ``ANNOUNCE_TYPE``) is the
                            magic, the JSON's length (4 bytes, big-endian, at most
                            ``max_request_bytes``), the JSON, the packed manifests' length (4
                            bytes, big-endian, at most ``max_request_bytes``; 0: none), the
                            packed manifests (``pack_manifests``: {digest: signed manifest
                            text} as JSON, one zstd frame, unpacking to at most
                            ``max_request_bytes``; 34 B a 64 KiB chunk, 0.3x the text: the
                            trainer pushes one to each follower ahead of any chunk), then the
                            chunks "pushing" names, back to back in that order (at most
                            ``MAX_PUSHED`` of them and ``max_push_bytes`` in all). The
                            trainer sends a follower the first chunks it hands it right
                            behind the manifest, on the same connection, so its uplink
                            carries chunks during the round trip the follower's first
                            request takes (idle otherwise, at every version's start). The
                            receiver reads the JSON and the manifests first and acts on them
                            while the chunks are on their way; each chunk is verified
                            against the signed manifest and stored as it lands (once that
                            manifest is in: the sender counts it fetched, so peers will ask
                            the receiver for it even if it downloads that payload later),
                            and the payload's download does not request it meanwhile.
                            Kept, like offers, only when the request came from ``url``'s host
                            (a forged chunk gets ``url`` banned); a body that ends early keeps
                            the chunks that came whole
POST /dialback              {"url": "http://host:port", "nonce": 32 hex} -> {"reachable":
                            bool, "observed": the requester's address as seen here, "why"}:
                            this node GETs ``{url}/dialback/{nonce}``, only when the URL's
                            host is the address the request came from (never a third party),
                            at most ``reachability.max_concurrent`` at once (beyond:
                            ``"busy": true``, ask again later)
GET  /dialback/{nonce}      200 if this node issued ``nonce`` in a dial-back question, else 404
GET  /reverse               a WebSocket a node behind NAT opens to serve this node over it
                            (``transport.reverse``: handshake, framing and bounds); 404 on
                            a node that fetches nothing (trainer, bootstrap)
GET  /whoami                {"peer": libp2p peer id, "port": data-plane port}: how a node
                            named ``p2p://<peer id>`` is reached over plain HTTP on its own
                            network (``transport.lan``); 404 without libp2p
GET  /status                JSON: version, state_hash, peers, bytes_uploaded, bytes_downloaded...
GET  /metrics               Prometheus text exposition
=========================  ==================================================================

A requester names its own data-plane URL in the ``X-P2PSync-Peer`` header. The name alone
proves nothing (anyone can send any header): the node weighs it (``NodeView.requester``: taken
from a request it serves chunk bytes to, at the requester's own address, or naming a libp2p
peer connected to it; ``p2p_sync.protocol.peers``). A node that only knew the trainer becomes known
to
everyone once the trainer has checked it (a dial-back, its chunk requests, an answer), via the
trainer's ``/peers`` list.

Everything a peer sends is untrusted: path parameters are validated before use, request bodies
are capped (``max_request_bytes``), JSON is parsed within ``jsonbounds.JsonLimits`` (nesting,
digits of a number), and any malformed request gets a 4xx without touching state: 413 for a
body over its size limit, 422 for JSON past those bounds, 400 for the rest.

Why a router of its own: the aiohttp server (``transport.http``) and the in-memory network
(``transport.memory``, N nodes in one process for tests) answer requests with the same code,
so a control-plane test in memory exercises exactly what a real node serves.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import zstandard

from p2p_sync import jsonbounds
from p2p_sync.bounded import remember
from p2p_sync.errors import (
    HostileJsonError,
    MalformedJsonError,
    PeerBusyError,
    PeerError,
    PeerLacksError,
)
from p2p_sync.protocol.havelog import LOG_ID, HaveLog
from p2p_sync.protocol.peers import PEER_ID as PEER_ID  # the transports check peer ids with it
from p2p_sync.protocol.peers import is_peer_name
from p2p_sync.protocol.ratelimit import TokenBucket
from p2p_sync.protocol.uploads import Admission, UploadSlots

HEX64 = re.compile(r"^[0-9a-f]{64}$")
HEX32 = re.compile(r"^[0-9a-f]{32}$")
PEER_HEADER = "X-P2PSync-Peer"
JSON = "application/json"
FEED = "application/x-ndjson"  # a have feed: one JSON answer a line, each as news comes


PIECE = 256 * 1024  # a chunk body is written, and its reader timed, this much at a time
# the replies timed by progress: GET CHUNK_ROUTE + sha256, and CHUNKS_ROUTE + sha256... (a run)
CHUNK_ROUTE = "/chunk/"
CHUNKS_ROUTE = "/chunks/"
MAX_RUN = 64  # chunks one /chunks request may name
MAX_UPLOADED = 1 << 14  # chunks whose upload counts a data plane remembers (~3 MB)
# ``POST /announce`` with packed manifests and chunks behind its JSON (the route table): how
# such a body starts ("p2pA" was the form with manifests in the JSON, base64: refused now, as
# its chunks would be misread), its Content-Type, and how many chunks it may carry
ANNOUNCE_MAGIC = b"p2pB"
ANNOUNCE_TYPE = "application/x-p2psync-announce"
MAX_PUSHED = 64


def chunk_path(path: str) -> bool:
    """Whether a request path (or URL) asks for chunks."""
    route = urlsplit(path).path
    return route.startswith(CHUNK_ROUTE) or route.startswith(CHUNKS_ROUTE)


def chunks_url(shas: list[str]) -> str:
    """The path asking for these chunks in one request (``/chunks``)."""
    return CHUNKS_ROUTE + "".join(shas)


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of the data plane, on both sides."""

    max_concurrent_uploads: int = 16
    # a POST body, and what an announcement's packed manifests may unpack to (~70 bytes a
    # chunk: ~107 KB for the 1,536 chunks of a large payload)
    max_request_bytes: int = 256 * 1024
    max_json_bytes: int = 16 * 2**20
    max_chunk_bytes: int = 64 * 2**20
    # a request waits this long for an upload slot (then 503); a transfer that moves no byte
    # this long is cut, one that keeps moving is not (a large chunk on a slow, shared uplink)
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 3.0
    max_upload_mbps: float = 0.0  # cap on chunk bytes served, Mbit/s (0: no cap)
    upload_queue: int = 64  # chunk requests waiting for an upload slot; more get a 503
    have_wait_s: float = 5.0  # longest hold of a long-polled have-map (< request_timeout_s)
    have_feed_s: float = 60.0  # longest a have feed stays open (then the follower reopens it)
    # chunks one announcement may carry behind its JSON (the trainer's first hand-out)
    max_push_bytes: int = 4 * 2**20
    # TCP congestion control for every socket the data plane opens or accepts ("": the host's
    # default). "bbr" resumes an idle connection at its measured rate, where Linux restarts
    # it in slow start otherwise (transport/tcp.py: fast, long paths need it)
    tcp_congestion: str = ""
    # inbound connections held at once, in all and from one address (an IPv6 /64); one
    # over either gets a 503 and is closed (``transport.connections``). The total never
    # exceeds half the process's descriptor limit (RLIMIT_NOFILE): the other half is the
    # node's own connections and files. A peer's client holds at most 100 connections to
    # one node (chunk requests, have feeds, announcements): one address's cap leaves it room
    max_connections: int = 4096
    max_connections_per_address: int = 256
    # a request header must be whole this long after its connection opened or its first
    # byte came (a slow-loris client sends one byte a while); a keep-alive connection with no
    # request in progress is closed after ``idle_timeout_s`` (more than the client's own
    # 15 s: the client closes first). A long poll, a have feed or a chunk in progress is a
    # request in progress, not idle
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0

    @property
    def read_patience_s(self) -> float:
        """How long a requester waits for the next byte of a chunk: twice the server's wait
        for an upload slot, so the server's 503 for a slot not granted in time comes first."""
        return 2 * self.request_timeout_s


@dataclass(frozen=True)
class Pushed:
    """What a ``POST /announce`` carries beyond its digests (see the route table)."""

    offers: Mapping[str, list[int]] = field(default_factory=dict)  # digest -> chunk indices
    manifests: Mapping[str, bytes] = field(default_factory=dict)  # digest -> signed manifest
    gossiped: bool = False  # the same news went out by gossip
    # digest -> chunk indices sent behind the JSON (they follow: ``NodeView.on_pushed``)
    pushing: Mapping[str, list[int]] = field(default_factory=dict)


class BodyReader(Protocol):
    """The rest of a request body, read as it arrives (aiohttp's ``StreamReader`` is one)."""

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes; ``asyncio.IncompleteReadError`` if the body ends first."""
        ...


class BytesReader:
    """A body already in memory as a :class:`BodyReader` (transports that carry whole
    bodies: the in-memory network, libp2p streams)."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = memoryview(data), 0

    async def readexactly(self, n: int) -> bytes:
        piece = bytes(self._data[self._at : self._at + n])
        self._at += len(piece)
        if len(piece) < n:
            raise asyncio.IncompleteReadError(piece, n)
        return piece


class NodeView(Protocol):
    """What the data plane needs from a node (implemented by
    ``p2p_sync.runtime.dataview.DataView``)."""

    def manifest_index(self) -> list[dict[str, Any]]: ...
    def manifest_bytes(self, digest: str) -> bytes | None: ...
    def have(self, digest: str, requester: str | None) -> list[int] | None: ...
    def have_log(self, digest: str) -> HaveLog | None: ...
    def have_changed(self, timeout: float, requester: str | None = None) -> Awaitable[None]: ...
    def notify_have(self) -> None: ...  # wakes every ``have_changed`` awaited now
    def chunk(self, sha256: str, requester: str | None = None) -> bytes | None: ...
    def peer_urls(self) -> list[str]: ...
    def status(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...
    def count_upload(self, nbytes: int) -> None: ...
    def upload_contact(self, requester: str, pending: bool) -> None: ...
    def pushing_to(self, digest: str, peer: str) -> set[int]:
        """Chunks of ``digest`` this node forwards to ``peer`` unasked
        (``p2p_sync.runtime.forwarding``):
        a have-map answer to ``peer`` that lists one says so ("pushed"), so it waits for the
        push instead of requesting the chunk too."""
        ...

    def followed(self, digest: str, peer: str) -> None:
        """``peer`` (its URL's host is where the request came from) asked our have-map of
        ``digest``, or its have feed carried an answer now: it follows us for that payload
        (chunks may be forwarded to it)."""
        ...

    def on_announce(self, url: str | None, digests: list[str], pushed: Pushed) -> None: ...
    def on_pushed(self, url: str, digest: str, index: int, data: bytes) -> None:
        """A chunk pushed behind an announcement from ``url`` (unverified: the download
        checks it against the signed manifest)."""
        ...

    def requester(self, url: str, remote: str | None, upload: bool) -> None:
        """A request from ``remote`` named its sender ``url`` (the peer header, unproven);
        ``upload``: chunk bytes are on their way to it (upload demand). The node weighs what
        that proves (``p2p_sync.protocol.peers``)."""
        ...

    def issued(self, nonce: str) -> bool: ...
    async def dial_back(
        self, url: str, nonce: str, remote: str | None, outbound: bool
    ) -> dict[str, Any]: ...


def same_host(url: str, remote: str | None) -> bool:
    """Does ``url`` point at ``remote``, the address a request came from?"""
    host = urlsplit(url).hostname
    if host is None or remote is None:
        return False
    try:
        return ipaddress.ip_address(host) == ipaddress.ip_address(remote)
    except ValueError:
        return host == remote  # names (the in-memory network): compared as they are


def valid_peer_url(url: str) -> bool:
    """Is ``url`` a peer's name (``peers.peer_name``: ``http(s)://host[:port]`` or
    ``p2p://<peer id>``, nothing more)?"""
    return is_peer_name(url)


@dataclass(frozen=True)
class Request:
    """One request, as any transport hands it over (``path`` already normalized)."""

    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    peer: str | None = None  # the X-P2PSync-Peer header: the requester's own URL, unproven
    body: bytes = b""
    remote: str | None = None  # the requester's address as the transport saw it
    outbound: bool = False  # it came over a connection this node opened (a libp2p stream)
    # a framed announcement's chunks, still arriving (``body`` is then the framing and the
    # JSON only: the aiohttp server reads the chunks as the router asks for them)
    rest: BodyReader | None = None

    @property
    def requester(self) -> str:
        """Who asks, for sharing upload slots fairly: the address the transport saw and the
        URL it claims (several peers share an address behind a NAT or on one machine). A
        claim is unproven, so many claims from one address get more of the line; they get
        no more slots than first come, first served gave anyone."""
        return f"{self.remote or '?'} {self.peer or '?'}"


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = JSON
    upload: bool = False  # chunk bytes: counted as uploaded once the transport sent them all
    # what follows ``body`` on the same response, as it comes (a have feed's later answers);
    # a transport that sends whole replies sends ``body`` alone, and the requester asks again
    feed: AsyncGenerator[bytes, None] | None = None


class Refused(Exception):
    """A request answered with an error status (inside the router only)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


def _json(doc: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(doc).encode())


def _line(doc: Any) -> bytes:
    """One answer of a have feed (``FEED``): its JSON, then a newline."""
    return json.dumps(doc).encode() + b"\n"


def _have_query(query: Mapping[str, str]) -> tuple[int | None, str | None, bool]:
    """``GET /have``'s ``known`` (a small count), ``log`` (a have log's name) and ``feed``
    (only ``1``), or a 400."""
    known, log, feed = query.get("known"), query.get("log"), query.get("feed")
    if feed not in (None, "1"):
        raise Refused(400, "feed must be 1")
    if known is not None and not (known.isdigit() and len(known) < 9):
        raise Refused(400, "known must be a small non-negative integer")
    if log is not None and (known is None or not LOG_ID.match(log)):
        raise Refused(400, "log must be 16 hex digits, with known")
    return (None if known is None else int(known)), log, feed is not None


def _hex(value: str, name: str) -> str:
    if not HEX64.match(value):
        raise Refused(400, f"{name} must be 64 lowercase hex digits")
    return value


# the routes, and how many path segments each takes (its name, then a digest for some)
_ARITY = {n: (1,) for n in ("manifests", "peers", "announce", "whoami", "status", "metrics")} | {
    n: (2,) for n in ("chunk", "chunks", "manifest", "have")
}
_ARITY["dialback"] = (1, 2)

Handler = Callable[[Request, str], Awaitable[Reply]]


class DataRouter:
    """Answers data-plane requests for one node; the upload slots and cap live here."""

    def __init__(self, node: NodeView, limits: HttpLimits = HttpLimits()) -> None:
        self.node, self.limits = node, limits
        self._slots: UploadSlots[asyncio.Future[None]] = UploadSlots(
            limits.max_concurrent_uploads, limits.upload_queue
        )
        # chunks uploaded from here (sha -> times; the newest MAX_UPLOADED): the freshest
        # chunk's request is served first (``p2p_sync.protocol.uploads``)
        self._uploaded: dict[str, int] = {}
        self._closing = asyncio.Event()  # set by close(): long polls answer at once
        self.polls_held = 0  # have-map long polls waiting for news now
        rate = limits.max_upload_mbps * 1e6 / 8 or None
        self._bucket = TokenBucket(rate, max(rate / 10, 1 << 20)) if rate else None
        self.identity: dict[str, Any] | None = None  # /whoami; set once libp2p runs
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "manifests"): self._manifests,
            ("GET", "manifest"): self._manifest,
            ("GET", "have"): self._have,
            ("GET", "peers"): self._peers,
            ("POST", "announce"): self._announce,
            ("POST", "dialback"): self._dial_back,
            ("GET", "dialback"): self._nonce,
            ("GET", "whoami"): self._whoami,
            ("GET", "status"): self._status,
            ("GET", "metrics"): self._metrics,
        }

    @asynccontextmanager
    async def serve(self, req: Request) -> AsyncIterator[Reply]:
        """The reply to ``req``, valid inside the block: a chunk keeps its upload slot until
        the transport has sent it (or given up)."""
        release: Callable[[], None] = _nothing
        try:
            reply, release = await self._respond(req)
        except Refused as r:
            reply = Reply(r.status, r.text.encode(), "text/plain")
        try:
            if req.peer is not None:
                self.node.requester(req.peer, req.remote, reply.upload)
            yield reply
        finally:
            release()

    @property
    def uploads_busy(self) -> int:
        """Chunk uploads in progress now (requests served, not waiting for a slot)."""
        return self._slots.busy

    def sent(self, reply: Reply) -> None:
        """The transport delivered ``reply`` whole: count the chunk bytes uploaded."""
        if reply.upload:
            self.node.count_upload(len(reply.body))

    def close(self) -> None:
        """The node is stopping: held long polls answer now with what is there (a server
        waits for its handlers before it closes, up to ``have_wait_s`` each otherwise). They
        wait on the node's news alone, so the node wakes them all, and each sees the close."""
        self._closing.set()
        self.node.notify_have()

    async def _respond(self, req: Request) -> tuple[Reply, Callable[[], None]]:
        parts = req.path.strip("/").split("/")
        name, arg = parts[0], "/".join(parts[1:])
        if len(parts) not in _ARITY.get(name, ()):
            raise Refused(404, "no such route")
        if (req.method, name) == ("GET", "chunk"):
            return await self._chunk(arg, req), lambda: self._release(req)
        if (req.method, name) == ("GET", "chunks"):
            return await self._run(arg, req), lambda: self._release(req)
        handler = self._routes.get((req.method, name))
        if handler is None:
            raise Refused(405, f"{req.method} is not allowed on /{name}")
        return await handler(req, arg), _nothing

    # ------------------------------------------------------------ chunks

    async def _upload_slot(self, req: Request, sha: str) -> None:
        """Wait for an upload slot (bounded queue, bounded wait) or refuse with 503; a
        request for a chunk uploaded here fewer times (``sha``: its first) goes first."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        admission = self._slots.request(req.requester, turn, self._uploaded.get(sha, 0))
        self._contact(req)
        if admission is Admission.BUSY:
            raise Refused(503, "upload queue full")
        if admission is Admission.SERVE:
            return
        try:
            async with asyncio.timeout(self.limits.request_timeout_s):
                await asyncio.shield(turn)
        except TimeoutError:
            if self._withdraw(turn, req):
                raise Refused(503, "no upload slot in time") from None
        except asyncio.CancelledError:  # the requester hung up while waiting
            if not self._withdraw(turn, req):
                self._release(req)  # the slot came at that instant: hand it on
            raise

    def _withdraw(self, turn: asyncio.Future[None], req: Request) -> bool:
        withdrawn = self._slots.withdraw(turn)
        if withdrawn:
            self._contact(req)
        return withdrawn

    def _release(self, req: Request) -> None:
        """An upload to ``req``'s requester ended: wake whom the slots pick next."""
        for _, turn in self._slots.finished(req.requester):
            turn.set_result(None)
        self._contact(req)

    def _contact(self, req: Request) -> None:
        """Tell the node whether the peer that sent ``req`` has uploads here now (a seed
        takes back chunks it handed to a peer that stopped asking: ``p2p_sync.protocol.seeding``). A
        peer is named by the URL it claims, as the seed's offers name it: a forged claim can
        at worst make the seed upload a chunk twice, or wait ``reseed_after_s`` as before."""
        if req.peer is not None:
            self.node.upload_contact(req.peer, self._slots.pending(req.requester))

    async def _chunk(self, sha: str, req: Request) -> Reply:
        """The chunk's bytes, holding an upload slot (the caller releases it)."""
        return await self._serve_chunks([_hex(sha, "sha")], req)

    async def _run(self, joined: str, req: Request) -> Reply:
        """A run of chunks (``/chunks``), holding one upload slot (the caller releases it)."""
        shas = [joined[at : at + 64] for at in range(0, len(joined), 64)]
        if not 0 < len(shas) <= MAX_RUN:
            raise Refused(400, f"name 1 to {MAX_RUN} chunks")
        for sha in shas:
            _hex(sha, "each sha")
        return await self._serve_chunks(shas, req)

    async def _serve_chunks(self, shas: list[str], req: Request) -> Reply:
        """The chunks' bytes back to back, up to the first one not held here (and within
        ``max_chunk_bytes``), after the wait for an upload slot and the upload cap."""
        await self._upload_slot(req, shas[0])
        try:
            parts: list[bytes] = []
            size = 0
            for sha in shas:
                if size >= self.limits.max_chunk_bytes:
                    break
                data = self.node.chunk(sha, req.peer)  # inline: ~0.3 ms (read, re-hash)
                if data is None:
                    break
                remember(self._uploaded, sha, self._uploaded.get(sha, 0) + 1, MAX_UPLOADED)
                parts.append(data)
                size += len(data)
            if not parts:
                raise Refused(404, "no such chunk here")
            if self._bucket is not None:  # upload cap: wait our turn before sending
                await asyncio.sleep(self._bucket.reserve(size, time.monotonic()))
        except BaseException:
            self._release(req)
            raise
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        return Reply(200, body, "application/octet-stream", upload=True)

    # ------------------------------------------------------------ the control plane

    async def _manifests(self, req: Request, _: str) -> Reply:
        index = self.node.manifest_index()
        if "version" in req.query:  # manifests of one version (patch, snapshot, catch-ups)
            try:
                version = int(req.query["version"])
            except ValueError:
                raise Refused(400, "version must be an integer") from None
            index = [m for m in index if m["version"] == version]
        return _json(index)

    async def _manifest(self, req: Request, digest: str) -> Reply:
        data = self.node.manifest_bytes(_hex(digest, "digest"))
        if data is None:
            raise Refused(404, "no such manifest here")
        return Reply(200, data)

    async def _have(self, req: Request, digest: str) -> Reply:
        _hex(digest, "digest")
        known, log, feed = _have_query(req.query)
        held = await self._manifest_learned(digest, req.peer) if feed else 0.0
        doc, _ = await self._have_answer(digest, req.peer, known, log)
        if doc is None:
            raise Refused(404, "no such manifest here")
        follower = req.peer if req.peer is not None and same_host(req.peer, req.remote) else None
        if follower is not None:
            self.node.followed(digest, follower)
        if held:
            doc["held_ms"] = int(held * 1000)
        if not feed:
            return _json(doc)
        feed_ = self._have_feed(digest, req.peer, doc, follower)
        return Reply(200, _line(doc), FEED, feed=feed_)

    async def _manifest_learned(self, digest: str, peer: str | None) -> float:
        """Hold a have feed for a manifest this node has not learned yet until it has, at
        most ``have_wait_s``. News spreads hop by hop, so a follower often hears of a
        version before some of the peers it follows: answered 404 at once, it backed off
        (``have_poll_s``, doubling) and asked again up to 0.6 s later, while this node would
        learn the manifest a latency or two after the question (the simulator's have feeds
        never had that gap). How long it held (0.0: the manifest was here)."""
        # the manifest's presence, not ``have``: on a seed that computes its offer
        if self.node.manifest_bytes(digest) is not None:
            return 0.0
        start = time.monotonic()
        deadline = start + self.limits.have_wait_s
        while self.node.manifest_bytes(digest) is None and not self._closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return 0.0  # a 404 follows
            await self._news_or_close(left, peer)
        return time.monotonic() - start

    async def _have_answer(
        self, digest: str, peer: str | None, known: int | None, log: str | None
    ) -> tuple[dict[str, Any] | None, bool]:
        """The answer to a have-map question at ``known`` entries of ``log`` (a long poll
        when ``known`` is given: held up to ``have_wait_s`` for news), None if the manifest
        is not here; and whether it holds news (False: the hold ran out, or the node
        closes)."""
        have = self.node.have(digest, peer)
        deadline = time.monotonic() + self.limits.have_wait_s
        news = True
        while have is not None and known is not None and self._unchanged(digest, have, known, log):
            left = deadline - time.monotonic()
            if left <= 0 or self._closing.is_set():
                news = False
                break
            await self._news_or_close(left, peer)
            have = self.node.have(digest, peer)
        if have is None:
            return None, False
        record = self.node.have_log(digest)
        if record is None:  # a seed's offer: the whole list each time
            return {"have": have}, news
        start, indices = record.since(log, -1 if known is None else known)
        doc: dict[str, Any] = {"have": indices, "from": start, "log": record.ident}
        pushing = self.node.pushing_to(digest, peer) if peer is not None else set()
        if pushing and (pushed := [i for i in indices if i in pushing]):
            doc["pushed"] = pushed
        return doc, news

    async def _have_feed(
        self, digest: str, peer: str | None, doc: dict[str, Any], follower: str | None
    ) -> AsyncIterator[bytes]:
        """The answers after ``doc`` on one open response, each as soon as there is news:
        news reaches the follower one latency after it is verified. A long poll per answer
        left the follower blind for a round trip after each one (the answer's way back, the
        next question's way here): news waited two latencies on average, three at worst.
        Ends after ``have_wait_s`` without news, after ``have_feed_s``, when the node closes
        or the manifest is gone (the follower asks again where it stands). Each answer tells
        the node that ``follower`` (when its URL's host asked) still follows."""
        end = time.monotonic() + self.limits.have_feed_s
        while time.monotonic() < end and not self._closing.is_set():
            log = doc.get("log")
            known = doc.get("from", 0) + len(doc["have"]) if log else len(doc["have"])
            answer, news = await self._have_answer(digest, peer, known, log)
            if answer is None or not news:
                return
            doc = answer
            if follower is not None:
                self.node.followed(digest, follower)
            yield _line(doc)

    def _unchanged(self, digest: str, have: list[int], known: int, log: str | None) -> bool:
        """Nothing new for a long poll at ``known`` (of ``log``, if it names one) yet."""
        record = self.node.have_log(digest)
        if record is None or log is None:
            return len(have) == known
        return record.waits(log, known)

    async def _news_or_close(self, timeout: float, requester: str | None) -> None:
        """Wait for have-map news (or the node closing: ``close`` wakes every wait with news,
        and the callers check ``_closing`` before and after). ``have_changed`` takes its news
        event when called, so news landing before the await is not lost. The wait is awaited
        directly: there is one per feed and chunk that lands, and a task for the news, one
        for the close and ``asyncio.wait`` over them were about a third of a feed's CPU
        (``benchmarks/have_feeds.py``: 60 -> 43 us per chunk and follower, 8 followers)."""
        if self._closing.is_set():
            return
        self.polls_held += 1
        try:
            await self.node.have_changed(timeout, requester)
        finally:
            self.polls_held -= 1

    async def _peers(self, req: Request, _: str) -> Reply:
        return _json({"peers": self.node.peer_urls()})

    async def _announce(self, req: Request, _: str) -> Reply:
        head, packed, rest = split_announce(req, self.limits)
        doc = _json_doc(head, self.limits)
        url, digests = doc.get("url"), doc.get("digests")
        if not (url is None or isinstance(url, str)) or not isinstance(digests, list):
            raise Refused(400, "expected {url, digests}")
        if not all(isinstance(d, str) and HEX64.match(d) for d in digests):
            raise Refused(400, "digests must be 64 hex digits each")
        if url is not None and not valid_peer_url(url):
            raise Refused(400, "url must be http://host:port or p2p://<peer id>")
        offers = _by_digest(doc, "offers", digests, _indices, "chunk indices")
        texts = _by_digest(doc, "manifests", digests, _is_str, "manifest text")
        if packed:
            inline = {"packed manifests": _unpack_manifests(packed, self.limits)}
            texts |= _by_digest(inline, "packed manifests", digests, _is_str, "manifest text")
        manifests = {d: text.encode() for d, text in texts.items()}
        pushing = _pushing(doc, digests, self.limits)
        if url is None or not same_host(url, req.remote):  # anyone may claim to be the trainer
            offers, manifests, pushing = {}, {}, []  # (and a forgery would get it banned)
        gossiped = doc.get("gossiped", False)
        if not isinstance(gossiped, bool):
            raise Refused(400, "gossiped must be true or false")
        indices: dict[str, list[int]] = {}
        for digest, index, _n in pushing:
            indices.setdefault(digest, []).append(index)
        self.node.on_announce(url, digests, Pushed(offers, manifests, gossiped, indices))
        if pushing and rest is not None and url is not None:
            await self._take_pushed(url, pushing, rest)
        return _json({"ok": True}, status=202)

    async def _take_pushed(
        self, url: str, pushing: list[tuple[str, int, int]], rest: BodyReader
    ) -> None:
        """Hand on each chunk behind a framed announcement as it lands (the JSON was acted
        on first); a body that ends early, or stops moving for ``read_patience_s``, keeps
        those that came whole (the download pulls the others once their push is overdue)."""
        for digest, index, n in pushing:
            try:
                async with asyncio.timeout(self.limits.read_patience_s):
                    data = await rest.readexactly(n)
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            self.node.on_pushed(url, digest, index, data)

    async def _dial_back(self, req: Request, _: str) -> Reply:
        doc = _json_body(req, self.limits)
        url, nonce = doc.get("url"), doc.get("nonce")
        if not (isinstance(url, str) and url.startswith("http://") and valid_peer_url(url)):
            raise Refused(400, "url must be http://host:port")
        if not (isinstance(nonce, str) and HEX32.match(nonce)):
            raise Refused(400, "nonce must be 32 lowercase hex digits")
        return _json(await self.node.dial_back(url, nonce, req.remote, req.outbound))

    async def _nonce(self, req: Request, nonce: str) -> Reply:
        if not (HEX32.match(nonce) and self.node.issued(nonce)):
            raise Refused(404, "no such nonce issued here")
        return _json({"nonce": nonce})

    async def _whoami(self, req: Request, _: str) -> Reply:
        if self.identity is None:
            raise Refused(404, "no libp2p identity here")
        return _json(self.identity)

    async def _status(self, req: Request, _: str) -> Reply:
        return _json(self.node.status())

    async def _metrics(self, req: Request, _: str) -> Reply:
        return Reply(200, self.node.metrics_text(), "text/plain")


def _nothing() -> None:
    pass


def _by_digest(
    doc: dict[str, Any], name: str, digests: list[str], valid: Callable[[Any], bool], what: str
) -> dict:
    """An announcement's optional field ``name``: announced digests to ``what`` (each value
    ``valid``), or a 400."""
    field = doc.get(name, {})
    if isinstance(field, dict) and set(field) <= set(digests) and all(map(valid, field.values())):
        return field
    raise Refused(400, f"{name} must map announced digests to {what}")


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _indices(have: Any) -> bool:
    return isinstance(have, list) and all(type(i) is int and 0 <= i < 2**31 for i in have)


def pack_manifests(texts: Mapping[str, str]) -> bytes:
    """A framed ``POST /announce``'s packed manifests: {digest: signed manifest text} as JSON,
    one zstd frame. A manifest is mostly hex chunk digests (4 bits in 8), which zstd's entropy
    coder takes back to ~34 B a chunk (0.3x the text, 0.75x the base64 an earlier form put in
    the JSON); the trainer pushes it to each follower in the first milliseconds of a version,
    ahead of any chunk. Packed once per version (~1 ms), the same bytes for every follower."""
    raw = json.dumps(dict(texts), separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=1).compress(raw)


def _unpack_manifests(packed: bytes, limits: HttpLimits) -> Any:
    """The JSON of a framed announcement's packed manifests: a 400 if malformed, a 413 if it
    would unpack to more than a request may carry (a small frame must not inflate without
    bound)."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(packed)
        raw = bytearray()
        while piece := reader.read(PIECE):
            raw += piece
            if len(raw) > limits.max_request_bytes:
                raise Refused(413, "packed manifests unpack to more than the request limit")
        return _parsed(raw, "packed manifests")
    except (ValueError, zstandard.ZstdError):
        raise Refused(400, "packed manifests must be a zstd frame of JSON") from None


def announce_doc(url: str | None, digests: list[str], extra: Mapping[str, Any] | None) -> dict:
    """The body of ``POST /announce`` (its fields: the route table above)."""
    return {"url": url, "digests": digests, **(extra or {})}


def frame_announce(doc: Mapping[str, Any], chunks: list[bytes], manifests: bytes = b"") -> bytes:
    """A framed ``POST /announce`` body: the JSON, the packed ``manifests``
    (``pack_manifests``), then ``chunks`` (``doc``'s "pushing")."""
    head = json.dumps(doc).encode()
    sizes = (len(head).to_bytes(4, "big"), len(manifests).to_bytes(4, "big"))
    return b"".join([ANNOUNCE_MAGIC, sizes[0], head, sizes[1], manifests, *chunks])


def announce_body(doc: Mapping[str, Any], chunks: list[bytes] | None, manifests: bytes) -> bytes:
    """A ``POST /announce`` body for transports that send whole bodies: framed when it
    carries packed manifests or chunks, else the JSON alone."""
    if chunks or manifests:
        return frame_announce(doc, chunks or [], manifests)
    return json.dumps(doc).encode()


def split_announce(req: Request, limits: HttpLimits) -> tuple[bytes, bytes, BodyReader | None]:
    """A ``POST /announce`` body's JSON, its packed manifests (empty: none) and, when framed, a
    reader of the chunks behind them; a 400 if the frame is malformed."""
    body = req.body
    if not body.startswith(ANNOUNCE_MAGIC):
        return body, b"", None
    at, parts = 4, []
    for _ in range(2):  # the JSON, then the packed manifests: each a length, then its bytes
        n = int.from_bytes(body[at : at + 4], "big") if len(body) >= at + 4 else -1
        if not 0 <= n <= limits.max_request_bytes or len(body) < at + 4 + n:
            raise Refused(400, "framed announcement: bad JSON or manifests length")
        parts.append(body[at + 4 : at + 4 + n])
        at += 4 + n
    return parts[0], parts[1], req.rest if req.rest is not None else BytesReader(body[at:])


async def read_announce_head(reader: BodyReader, limits: HttpLimits) -> bytes:
    """A framed announcement's magic, JSON and packed manifests off a stream, the chunks left
    unread (the aiohttp server's part of ``split_announce``): a 400 if malformed, a 413 if
    the JSON or the manifests are over the request limit."""
    try:
        magic = await reader.readexactly(4)
        if magic != ANNOUNCE_MAGIC:
            raise Refused(400, "framed announcement: bad magic")
        head = [magic]
        for _ in range(2):
            size = await reader.readexactly(4)
            n = int.from_bytes(size, "big")
            if n > limits.max_request_bytes:
                raise Refused(413, "framed announcement: JSON or manifests over the request limit")
            head += [size, await reader.readexactly(n)]
        return b"".join(head)
    except asyncio.IncompleteReadError:
        raise Refused(400, "framed announcement: body ends early") from None


def _pushing(
    doc: dict[str, Any], digests: list[str], limits: HttpLimits
) -> list[tuple[str, int, int]]:
    """An announcement's "pushing": [[digest, index, length], ...], each an announced
    digest, a chunk index and a length named once; at most ``MAX_PUSHED`` of them and
    ``max_push_bytes`` in all; or a 400."""
    field = doc.get("pushing", [])
    bad = Refused(400, "pushing must list [announced digest, index, length] triples")
    if not isinstance(field, list) or len(field) > MAX_PUSHED:
        raise bad
    out: list[tuple[str, int, int]] = []
    for item in field:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in digests):
            raise bad
        digest, index, n = item
        if not (type(index) is int and type(n) is int and 0 <= index < 2**31 and 0 < n):
            raise bad
        out.append((digest, index, n))
    if len({(d, i) for d, i, _ in out}) < len(out):
        raise bad
    if sum(n for _, _, n in out) > limits.max_push_bytes:
        raise Refused(413, "pushing: more chunk bytes than max_push_bytes")
    return out


def _json_body(req: Request, limits: HttpLimits) -> dict[str, Any]:
    """A POST body: a JSON object within the request limit, or a 4xx."""
    return _json_doc(req.body, limits)


def _json_doc(body: bytes, limits: HttpLimits) -> dict[str, Any]:
    if len(body) > limits.max_request_bytes:
        raise Refused(413, "body over the request limit")
    doc = _parsed(body, "body")
    if not isinstance(doc, dict):
        raise Refused(400, "body must be a JSON object")
    return doc


def _parsed(text: bytes | bytearray, what: str) -> Any:
    """JSON from a request: a 422 if it nests too deep or holds too long a number (the
    parser's stack and CPU), a 400 if it is not JSON."""
    try:
        return jsonbounds.loads(text)
    except HostileJsonError as exc:
        raise Refused(422, f"{what}: {exc}") from None
    except MalformedJsonError:
        raise Refused(400, f"{what} must be JSON") from None


# ---------------------------------------------------------------- the client side


class PeerClient(Protocol):
    """What a node asks of its peers' data planes (``DataClient`` over HTTP,
    ``MemoryClient`` in one process). Every failure is a ``PeerError``."""

    self_url: str | None
    limits: HttpLimits

    async def get_json(self, url: str) -> Any: ...
    async def get_bytes(
        self, url: str, limit: int | None = None, moved: Callable[[int], None] | None = None
    ) -> bytes:
        """A body of at most ``limit`` bytes; ``moved`` is told how many are in as they come
        (a chunk's, over transports that see them come: HTTP), else never."""
        ...

    def get_parts(self, url: str, sizes: list[int]) -> AsyncIterator[bytes]:
        """A ``/chunks`` reply as its parts of ``sizes`` bytes, each as soon as it is in;
        fewer if the body ends early, a ``PeerError`` if it ends within a part or runs over."""
        ...

    def get_feed(self, url: str) -> AsyncIterator[Any]:
        """A ``FEED`` reply's JSON answers, each as soon as its line is in (one answer over
        transports that send whole replies); ends when the peer ends the reply."""
        ...

    async def post_json(self, url: str, doc: Any) -> Any: ...
    async def announce(
        self,
        peer: str,
        digests: list[str],
        extra: Mapping[str, Any] | None = None,
        chunks: list[bytes] | None = None,
        manifests: bytes = b"",
    ) -> None:
        """``POST /announce``; ``extra``: its optional fields (offers, manifests); with
        packed ``manifests`` (``pack_manifests``) or ``chunks`` (those ``extra["pushing"]``
        names) the framed body, those after the JSON."""
        ...

    async def close(self) -> None: ...


def check_reply(url: str, status: int, length: int, limit: int, expect: int = 200) -> None:
    """A reply's status and announced length, judged before its body is read."""
    if status == 503:
        raise PeerBusyError(f"{url}: busy")
    if status == 404 and expect != 404:
        raise PeerLacksError(f"{url}: HTTP 404")
    if status != expect:
        raise PeerError(f"{url}: HTTP {status}")
    if length > limit:
        raise PeerError(f"{url}: response of {length} bytes over limit")


async def split_parts(body: Awaitable[bytes], url: str, sizes: list[int]) -> AsyncIterator[bytes]:
    """``get_parts`` over a client that has the reply only whole (``body``: its request).
    The parts come before any verdict on the length: a peer sending too many bytes still
    has its first parts checked against their hashes (and is banned if they fail)."""
    try:
        data, at = await body, 0
    except PeerLacksError:  # it lacks the first
        return
    view = memoryview(data)
    for size in sizes:
        if at == len(data):
            return
        if at + size > len(data):
            raise PeerError(f"{url}: reply ends within a chunk")
        yield bytes(view[at : at + size])
        at += size
    if at != len(data):
        raise PeerError(f"{url}: reply over the chunks' length")


def parse_json(url: str, body: bytes) -> Any:
    """A peer's JSON answer; a PeerError if it is not JSON or past ``jsonbounds`` limits."""
    try:
        return jsonbounds.loads(body)
    except HostileJsonError as exc:
        raise PeerError(f"{url}: {exc}") from None
    except MalformedJsonError:
        raise PeerError(f"{url}: not JSON") from None


async def gather_quietly(calls: list[Awaitable[Any]]) -> list[Any]:
    """Run calls concurrently; a PeerError becomes None in the result (peers come and go)."""

    async def one(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except PeerError:
            return None

    return list(await asyncio.gather(*(one(c) for c in calls)))
