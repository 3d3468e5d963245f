"""How a node learns and spreads signed manifests: HTTP announcements, libp2p gossip, polls.

Every manifest, whichever way it came, passes the node's one trust gate (``TrustedSet``) before
it is stored; accepted news is relayed once (HTTP push to peers gossip does not reach) and wakes
the rollout's planner (``new_info``). The libp2p host calls ``judge`` in its own thread (pure:
no store writes) and ``on_gossip`` / ``on_p2p_peer`` on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from p2p_sync.bounded import remember
from p2p_sync.errors import (
    ChunkError,
    LayoutSwapAttackError,
    ManifestError,
    PeerError,
    RollbackAttackError,
    StoreFullError,
)
from p2p_sync.protocol.peers import PeerAnswered, PeerFailed, Source
from p2p_sync.protocol.ratelimit import TokenBucket
from p2p_sync.protocol.seeding import chunks_behind
from p2p_sync.protocol.versions import PATCH
from p2p_sync.runtime.early import EarlyFeeds, follow_order
from p2p_sync.runtime.forwarding import Forwarder
from p2p_sync.runtime.peering import described
from p2p_sync.runtime.ports import LearnHost
from p2p_sync.runtime.pushed import PushedChunks
from p2p_sync.transport.announcement import Pushed, pack_manifests
from p2p_sync.transport.client import gather_quietly
from p2p_sync.trust import announce
from p2p_sync.trust.chunks import verify_chunk
from p2p_sync.trust.manifest import Manifest

log = logging.getLogger("p2psync.node")
_SAMPLER = random.Random()  # poll-target sampling (the sans-I/O directory takes it passed in)
MAX_OFFERS = 256  # chunk offers pushed with announcements, kept until a download asks
MAX_SEEDS = 16  # peers remembered as seeds (their announcements carried offers)


class Learner:
    """One node's manifest traffic, both ways."""

    def __init__(self, node: LearnHost) -> None:
        self.node = node
        self.new_info = asyncio.Event()  # set whenever a manifest is accepted
        self.announce_latency_ms: dict[int, int] = {}  # version -> trainer signing to here
        self._learning: set[str] = set()
        self._offers: dict[tuple[str, str], list[int]] = {}  # (peer, digest) -> indices
        # (peer, digest) -> the chunks of its offer it sends behind the announcement
        self._pushing: dict[tuple[str, str], list[int]] = {}
        self.pushed = PushedChunks()  # those chunks, until the download takes them
        self.seeds: dict[str, None] = {}  # peers that pushed offers: seeds (the trainer)
        self.forwarder = Forwarder(node)  # what the seeds hand us, passed on unasked
        # have feeds opened while a manifest is fetched, for the download to take over
        self.early = EarlyFeeds(lambda: node.client, 2 * node.cfg.http.have_wait_s)
        self._p2p_urls: set[str] = set()  # peers reachable by gossip (no HTTP push needed)
        self._tasks: list[asyncio.Task[Any]] = []
        self._poller: asyncio.Task[None] | None = None
        rate = node.cfg.announce.per_s
        self._gossip_rate = TokenBucket(rate, max(1.0, rate))
        self._started_at = node.accepted_version  # version at start

    async def stop(self) -> None:
        await self.early.stop()
        await self.forwarder.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        task = asyncio.create_task(coro)
        task.add_done_callback(self._ended)
        self._tasks.append(task)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        """A spawned task (it talks to peers) ended: whatever they sent that it could not take
        gets one log line (rate-limited), not silence (nobody awaits these tasks' results)."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.node.peering.complain(None, f"learning: {described(exc)}")

    def start_polling(self) -> None:
        self._poller = asyncio.create_task(self.poll_loop())
        self._tasks.append(self._poller)

    async def settled(self) -> None:
        """Wait until the learning started so far (fetches, relays) is done: every manifest
        offered before this call has been accepted or refused."""
        busy = [t for t in self._tasks if not t.done() and t is not self._poller]
        await asyncio.gather(*busy, return_exceptions=True)

    # ------------------------------------------------------------ HTTP: announcements, fetches

    def on_announce(
        self,
        url: str | None,
        digests: list[str],
        pushed: Pushed = Pushed(),
    ) -> None:
        """An HTTP announcement; ``pushed.offers``: the sender's first have-map answers to this
        node (kept for the download), ``pushed.manifests``: inline, judged as if fetched;
        ``pushed.gossiped``: the news is on its way by gossip too, manifests inline, so a node
        on the mesh takes only the manifests pushed inline and leaves the rest to gossip
        (fetching them from ``url`` would cost a round trip and the sender's uplink; and the
        gossip copy is forwarded all the same: ``GossipValidator.learned_elsewhere``)."""
        node = (
            self.node
        )  # ``url`` proves nothing by announcing (``p2p_sync.protocol.peers``): not added
        url = node.peering.directory.name_of(url) if url is not None else None  # normalised
        if url is None or url in node.peering.banned:
            return
        for digest, have in pushed.offers.items():
            remember(self._offers, (url, digest), have, MAX_OFFERS)
        if pushed.offers:  # only a seed hands out offers (kept only from ``url``'s host)
            remember(self.seeds, url, None, MAX_SEEDS)
        for digest, indices in pushed.pushing.items():
            remember(self._pushing, (url, digest), indices, MAX_OFFERS)
        mesh = node.p2p is not None and node.p2p.status().get("mesh_peers", 0) > 0
        fresh = [d for d in digests if not node.store.has_manifest(d)]
        if pushed.gossiped and mesh:
            fresh = [d for d in fresh if d in pushed.manifests]
        if fresh:
            self.spawn(self.learn(url, fresh, pushed.manifests))

    def take_offer(self, peer: str, digest: str) -> tuple[list[int] | None, list[int]]:
        """What ``peer`` pushed with its announcement of ``digest``: its have-map answer, so
        a download's first question to it needs no round trip (once: later ones long-poll),
        and the chunks of it sent behind the announcement (not to be requested)."""
        return self._offers.pop((peer, digest), None), self._pushing.pop((peer, digest), [])

    def on_pushed(self, url: str, digest: str, index: int, data: bytes) -> None:
        """A chunk behind an announcement (from ``url``'s host: the data plane checked)."""
        if url not in self.node.peering.banned:
            self.pushed.put(url, digest, index, data)
            if self._adopt(digest):
                self.node.view.notify_have()  # once: every held long poll answers the news

    def _adopt(self, digest: str) -> bool:
        """Store the chunks pushed of ``digest`` at once, verified, once its manifest is
        here, whether or not a download wants them now: the trainer counts them fetched by
        this node, so the swarm asks this node for them (a follower still catching up would
        otherwise hold them back until the seed lets them starve, ``starve_after_s``). The
        download of ``digest`` still takes them from the inbox, for its scheduler. Whether it
        stored any."""
        m, stored = self.node.store.manifest(digest), False
        if m is None:
            return False
        for url, index, data in self.pushed.held(digest):
            if index >= len(m.chunks) or self.node.store.has_chunk(m.chunks[index]):
                continue
            try:
                verify_chunk(m, index, data)
            except ChunkError:
                self.node.ban(url, f"pushed chunk {index} of {digest[:16]} failing its hash")
                continue
            try:
                self.node.store.put_chunk(data, m.chunks[index])
            except StoreFullError:  # logged by the store; the download takes them later
                break
            stored = True
        return stored

    def _keep(self, manifest: Manifest, data: bytes) -> bool:
        """Store an accepted manifest, take the chunks pushed of it, and wake the have feeds
        held for it (``GET /have`` of a manifest not here waits for it: peers that heard of
        the version first are already following this node). False when the disk is full:
        not learned, so the next poll of a peer's manifests offers it again."""
        try:
            self.node.store.put_manifest(manifest, data)
        except StoreFullError:  # logged by the store
            return False
        self.node.timeline.note(manifest.digest, "learned")
        self._adopt(manifest.digest)
        self.node.view.notify_have()
        return True

    async def learn(
        self, peer: str, digests: list[str], inline: Mapping[str, bytes] | None = None
    ) -> list[Manifest]:
        """Fetch (unless ``inline``), verify and keep manifests ``peer`` offers; relay the
        accepted ones onward."""
        accepted = []
        for digest in digests:
            if digest in self._learning or self.node.store.has_manifest(digest):
                continue
            self.node.timeline.note(digest, "heard")  # announced, polled or gossiped
            self._learning.add(digest)
            data = (inline or {}).get(digest)
            if data is None:
                self._ask_early(digest)
            try:
                manifest = await self._learn_one(peer, digest, data)
            finally:
                self._learning.discard(digest)
            if manifest is not None:
                accepted.append(manifest)
            else:
                self.early.close(digest)
        if accepted:
            self.new_info.set()
            await self.announce([m.digest for m in accepted], exclude={peer})
        return accepted

    def follow_order(self, digest: str) -> list[str]:
        """The usable peers in the order a download of ``digest`` follows them."""
        known = self.node.peering.directory.known

        def trusted(url: str) -> bool:
            entry = known.get(url)
            return entry is not None and entry.trusted

        return follow_order(self.node.peering.usable(), trusted, self.early.salt_for(digest))

    def _ask_early(self, digest: str) -> None:
        """A rollout asks the peers its download will follow for their have-maps of
        ``digest`` while it fetches the manifest (``p2p_sync.runtime.early``): the download then
        starts
        with their answers instead of asking a round trip later."""
        if self.node.cfg.role == "rollout":
            peers = self.follow_order(digest)[: self.node.cfg.download.max_sources]
            self.early.open(digest, peers)

    async def _learn_one(self, peer: str, digest: str, data: bytes | None) -> Manifest | None:
        node = self.node
        assert node.client is not None
        try:
            if data is None:
                limit = node.trusted.limits.manifest.max_manifest_bytes
                data = await node.client.get_bytes(f"{peer}/manifest/{digest}", limit)
            manifest = node.trusted.admit(data, time.time(), digest)
        except PeerError as exc:
            node.peering.handle(PeerFailed(peer, str(exc)))
            return None
        except (RollbackAttackError, LayoutSwapAttackError):
            return None  # signed news not for us (stale, other tensors): not this peer's doing
        except ManifestError as exc:
            node.ban(peer, f"offered a bad manifest ({exc})")
            return None
        except (ValueError, RecursionError) as exc:  # bytes no parser takes (deep, huge numbers)
            node.ban(peer, f"offered a bad manifest ({described(exc)})")
            return None
        node.peering.handle(PeerAnswered(peer))  # reachable; proven only by chunks it serves
        if not self._keep(manifest, data):
            return None
        if node.p2p is not None:  # its gossip copy, if one comes, is still news to forward
            node.p2p.gate.learned_elsewhere([digest])
        return manifest

    async def announce(self, digests: list[str], exclude: set[str] = frozenset()) -> None:
        """Tell peers about manifests: gossip for our own publications (relays pass
        ``exclude``; gossipsub relays by itself), HTTP push to peers gossip does not reach
        and, with their offers, to our followers (at once, not after the gossip publish: an
        offer that comes after the gossiped manifest finds the follower already asking; the
        gossip is handed to libp2p first, as mesh followers take the manifests from it)."""
        node = self.node
        if node.client is None or not digests:
            return
        own = node.signer is not None and not exclude  # our publication, not a relay
        gossip = asyncio.ensure_future(self._gossip(digests)) if node.p2p and own else None
        if gossip is not None:
            await asyncio.sleep(0)  # let it sign and hand the message to libp2p first
        followers = node.view.followers() if own else set()
        skip = exclude | (self._p2p_urls - followers)
        peers = [p for p in node.peering.usable() if p not in skip]
        # a relay's: the digests alone
        extra: list[tuple[dict[str, Any], list[bytes], bytes]] = [({}, [], b"") for _ in peers]
        if own:
            texts = {d: b.decode() for d in digests if (b := node.store.manifest_bytes(d))}
            packed = pack_manifests(texts)  # once: ~52 KB for 1,526 chunks (JSON: ~107 KB)
            inline = (packed, len(json.dumps(texts)))  # what it unpacks to: within the limit
            behind = self._behind(digests, peers, followers)
            extra = [self._extra(p, digests, followers, inline, behind) for p in peers]
        pushes = asyncio.ensure_future(
            gather_quietly([self._push(p, digests, *x) for p, x in zip(peers, extra)])
        )
        if gossip is not None:
            await gossip
        await pushes

    async def _push(
        self,
        peer: str,
        digests: list[str],
        extra: dict[str, Any],
        chunks: list[bytes],
        manifests: bytes,
    ) -> None:
        """``POST /announce`` (framed, with the packed ``manifests`` and ``chunks`` behind
        it, when it carries either); a follower it fails to reach gives back the chunks
        handed to it (else they would wait ``reseed_after_s`` for a peer that is gone)."""
        assert self.node.client is not None
        extra = {**extra, **self.node.transport.revocations()}  # a private swarm's list
        try:
            await self.node.client.announce(peer, digests, extra, chunks, manifests)
        except PeerError:
            if "offers" in extra:
                self.node.view.withdraw(peer)
            raise
        if chunks:
            self.node.view.count_upload(sum(map(len, chunks)))

    def _extra(
        self,
        peer: str,
        digests: list[str],
        followers: set[str],
        inline: tuple[bytes, int],
        behind: dict[str, int],
    ) -> tuple[dict[str, Any], list[bytes], bytes]:
        """What our own announcement carries to ``peer`` beyond the digests: to a follower,
        the chunks we hand it (``_offers_to``) and, unless gossip reaches it, the manifests
        (``inline``: packed, and the size they unpack to) when within the receiver's limit
        (returned apart: the framed body carries them); whether the news also went out by
        gossip (a node on the mesh then takes the manifests from it: our view of the mesh is
        not complete); and chunks sent behind inline manifests (``_pushed_behind``)."""
        assert self.node.client is not None
        extra: dict[str, Any] = {}
        if peer in followers:
            extra["offers"] = self._offers_to(peer, digests)
        if self.node.p2p is not None:
            extra["gossiped"] = True
        packed, size = inline
        to_follower = peer in followers and peer not in self._p2p_urls
        fits = size <= self.node.client.limits.max_request_bytes
        manifests = packed if to_follower and fits else b""
        chunks: list[bytes] = []
        if manifests and behind.get(peer):
            pushing, chunks = self._pushed_behind(peer, digests, behind[peer])
            if chunks:
                extra["pushing"] = pushing
        return extra, chunks, manifests

    def _offers_to(self, peer: str, digests: list[str]) -> dict[str, Any]:
        """The chunks of each payload handed to the follower ``peer`` (its first have-map
        answer, ahead of its question)."""
        view = self.node.view
        return {d: have for d in digests if (have := view.offer(d, peer)) is not None}

    def _pushed_behind(
        self, peer: str, digests: list[str], count: int
    ) -> tuple[list[list[Any]], list[bytes]]:
        """The first ``count`` chunks handed to ``peer``, to send behind the announcement
        (within the push limit): their ``pushing`` entries and their bytes."""
        assert self.node.client is not None
        digest = self._push_digest(digests)
        budget = self.node.client.limits.max_push_bytes
        sent = self.node.view.pushable(digest, peer, count, budget)
        return [[digest, i, len(data)] for i, data in sent], [data for _, data in sent]

    def _behind(self, digests: list[str], peers: list[str], followers: set[str]) -> dict[str, int]:
        """How many chunks each follower over HTTP gets behind the announcement: what our
        uplink carries in one round trip (``view.behind_budget``, measured), one chunk to
        each in turn, at most ``[publish] push_chunks`` each (``seeding.chunks_behind``)."""
        m = self.node.store.manifest(self._push_digest(digests))
        takers = [p for p in peers if p in followers and p.startswith("http://")]
        if m is None or not takers:
            return {}
        budget, most = self.node.view.behind_budget(), self.node.cfg.publish.push_chunks
        return dict(zip(takers, chunks_behind(budget, m.chunk_size, len(takers), most)))

    def _push_digest(self, digests: list[str]) -> str:
        """Whose chunks ride behind the announcement: the 1-step patch (what every follower
        at the previous version fetches next), else the first digest (version 0's
        snapshot)."""
        for digest in digests:
            m = self.node.store.manifest(digest)
            if m is not None and m.kind == PATCH and m.base_version == m.version - 1:
                return digest
        return digests[0]

    # ------------------------------------------------------------ pull fallback

    async def poll_loop(self) -> None:
        """Every poll interval, ask some peers for their manifests and peers. Nothing a peer
        sends ends it: each peer's answers are taken apart from the others' (``_take``)."""
        while True:
            try:
                await self.poll_once()
            except Exception as exc:  # a bug of ours: one line (rate-limited), and go on
                self.node.peering.complain(None, f"poll round: {described(exc)}")
            await asyncio.sleep(self.node.cfg.directory.poll_interval_s)

    async def poll_once(self) -> None:
        """One round: the directory's poll targets (given peers whose back-off has passed,
        and a few others) asked for their ``/manifests`` and ``/peers``."""
        node = self.node
        peers = node.peering.directory.poll_targets(_SAMPLER, time.monotonic())
        indexes = await asyncio.gather(*(self._get_json(f"{p}/manifests") for p in peers))
        lists = await asyncio.gather(*(self._get_json(f"{p}/peers") for p in peers))
        for peer, (index, failure), (plist, _) in zip(peers, indexes, lists):
            if failure is not None:
                node.peering.failed(peer, failure)
                continue
            node.peering.answered(peer)  # answered: reset its failure count
            try:
                await self._take(peer, index, plist)
            except Exception as exc:  # what it sent, whatever it was, ends with this peer
                node.peering.complain(peer, f"poll answer: {described(exc)}")

    async def _get_json(self, url: str) -> tuple[Any, str | None]:
        """A peer's JSON answer, or None and why not: no answer, or one no parser takes."""
        assert self.node.client is not None
        try:
            return await self.node.client.get_json(url), None
        except PeerError as exc:
            return None, str(exc)
        except Exception as exc:  # bytes the JSON parser chokes on (nesting, huge numbers)
            return None, f"{url}: unreadable answer ({described(exc)})"

    async def _take(self, peer: str, index: Any, plist: Any) -> None:
        """A poll's answers from ``peer``: the names it lists, if it vouches for them (it is
        given or proven: ``PeerDirectory.vouches``), and the fresh manifests it lists."""
        node = self.node
        if node.peering.directory.vouches(peer):
            names = plist.get("peers") if isinstance(plist, dict) else None
            if not isinstance(names, list):
                node.peering.complain(peer, '/peers answer is not {"peers": [...]}')
                names = []
            for url in names[: node.cfg.directory.max_peers]:
                node.add_peer(url, Source.HEARSAY)  # normalised, or refused, by the directory
        fresh = node.trusted.wanted(index, node.store.has_manifest)
        if fresh:
            await self.learn(peer, fresh)

    async def _ask_head(self, peer: str) -> None:
        index, failure = await self._get_json(f"{peer}/manifests")
        if failure is not None:
            return
        fresh = self.node.trusted.wanted(index, self.node.store.has_manifest)
        if fresh:
            await self.learn(peer, fresh)

    # ------------------------------------------------------------ gossip (libp2p)

    async def _gossip(self, digests: list[str]) -> None:
        """One signed announcement per version, at most ``[announce] per_s`` a second
        (gossipsub silently drops bursts above ~10 msg/s per peer), manifests inline."""
        by_version: dict[int, list[str]] = {}
        for digest in digests:
            m = self.node.store.manifest(digest)
            if m is not None:
                by_version.setdefault(m.version, []).append(digest)
        step = self.node.trusted.limits.announce.max_digests
        for version, group in sorted(by_version.items()):
            for start in range(0, len(group), step):
                await self._gossip_one(version, group[start : start + step])

    async def _gossip_one(self, version: int, digests: list[str]) -> None:
        node = self.node
        assert node.signer is not None and node.url is not None
        wait = self._gossip_rate.reserve(1, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)  # rate limit, not synchronization
        a = announce.Announcement(
            node.policy.swarm_id, version, tuple(digests), int(time.time() * 1000), (node.url,)
        )
        inline = [b for b in map(node.store.manifest_bytes, digests) if b is not None]
        data = announce.encode(a, [node.signer], inline, node.trusted.limits.announce)
        try:
            await node.p2p.publish(data)
        except Exception as exc:  # gossip is best effort: the pull path still covers peers
            log.warning("gossip publish of v%d failed: %s", version, exc)

    def judge(self, data: bytes, known: Callable[[str], bool]) -> announce.Decision:
        """Runs in the libp2p thread, inside gossipsub validation (pure: no store writes)."""
        return self.node.trusted.judge(data, int(time.time() * 1000), known)

    def heard(self, decision: announce.Decision, at_ms: int) -> None:
        """Gossip brought a genuine announcement (new, or news we already had by HTTP): keep
        how long it took from the trainer's signature, the first time per version."""
        a = decision.announcement
        assert a is not None
        if self._started_at is not None and a.version <= self._started_at:
            return  # news from before this process started (history re-sent to a newcomer)
        self.announce_latency_ms.setdefault(a.version, at_ms - a.issued_ms)
        while len(self.announce_latency_ms) > 64:
            del self.announce_latency_ms[min(self.announce_latency_ms)]

    def on_gossip(self, decision: announce.Decision, sender: str | None, at_ms: int) -> None:
        """An accepted announcement: keep its inline manifests, fetch the others by digest."""
        a = decision.announcement
        assert a is not None
        self.heard(decision, at_ms)
        for d in a.digests:
            self.node.timeline.note(d, "heard", at_ms / 1000)
        if self.node.cfg.role == "bootstrap":
            return
        stored = self._keep_inline(decision)
        if stored:
            self.new_info.set()
            self.spawn(self.announce(stored, exclude=set(a.sources)))
        store, inline = self.node.store, {m.digest for m, _ in decision.manifests}
        missing = [d for d in a.digests if d not in inline and not store.has_manifest(d)]
        if missing:  # too big to ride inline: fetch by digest, from the sender or a source
            banned = self.node.peering.banned
            peers = [p for p in dict.fromkeys([sender, *a.sources]) if p and p not in banned]
            self.spawn(self._learn_any(peers, missing))

    def _keep_inline(self, decision: announce.Decision) -> list[str]:
        """Store the fresh manifests an announcement carried inline; their digests."""
        stored = []
        for m, raw in self.node.trusted.fresh_inline(decision):
            if not self.node.store.has_manifest(m.digest) and self._keep(m, raw):
                stored.append(m.digest)
        return stored

    async def _learn_any(self, peers: list[str], digests: list[str]) -> None:
        """The forwarder may not hold the manifests yet (it judged, then forwarded at once):
        fall back to the announced sources."""
        for peer in peers:
            digests = [d for d in digests if not self.node.store.has_manifest(d)]
            if not digests:
                return
            await self.learn(peer, digests)

    def on_p2p_peer(self, url: str, bootstrap: bool = False) -> None:
        """A data-plane URL from a signed peer record: add it, and ask it for its head now.
        ``bootstrap``: the record's signer is one of the ``--bootstrap`` peers, which the
        operator named by key: given, so the peers it lists are taken (``PeerDirectory.vouches``;
        without that a node behind NAT, known to nobody else, is never found)."""
        node = self.node
        if len(self._p2p_urls) < 4 * node.cfg.directory.max_peers:
            self._p2p_urls.add(url)
        known = url in node.peering.known
        node.add_peer(url, Source.GIVEN if bootstrap else Source.RECORD)
        if not known and url in node.peering.known and node.cfg.role != "bootstrap":
            self.spawn(self._ask_head(url))
