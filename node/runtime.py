"""A running node: store, trust policy, peer directory, HTTP server and client, metrics.

Trainer and rollout share this; each adds its own loop (``trainer.Publisher``,
``rollout.Follower``). Peers are learned from ``--peers``, from who announces to us and from
peers' ``/peers`` lists (peer exchange), so one shared list bootstraps everyone. New versions
spread by push (``POST /announce``, relayed once by every node that accepts the manifest) with a
periodic pull of ``/manifests`` as the fallback for anything missed.

With libp2p (``transport/p2p.py``, on unless ``--no-p2p``) the peer source and the push path
are pluggable additions, not a second code path: HTTP URLs from signed peer records feed
``add_peer``; the trainer's signed gossip announcements, judged in the libp2p thread, feed
the same store / ``learn`` path; and a newly discovered peer is asked for its head at once.
HTTP pushes then go only to peers not reachable by gossip.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from node.config import NodeConfig
from p2p_sync import announce
from p2p_sync.errors import LayoutSwapAttackError, ManifestError, RollbackAttackError
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import Manifest, SwarmPolicy
from p2p_sync.peers import (
    PeerAction,
    PeerAnswered,
    PeerBanned,
    PeerDirectory,
    PeerEntry,
    PeerEvent,
    PeerFailed,
    PeerMisbehaved,
    PeerNamed,
    PeerServedVerified,
    Source,
)
from p2p_sync.ratelimit import TokenBucket
from p2p_sync.store import Store
from p2p_sync.transport.http import (
    DataClient,
    DataServer,
    PeerError,
    gather_quietly,
)
from p2p_sync.trusted import TrustedSet

log = logging.getLogger("p2psync.node")
_SAMPLER = random.Random()  # poll-target sampling (the sans-I/O directory takes it passed in)


def warm_codec() -> None:
    """Code and decode a tiny patch of each common float dtype, so the codec's compiled scans
    (numba, cached on disk) are ready before the first version arrives: compiling them costs
    about a second of CPU per process, which would otherwise land on the first version."""
    import torch

    from p2p_sync import codec
    from p2p_sync.patch import diff

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = {"w": torch.linspace(-2, 2, 4096).to(dtype)}
        new = {"w": base["w"].clone()}
        new["w"][::7] = -new["w"][::7]
        codec.decode(codec.encode(diff(base, new), base=base), base=base)


class Metrics:
    """Prometheus metrics of one node (its own registry, so several nodes fit in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.uploaded = Counter("p2psync_bytes_uploaded", "Chunk bytes served", registry=r)
        self.downloaded = Counter(
            "p2psync_bytes_downloaded", "Verified chunk bytes fetched", registry=r
        )
        self.version = Gauge("p2psync_version", "Accepted weights version", registry=r)
        self.peers = Gauge("p2psync_peers", "Known peers", registry=r)
        self.bans = Counter("p2psync_peers_banned", "Peers banned for bad data", registry=r)
        self.version.set(-1)


class Node:
    """Shared machinery of trainer and rollout nodes (implements the data plane's NodeView)."""

    def __init__(self, cfg: NodeConfig, policy: SwarmPolicy, store: Store) -> None:
        self.cfg, self.policy, self.store = cfg, policy, store
        self.metrics = Metrics()
        self.directory = PeerDirectory(cfg.directory, given=frozenset(cfg.peers))
        self.url: str | None = None
        self.server = DataServer(self, cfg.http)
        self.client: DataClient | None = None
        self.new_info = asyncio.Event()
        self._learning: set[str] = set()
        self._tasks: list[asyncio.Task[Any]] = []
        self._have_news = asyncio.Event()  # set (and replaced) whenever a have-map grows
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.signer: SigningKey | None = None  # set on the trainer: signs gossip announcements
        self.p2p: Any = None  # transport.p2p.P2PHost once libp2p is up
        self.multiaddr: str | None = None
        self._p2p_urls: set[str] = set()  # peers reachable by gossip (no HTTP push needed)
        self.announce_latency_ms: dict[int, int] = {}  # version -> trainer signing to here
        self.last_publish: dict[str, Any] | None = None  # trainer: timings of the last version
        self.last_update: dict[str, Any] | None = None  # rollout: timings of the last hand-off
        self._started_at = store.state.version if store.state else None  # version at start
        self.trusted = TrustedSet(
            policy, lambda: self.accepted_version, cfg.trust_limits, self._accepted_layout
        )
        rate = cfg.announce.per_s
        self._gossip_rate = TokenBucket(rate, max(1.0, rate))
        self.metrics.version.set(store.state.version if store.state else -1)
        for digest, why in store.drop_refused(self.trusted.admit_stored):  # same gate as news
            log.warning("dropped stored manifest %s: %s", digest[:16], why)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        host, port = self.cfg.host_port
        bound = await self.server.start(host, port)
        self.url = f"http://{self.cfg.advertise_host or host}:{bound}"
        self.client = DataClient(self.url, self.cfg.http)
        self.directory.me = self.url
        for peer in self.cfg.peers:
            self.add_peer(peer)
        if self.cfg.p2p:
            await self._start_p2p()
        if self.cfg.role != "bootstrap":  # a bootstrap holds no weights: nothing to poll for
            await asyncio.to_thread(warm_codec)
            self._tasks.append(asyncio.create_task(self._poll_loop(), name="poll"))
        # Everything alive now (torch, libp2p, aiohttp, the weights' tensors) lives as long as
        # the node: move it out of the collector's sight. Full collections otherwise walk those
        # millions of objects again and again while chunks stream in (measured: 8 loopback
        # rollouts fetch 100 MB in 3.3 s instead of 4.0 s).
        gc.freeze()
        return self.url

    async def _start_p2p(self) -> None:
        """libp2p is an addition: if it cannot start, the node carries on from --peers."""
        try:
            from p2p_sync.transport import p2p  # imported here: --no-p2p nodes never load it

            host, port = self.cfg.host_port
            settings = p2p.P2PSettings(
                listen=self.cfg.p2p_listen or p2p.default_listen(host),
                advertise_host=self.cfg.advertise_host,
                identity_path=self.cfg.data_dir / p2p.IDENTITY_FILE,
                topic=announce.topic(self.policy.swarm_id),
                http_url=self.url,
                bootstrap=self.cfg.bootstrap,
                **asdict(self.cfg.libp2p),
            )
            node = p2p.P2PHost(
                settings,
                self._judge,
                self._on_gossip,
                self._on_p2p_peer,
                self.store.has_manifest,
                self._heard,
            )
            self.multiaddr = await node.start()
        except Exception as exc:  # any failure (import, identity file, bind): HTTP only
            log.warning("libp2p unavailable, using --peers only: %s", exc)
            return
        self.p2p = node

    async def stop(self) -> None:
        if self.p2p is not None:
            await self.p2p.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        await self.server.stop()

    # ------------------------------------------------------------ peers

    @property
    def peers(self) -> dict[str, PeerEntry]:
        return self.directory.known

    def _peer_event(self, event: PeerEvent) -> None:
        """Feed the sans-I/O peer directory; carry out what it says (logs, metrics). Runs on
        every request that names its sender, so a known peer costs a dict lookup, no more."""
        actions: list[PeerAction] = self.directory.handle(event)
        for a in actions:
            if isinstance(a, PeerBanned):
                log.warning("banned %s: %s", a.url, a.reason)
                self.metrics.bans.inc()
        if actions:
            self.metrics.peers.set(len(self.directory))

    def add_peer(self, url: str, source: Source = Source.HEARSAY) -> None:
        """Someone named a peer (unproven unless the operator gave it)."""
        self._peer_event(PeerNamed(url, source))

    def ban(self, url: str, reason: str) -> None:
        self._peer_event(PeerMisbehaved(url, reason))

    def peer_served(self, url: str) -> None:
        """``url`` served a chunk that verified against its signed manifest: a proven peer."""
        self._peer_event(PeerServedVerified(url))

    def usable_peers(self) -> list[str]:
        return self.directory.usable()

    # ------------------------------------------------------------ learning manifests

    @property
    def accepted_version(self) -> int | None:
        state = self.store.state
        return state.version if state else None

    def _accepted_layout(self) -> str | None:
        """The layout of the weights held, when the artifact that made them is known."""
        state = self.store.state
        m = self.store.manifest(state.manifest) if state and state.manifest else None
        return m.layout if m else None

    def on_announce(self, url: str | None, digests: list[str]) -> None:
        if url is not None:
            self.add_peer(url)
        source = url if url is not None and url not in self.directory.banned else None
        if source is not None:
            fresh = [d for d in digests if not self.store.has_manifest(d)]
            if fresh:
                self._spawn(self.learn(source, fresh))

    async def learn(self, peer: str, digests: list[str]) -> list[Manifest]:
        """Fetch, verify and keep manifests ``peer`` offers; relay the accepted ones onward."""
        assert self.client is not None
        accepted = []
        for digest in digests:
            if digest in self._learning or self.store.has_manifest(digest):
                continue
            self._learning.add(digest)
            try:
                manifest = await self._learn_one(peer, digest)
            finally:
                self._learning.discard(digest)
            if manifest is not None:
                accepted.append(manifest)
        if accepted:
            self.new_info.set()
            await self.announce([m.digest for m in accepted], exclude={peer})
        return accepted

    async def _learn_one(self, peer: str, digest: str) -> Manifest | None:
        assert self.client is not None
        try:
            limit = self.trusted.limits.manifest.max_manifest_bytes
            data = await self.client.get_bytes(f"{peer}/manifest/{digest}", limit)
            manifest = self.trusted.admit(data, time.time(), digest)
        except PeerError:
            self._peer_event(PeerFailed(peer))
            return None
        except (RollbackAttackError, LayoutSwapAttackError):
            return None  # signed news not for us (stale, other tensors): not this peer's doing
        except ManifestError as exc:
            self.ban(peer, f"offered a bad manifest ({exc})")
            return None
        self._peer_event(PeerAnswered(peer))  # reachable; proven only by chunks it serves
        self.store.put_manifest(manifest, data)
        return manifest

    async def announce(self, digests: list[str], exclude: set[str] = frozenset()) -> None:
        """Tell peers about manifests: gossip for our own publications (relays pass
        ``exclude``; gossipsub relays by itself), HTTP push to peers gossip does not reach."""
        if self.client is None or not digests:
            return
        if self.p2p is not None and self.signer is not None and not exclude:
            await self._gossip(digests)
        peers = [p for p in self.usable_peers() if p not in exclude and p not in self._p2p_urls]
        await gather_quietly([self.client.announce(p, digests) for p in peers])

    # ------------------------------------------------------------ gossip (libp2p)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(coro))

    async def _gossip(self, digests: list[str]) -> None:
        """One signed announcement per version, at most ``announce_per_s`` a second (gossipsub
        silently drops bursts above ~10 msg/s per peer), manifests inline when small."""
        by_version: dict[int, list[str]] = {}
        for digest in digests:
            m = self.store.manifest(digest)
            if m is not None:
                by_version.setdefault(m.version, []).append(digest)
        for version, group in sorted(by_version.items()):
            for start in range(0, len(group), self.trusted.limits.announce.max_digests):
                await self._gossip_one(
                    version, group[start : start + self.trusted.limits.announce.max_digests]
                )

    async def _gossip_one(self, version: int, digests: list[str]) -> None:
        assert self.signer is not None and self.url is not None
        wait = self._gossip_rate.reserve(1, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)  # rate limit, not synchronization
        a = announce.Announcement(
            self.policy.swarm_id, version, tuple(digests), int(time.time() * 1000), (self.url,)
        )
        inline = [b for b in map(self.store.manifest_bytes, digests) if b is not None]
        data = announce.encode(a, [self.signer], inline, self.trusted.limits.announce)
        try:
            await self.p2p.publish(data)
        except Exception as exc:  # gossip is best effort: the pull path still covers peers
            log.warning("gossip publish of v%d failed: %s", version, exc)

    def _judge(self, data: bytes, known: Callable[[str], bool]) -> announce.Decision:
        """Runs in the libp2p thread, inside gossipsub validation (pure: no store writes)."""
        return self.trusted.judge(data, int(time.time() * 1000), known)

    def _heard(self, decision: announce.Decision, at_ms: int) -> None:
        """Gossip brought a genuine announcement (new, or news we already had by HTTP): keep
        how long it took from the trainer's signature, the first time per version."""
        a = decision.announcement
        assert a is not None
        if self._started_at is not None and a.version <= self._started_at:
            return  # news from before this process started (history re-sent to a newcomer)
        self.announce_latency_ms.setdefault(a.version, at_ms - a.issued_ms)
        while len(self.announce_latency_ms) > 64:
            del self.announce_latency_ms[min(self.announce_latency_ms)]

    def _on_gossip(self, decision: announce.Decision, sender: str | None, at_ms: int) -> None:
        """An accepted announcement: keep its inline manifests, fetch the others by digest."""
        a = decision.announcement
        assert a is not None
        self._heard(decision, at_ms)
        if self.cfg.role == "bootstrap":
            return
        stored = []
        for m, raw in self.trusted.fresh_inline(decision):
            if not self.store.has_manifest(m.digest):
                self.store.put_manifest(m, raw)
                stored.append(m.digest)
        if stored:
            self.new_info.set()
            self._spawn(self.announce(stored, exclude=set(a.sources)))
        inline = {m.digest for m, _ in decision.manifests}
        missing = [d for d in a.digests if d not in inline and not self.store.has_manifest(d)]
        if missing:  # too big to ride inline: fetch by digest, from the sender or a source
            banned = self.directory.banned
            peers = [p for p in dict.fromkeys([sender, *a.sources]) if p and p not in banned]
            self._spawn(self._learn_any(peers, missing))

    async def _learn_any(self, peers: list[str], digests: list[str]) -> None:
        """The forwarder may not hold the manifests yet (it judged, then forwarded at once):
        fall back to the announced sources."""
        for peer in peers:
            digests = [d for d in digests if not self.store.has_manifest(d)]
            if not digests:
                return
            await self.learn(peer, digests)

    def _on_p2p_peer(self, url: str) -> None:
        """A data-plane URL from a signed peer record: add it, and ask it for its head now."""
        if len(self._p2p_urls) < 4 * self.cfg.directory.max_peers:
            self._p2p_urls.add(url)
        known = url in self.peers
        self.add_peer(url)
        if not known and url in self.peers and self.cfg.role != "bootstrap":
            self._spawn(self._ask_head(url))

    async def _ask_head(self, peer: str) -> None:
        assert self.client is not None
        (index,) = await gather_quietly([self.client.get_json(f"{peer}/manifests")])
        fresh = self.trusted.wanted(index, self.store.has_manifest)
        if fresh:
            await self.learn(peer, fresh)

    async def _poll_loop(self) -> None:
        """Pull fallback: every poll interval, ask some peers for their manifests and peers."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.cfg.directory.poll_interval_s)

    async def poll_once(self) -> None:
        assert self.client is not None
        peers = self.directory.poll_targets(_SAMPLER)
        indexes = await gather_quietly([self.client.get_json(f"{p}/manifests") for p in peers])
        lists = await gather_quietly([self.client.get_json(f"{p}/peers") for p in peers])
        for peer, index, plist in zip(peers, indexes, lists):
            if index is None:
                self._peer_event(PeerFailed(peer))
                continue
            self._peer_event(PeerAnswered(peer))  # answered: reset its failure count
            for url in (plist or {}).get("peers", [])[: self.cfg.directory.max_peers]:
                if isinstance(url, str):
                    self.add_peer(url)
            fresh = self.trusted.wanted(index, self.store.has_manifest)
            if fresh:
                await self.learn(peer, fresh)

    # ------------------------------------------------------------ NodeView (data plane)

    def manifest_index(self) -> list[dict[str, Any]]:
        return [
            {
                "digest": m.digest,
                "version": m.version,
                "kind": m.kind,
                "base_version": m.base_version,
                "payload_size": m.payload_size,
            }
            for m in self.store.manifests()
        ]

    def manifest_bytes(self, digest: str) -> bytes | None:
        return self.store.manifest_bytes(digest)

    def manifest(self, digest: str) -> Manifest | None:
        return self.store.manifest(digest)

    def evict(self) -> None:
        """Keep the chunk packs within the store's budget (after each new version)."""
        dropped = self.store.evict()
        if dropped:
            log.info("evicted %d old artifacts to stay within the store budget", len(dropped))

    def notify_have(self) -> None:
        """A have-map changed: wake the long polls of ``GET /have?known=N``."""
        news, self._have_news = self._have_news, asyncio.Event()
        news.set()

    async def have_changed(self, timeout: float) -> None:
        news = self._have_news
        try:
            async with asyncio.timeout(timeout):
                await news.wait()
        except TimeoutError:
            pass

    def have(self, digest: str, requester: str | None) -> list[int] | None:
        m = self.manifest(digest)
        if m is None:
            return None
        return self.store.have_indices(m)

    def chunk(self, sha256: str) -> bytes | None:
        return self.store.get_chunk(sha256)

    def peer_urls(self) -> list[str]:
        return sorted(self.usable_peers())

    def count_upload(self, nbytes: int) -> None:
        self.bytes_uploaded += nbytes
        self.metrics.uploaded.inc(nbytes)

    def count_download(self, nbytes: int) -> None:
        self.bytes_downloaded += nbytes
        self.metrics.downloaded.inc(nbytes)

    def status(self) -> dict[str, Any]:
        state = self.store.state
        return {
            "role": self.cfg.role,
            "url": self.url,
            "swarm": self.policy.swarm_id,
            "version": state.version if state else None,
            "state_hash": state.state_hash if state else None,
            "peers": self.peer_urls(),
            "banned": sorted(self.directory.banned),
            "bytes_uploaded": self.bytes_uploaded,
            "bytes_downloaded": self.bytes_downloaded,
            "manifests": self.store.manifest_count(),
            "multiaddr": self.multiaddr,
            "p2p": self.p2p.status() if self.p2p is not None else None,
            "announce_latency_ms": {str(v): ms for v, ms in self.announce_latency_ms.items()},
            "last_publish": self.last_publish,
            "last_update": self.last_update,
        }

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics.registry)

    def set_version(self, version: int) -> None:
        self.metrics.version.set(version)
