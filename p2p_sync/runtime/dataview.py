"""What the HTTP data plane sees of a node (``transport.http.NodeView``): manifests, have-maps,
chunks, peers, status and metrics, read from the node's store and directory."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Iterable
from typing import Any

from p2p_sync.bounded import remember, trim
from p2p_sync.protocol.havelog import HaveLog
from p2p_sync.protocol.peers import P2P, Source
from p2p_sync.protocol.seeding import SuperSeeder
from p2p_sync.runtime.ports import ViewHost
from p2p_sync.store import HaveMark
from p2p_sync.transport.announcement import Pushed

MAX_LOGS = 64  # have logs kept (one per payload being served; the oldest forgotten)
MAX_FOLLOWING = 256  # peers remembered per payload as following its have-map here
SERVES = 512  # the seed's recent chunk serves its uplink rate is measured over


async def _wait(news: asyncio.Event, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            await news.wait()
    except TimeoutError:
        pass


class DataView:
    """A rollout's (and a bootstrap's) data plane: it serves every chunk it holds."""

    def __init__(self, node: ViewHost) -> None:
        self.node = node
        self._have_news = asyncio.Event()  # set (and replaced) whenever a have-map grows
        self._have_memo: dict[str, list[int]] = {}  # have-maps computed since that news
        self._logs: dict[str, HaveLog] = {}  # digest -> its have-map in arrival order
        self._held: dict[str, tuple[HaveMark, list[int]]] = {}  # digest -> its last listing
        # digest -> the peers following its have-map here: when each last asked or was
        # answered on a feed (monotonic), the latest last
        self._following: dict[str, dict[str, float]] = {}
        # (digest, peer) -> chunks forwarded to that peer unasked (``p2p_sync.runtime.forwarding``)
        self._pushing: dict[tuple[str, str], set[int]] = {}

    def manifest_index(self) -> list[dict[str, Any]]:
        return [
            {
                "digest": m.digest,
                "version": m.version,
                "kind": m.kind,
                "base_version": m.base_version,
                "payload_size": m.payload_size,
            }
            for m in self.node.store.manifests()
        ]

    def manifest_bytes(self, digest: str) -> bytes | None:
        return self.node.store.manifest_bytes(digest)

    def notify_have(self) -> None:
        """A have-map changed: wake the long polls of ``GET /have?known=N``."""
        news, self._have_news = self._have_news, asyncio.Event()
        self._have_memo = {}
        news.set()

    def have_changed(self, timeout: float, requester: str | None = None) -> Awaitable[None]:
        """Awaitable: the next news after this call (the event is taken now, not when the
        caller first awaits: ``DataRouter._news_or_close``), or ``timeout``."""
        return _wait(self._have_news, timeout)

    def have(self, digest: str, requester: str | None) -> list[int] | None:
        """The chunks of ``digest`` held here. Computed once per news: every chunk that
        lands wakes every long poll held here (up to one per peer following this node), and
        each would list the whole manifest again: O(followers x chunks) per chunk. Each news
        adds only the chunks that arrived since the last listing (``Store.held_since``): a
        whole listing per chunk made a version O(chunks^2). Callers only read the list. A
        chunk dropped from the store is dropped from the list at the next news."""
        m = self.node.store.manifest(digest)
        if m is None:
            return None
        have = self._have_memo.get(digest)
        if have is None:
            mark, held = self._held.get(digest, (None, []))
            mark, got = self.node.store.held_since(m, mark)
            log = self._logs.get(digest)  # (an empty log is falsy: no ``or`` here)
            if mark.whole or log is None:
                have, log = got, (HaveLog() if log is None else log).sync(got)
            else:
                have, log = held + got, log.grow(got)
            self._have_memo[digest] = have
            remember(self._held, digest, (mark, have), MAX_LOGS)
            remember(self._logs, digest, log, MAX_LOGS)
        return have

    def have_log(self, digest: str) -> HaveLog | None:
        """``digest``'s have-map in arrival order, as of the last :meth:`have` (which the
        data plane asks first): a long poll is answered only what it lacks."""
        return self._logs.get(digest)

    def followed(self, digest: str, peer: str) -> None:
        peers = self._following.get(digest, {})
        remember(peers, peer, time.monotonic(), MAX_FOLLOWING)
        remember(self._following, digest, peers, MAX_LOGS)

    def pushing(self, digest: str, peer: str, index: int, on: bool = True) -> None:
        """Chunk ``index`` of ``digest`` is forwarded to ``peer`` now: say so in the have-map
        answers to ``peer`` from here on (``pushing_to``); ``on=False``: the push failed,
        say no more (``peer`` requests it as any chunk)."""
        pushed = self._pushing.get((digest, peer), set())
        if on:
            pushed.add(index)
        else:
            pushed.discard(index)
        remember(self._pushing, (digest, peer), pushed, MAX_LOGS * MAX_FOLLOWING // 16)

    def pushing_to(self, digest: str, peer: str) -> set[int]:
        return self._pushing.get((digest, peer), set())

    def following(self, digest: str) -> list[str]:
        """The peers following our have-map of ``digest`` (a manifest held here) now: those
        that asked it, or had an answer on a feed, within twice ``have_wait_s`` (a live feed
        is answered at least that often: news, or its end and the next question); one that
        is done stops asking and drops out. The latest last."""
        recent = time.monotonic() - 2 * self.node.cfg.http.have_wait_s
        return [p for p, at in self._following.get(digest, {}).items() if at >= recent]

    def offer(self, digest: str, peer: str) -> list[int] | None:
        """What to push ``peer`` with our news: what ``have`` would answer it."""
        return self.have(digest, peer)

    def chunk(self, sha256: str, requester: str | None = None) -> bytes | None:
        return self.node.store.get_chunk(sha256)

    def peer_urls(self) -> list[str]:
        """What ``/peers`` answers: the peers this node vouches for (``PeerDirectory.shared``)."""
        return self.node.peering.directory.shared()

    def count_upload(self, nbytes: int) -> None:
        self.node.metrics.count_upload(nbytes)

    def upload_contact(self, requester: str, pending: bool) -> None:
        """Only a seed cares whether a requester still asks (see :class:`SeedingView`)."""

    def status(self) -> dict[str, Any]:
        return self.node.status()

    def metrics_text(self) -> bytes:
        return self.node.metrics.text()

    def on_announce(self, url: str | None, digests: list[str], pushed: Pushed) -> None:
        if pushed.revocations:
            self.node.transport.adopt_revocations(pushed.revocations)
        self.node.learner.on_announce(url, digests, pushed)

    def on_pushed(self, url: str, digest: str, index: int, data: bytes) -> None:
        self.node.learner.on_pushed(url, digest, index, data)

    def pushable(self, digest: str, peer: str, count: int, budget: int) -> list[tuple[int, bytes]]:
        """Chunks to send ``peer`` behind an announcement: none (only a seed hands out)."""
        return []

    def behind_budget(self) -> float:
        """Bytes the uplink carries in a round trip, for chunks behind announcements: none."""
        return 0.0

    def followers(self) -> set[str]:
        """Peers to push a chunk offer with an announcement: none (only a seed hands out)."""
        return set()

    def withdraw(self, peer: str) -> None:
        """An offer pushed to ``peer`` did not arrive: nothing to take back here."""

    def requester(self, url: str, remote: str | None, upload: bool) -> None:
        """Upload demand names a requester (at its own address); any other request's header
        names nobody, unless it is ``p2p://`` a peer id holding a libp2p connection to this
        node (its key proved in the handshake: as good as a signed record)."""
        if upload:
            self.node.add_peer(url, Source.REQUESTER, remote)
        elif url.startswith(P2P) and url.removeprefix(P2P) in self._linked_ids():
            self.node.add_peer(url, Source.RECORD, remote)

    def _linked_ids(self) -> Iterable[str]:
        """The peer ids connected to this node over libp2p now (their keys proved in the
        connections' handshakes); none in memory, or with libp2p off."""
        return getattr(self.node.p2p, "connected_ids", None) or ()

    def issued(self, nonce: str) -> bool:
        return self.node.reach.issued(nonce)

    async def dial_back(
        self, url: str, nonce: str, remote: str | None, outbound: bool
    ) -> dict[str, Any]:
        return await self.node.reach.dial_back(url, nonce, remote, outbound)


FOLLOWER_S = 120.0  # a peer that asked the seed for a have-map this recently still follows it
MAX_FOLLOWERS = 1024  # followers remembered (the oldest forgotten first)


class SeedingView(DataView):
    """The trainer's data plane: each requester is shown a few chunks of its own
    (super-seeding), so rollouts fetch different chunks and trade them among themselves."""

    def __init__(self, node: ViewHost) -> None:
        super().__init__(node)
        self.seeder = SuperSeeder.of(node.cfg.publish)
        self._asked: dict[str, float] = {}  # requester -> when it last asked for a have-map
        self._news_for: dict[str, asyncio.Event] = {}  # requester -> news of its offer
        # (when, bytes) of recent chunks served on request: the uplink's measured rate
        self._serves: collections.deque[tuple[float, int]] = collections.deque(maxlen=SERVES)

    def followers(self) -> set[str]:
        """Peers that asked for a have-map lately: the ones a new version's announcement
        carries an offer to (handed-out chunks wait ``reseed_after_s`` for a peer that never
        comes to fetch them, so only peers that do fetch get any)."""
        now = time.monotonic()
        return {peer for peer, at in self._asked.items() if now - at < FOLLOWER_S}

    def upload_contact(self, requester: str, pending: bool) -> None:
        self.seeder.contact(requester, pending, time.monotonic())

    def withdraw(self, peer: str) -> None:
        """The push to ``peer`` failed: it is no follower now, and its chunks go to others."""
        self._asked.pop(peer, None)
        self.seeder.release(peer)

    def chunk(self, sha256: str, requester: str | None = None) -> bytes | None:
        """The chunk; serving it wakes only the long polls of its requester and of the
        peer it was handed to (that peer's budget of hand-outs grows by one): the others'
        offers did not change. Waking every follower's poll cost each one a pass of the
        seeder over the whole manifest, O(followers x chunks) per chunk served (~0.5 ms a
        pass at 763 chunks: 17 ms of the event loop per chunk with 32 followers). What
        time alone frees (hand-outs of a peer gone quiet, starved chunks) reaches a
        follower when it is next served here or when its poll returns (``have_wait_s``),
        as the simulator's seed does (``_reoffer``, ``_repoll_seed``)."""
        data = self._hand(sha256, requester)
        if data is not None:
            self._serves.append((time.monotonic(), len(data)))
        return data

    def _hand(self, sha256: str, requester: str | None) -> bytes | None:
        """The chunk, if the seeder lets ``requester`` have it now (counted served)."""
        now, seeder = time.monotonic(), self.seeder
        if requester is not None and not seeder.may_serve(sha256, requester, now):
            return None  # handed to someone else and fetched: the swarm has it (a 404)
        owner = seeder.owner.get(sha256)
        data = super().chunk(sha256)
        if data is not None:
            seeder.note_served(sha256, requester, now)
            self._notify(requester)
            if owner is not None and owner[0] != requester:
                self._notify(owner[0])  # type: ignore[arg-type]
        return data

    def behind_budget(self) -> float:
        """What the uplink carries in one round trip: its rate over the last ``SERVES``
        chunks served on request (a version's fresh chunks leave at the uplink's pace) times
        the seeder's typical round trip; 0 until both were measured (the first versions)."""
        rtt = self.seeder.round_trip_s()
        if rtt is None or len(self._serves) < 2:
            return 0.0
        span = self._serves[-1][0] - self._serves[0][0]
        sent = sum(n for _, n in self._serves) - self._serves[-1][1]
        return rtt * sent / span if span > 0 else 0.0

    def notify_have(self) -> None:
        super().notify_have()
        news, self._news_for = self._news_for, {}
        for event in news.values():
            event.set()

    def _notify(self, requester: str | None) -> None:
        if requester is None:
            self.notify_have()
            return
        news = self._news_for.pop(requester, None)
        if news is not None:
            news.set()

    def have_changed(self, timeout: float, requester: str | None = None) -> Awaitable[None]:
        """The next news of ``requester``'s offer (any news when unnamed), or ``timeout``."""
        if requester is None:
            return super().have_changed(timeout)
        news = self._news_for.get(requester)
        if news is None:
            news = self._news_for[requester] = asyncio.Event()
            for forgotten in trim(self._news_for, MAX_FOLLOWERS):  # claimed names: bounded
                forgotten.set()  # the oldest ask again
        return _wait(news, timeout)

    def have(self, digest: str, requester: str | None) -> list[int] | None:
        """The requester's offer; asking makes it a follower (a push does not)."""
        if requester is not None:
            remember(self._asked, requester, time.monotonic(), MAX_FOLLOWERS)
        return self.offer(digest, requester)

    def pushable(self, digest: str, peer: str, count: int, budget: int) -> list[tuple[int, bytes]]:
        """The first ``count`` chunks of ``peer``'s offer, within ``budget`` bytes, served to
        it now (the seeder counts them fetched): they ride behind the announcement."""
        m, offer = self.node.store.manifest(digest), self.offer(digest, peer)
        sent: list[tuple[int, bytes]] = []
        for index in (offer or [])[:count] if m is not None else []:
            budget -= m.chunk_length(index)
            data = self._hand(m.chunks[index], peer) if budget >= 0 else None
            if data is None:
                break
            sent.append((index, data))
        return sent

    def have_log(self, digest: str) -> HaveLog | None:
        """None: an offer is per requester and can shrink (a hand-out lapses), so a seed
        answers each long poll with the whole offer."""
        return None

    def offer(self, digest: str, peer: str | None) -> list[int] | None:
        m = self.node.store.manifest(digest)
        return None if m is None else self.seeder.offer(m.chunks, peer, time.monotonic())
