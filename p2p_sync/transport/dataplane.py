"""The data plane's router: every request a node serves, answered apart from any server
library (the requests and their answers: ``docs/dataplane.md``).

Why a router of its own: the aiohttp server (``transport.http``), libp2p streams
(``transport.streams``), reverse channels (``transport.reverse``) and the in-memory network
(``transport.memory``, N nodes in one process for tests) answer requests with the same code,
so a control-plane test in memory exercises exactly what a real node serves. Chunks are
served within upload slots (``p2p_sync.protocol.uploads``) and an optional upload cap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from p2p_sync.bounded import remember
from p2p_sync.protocol.havelog import LOG_ID
from p2p_sync.protocol.ratelimit import TokenBucket
from p2p_sync.protocol.uploads import Admission, UploadSlots
from p2p_sync.transport.announcement import read_announcement
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import (
    FEED,
    HEX32,
    MAX_RUN,
    BodyReader,
    Refused,
    Reply,
    Request,
    hex_arg,
    json_body,
    same_host,
    valid_peer_url,
)
from p2p_sync.transport.nodeview import NodeView

MAX_UPLOADED = 1 << 14  # chunks whose upload counts a data plane remembers (~3 MB)


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
        return await self._serve_chunks([hex_arg(sha, "sha")], req)

    async def _run(self, joined: str, req: Request) -> Reply:
        """A run of chunks (``/chunks``), holding one upload slot (the caller releases it)."""
        shas = [joined[at : at + 64] for at in range(0, len(joined), 64)]
        if not 0 < len(shas) <= MAX_RUN:
            raise Refused(400, f"name 1 to {MAX_RUN} chunks")
        for sha in shas:
            hex_arg(sha, "each sha")
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
        data = self.node.manifest_bytes(hex_arg(digest, "digest"))
        if data is None:
            raise Refused(404, "no such manifest here")
        return Reply(200, data)

    async def _have(self, req: Request, digest: str) -> Reply:
        hex_arg(digest, "digest")
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
        news = read_announcement(req, self.limits)
        self.node.on_announce(news.url, news.digests, news.pushed)
        if news.pushing and news.rest is not None and news.url is not None:
            await self._take_pushed(news.url, news.pushing, news.rest)
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
        doc = json_body(req, self.limits)
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
