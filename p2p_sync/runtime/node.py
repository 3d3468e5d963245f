"""A running node: store, trust gate, peers, data plane and client, libp2p, metrics.

Trainer and rollout share this; each adds its own loop (``trainer.Publisher``,
``rollout.Follower``). The parts, one concern each: ``Peering`` (the sans-I/O peer directory
and what its actions do), ``Learner`` (manifests in and out: announcements, gossip, polls),
``DataView`` (what the HTTP data plane serves), ``Metrics``. Peers are learned from
``--peers``, from what proves a peer (a dial-back, a signed libp2p record, chunks it fetched
from us: ``p2p_sync.protocol.peers``) and from trusted peers' ``/peers`` lists (peer exchange), so
one
shared list bootstraps everyone. New versions spread by push (``POST /announce``, relayed once
by every node that accepts the manifest) with a periodic pull of ``/manifests`` as the
fallback for anything missed.

The wire is the node's ``transport`` (``p2p_sync.runtime.transports``): sockets (aiohttp, libp2p)
by default,
or an in-memory network that puts many nodes in one process for tests; the node's parts answer
and judge the same way on either.

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
from typing import Any

from p2p_sync.protocol.peers import P2P, PeerDirectory, PeerEntry, Source
from p2p_sync.protocol.reachability import Verdict
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.dataview import DataView
from p2p_sync.runtime.learning import Learner
from p2p_sync.runtime.metrics import Metrics
from p2p_sync.runtime.peering import Peering
from p2p_sync.runtime.reachability import ReachabilityCheck
from p2p_sync.runtime.timeline import Timeline
from p2p_sync.runtime.transports import HttpTransport, MemoryTransport
from p2p_sync.store import AcceptedState, Store
from p2p_sync.transport.client import PeerClient
from p2p_sync.transport.frames import peer_url
from p2p_sync.transport.reverse import ReverseLinks
from p2p_sync.transport.streams import RoutedClient
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.trust.trusted import TrustedSet

log = logging.getLogger("p2psync.node")
Transport = HttpTransport | MemoryTransport


def warm_codec() -> None:
    """Diff, code and apply a small patch of each common float dtype, sparse and dense, so the
    compiled scans of the codec and the state hash (numba, cached on disk) are ready before
    the first version arrives: compiling them costs seconds of CPU per process, loading them
    from the cache a few tenths, which would otherwise land on the first version.

    Why 16,384 normal values and both patterns: numba compiles per argument types, and the
    codec takes other paths (and array types) for dense frames, long gaps and wide exponent
    spreads. Warmed with 4,096 evenly spaced values changed every 7th, a fresh node's first
    real patch still compiled four scans (bf16, format 2, every element changed), two (format
    1, 3% changed) or two (float32, format 2, dense): 1.7 s on its first apply against 0.13
    s on the next, and in the emulated swarm (7 rollouts on 2 cores, a fresh cache) the
    median rollout's first apply took 7 s. Now nothing compiles then (bf16, fp16 and fp32,
    sparse and dense, both formats: checked with numba's compile events); warming takes
    0.38 s from the cache (0.35 s before), ~6 s cold (3.4 s)."""
    import torch

    from p2p_sync import codec
    from p2p_sync.store.restore import apply_frames
    from p2p_sync.weights.patch import diff
    from p2p_sync.weights.statehash import StateDigest

    values = torch.randn(16384, generator=torch.Generator().manual_seed(0))  # real spreads
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        base = {"w": values.to(dtype)}
        sparse = base["w"].clone()
        sparse[::7] = -sparse[::7]
        dense = (base["w"].float() * 1.01 + 0.001).to(dtype)
        for new in (sparse, dense):
            step = diff(base, {"w": new})
            for data in (codec.encode(step, base=base), codec.encode(step)):  # formats 2, 1
                weights = {"w": base["w"].clone()}  # applied as a rollout does, sums tracked
                apply_frames(
                    weights, memoryview(data), codec.read_header(data), StateDigest.of(weights)
                )


class Node:
    """Shared machinery of trainer and rollout nodes."""

    view_class: type[DataView] = DataView  # the trainer's super-seeds
    # What /status reports as the node's version: the store's head, or for a rollout the last
    # version handed off (logged *and* exported: the log comes first, rollout.py)
    reports_hand_off: bool = False
    handed_off: AcceptedState | None = None

    @classmethod
    def settle(cls, cfg: NodeConfig) -> NodeConfig:
        """The settings this kind of node runs with (a trainer's upload slots: ``TrainerNode``)."""
        return cfg

    def __init__(
        self,
        cfg: NodeConfig,
        policy: SwarmPolicy,
        store: Store,
        transport: Transport | None = None,
    ) -> None:
        """``transport``: sockets by default; ``MemoryTransport`` puts the node on an
        in-memory network (tests with many nodes in one process)."""
        self.cfg, self.policy, self.store = self.settle(cfg), policy, store
        self.transport: Transport = transport or HttpTransport()
        self.metrics = Metrics()
        self.timeline = Timeline()  # when each step of a version happened here
        directory = PeerDirectory(cfg.directory, given=frozenset(cfg.peers))  # normalised
        self.peering = Peering(directory, self.metrics)
        self.trusted = TrustedSet(
            policy,
            lambda: self.accepted_version,
            cfg.trust_limits,
            self._accepted_layout,
            store.state_at,
        )
        self.url: str | None = None  # its HTTP data plane (its name among peers: peer_url)
        self.client: PeerClient | None = None
        self.signer: SigningKey | None = None  # set on the trainer: signs gossip announcements
        self.p2p: Any = None  # transport.p2p.P2PHost once libp2p is up
        self.links: ReverseLinks | None = None  # behind NAT: channels to public peers
        self.multiaddr: str | None = None
        self.last_publish: dict[str, Any] | None = None  # trainer: timings of the last version
        self.last_update: dict[str, Any] | None = None  # rollout: timings of the last hand-off
        self.learner = Learner(self)
        self.reach = ReachabilityCheck(self)
        self.view = self.view_class(self)
        self._check_store()

    def _check_store(self) -> None:
        """What the store holds passes the same gate as news (a key no longer trusted, a
        manifest past its lifetime): refused ones are dropped."""
        self.metrics.version.set(self.accepted_version if self.store.state else -1)
        for digest, why in self.store.drop_refused(self.trusted.admit_stored):
            log.warning("dropped stored manifest %s: %s", digest[:16], why)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        self.url = await self.transport.serve(self)
        self.client = self.transport.client(self)
        self.peering.directory.me = {self.url}
        for peer in self.cfg.peers:
            self.add_peer(peer, Source.GIVEN)
        if self.cfg.p2p:
            await self._start_p2p()
        self.renamed()
        await self.reach.first_round()
        self.reach.start()
        if self.cfg.role != "bootstrap":  # a bootstrap holds no weights: nothing to poll for
            await asyncio.to_thread(warm_codec)
            self.learner.start_polling()
        # Everything alive now (torch, libp2p, aiohttp, the weights' tensors) lives as long as
        # the node: move it out of the collector's sight. Full collections otherwise walk those
        # millions of objects again and again while chunks stream in (measured: 8 loopback
        # rollouts fetch 100 MB in 3.3 s instead of 4.0 s).
        gc.freeze()
        return self.url

    async def _start_p2p(self) -> None:
        """libp2p is an addition: if it cannot start, the node carries on from --peers."""
        self.p2p = await self.transport.gossip(self)
        self.multiaddr = self.p2p.addr if self.p2p is not None else None

    async def stop(self) -> None:
        await self.reach.stop()
        if self.links is not None:
            await self.links.close()
        if self.p2p is not None:
            await self.p2p.stop()
        await self.learner.stop()
        if self.client is not None:
            await self.client.close()
        await self.transport.stop()
        self.store.close()  # the data dir's lock: another node may use it now

    # ------------------------------------------------------------ peers and state

    @property
    def peer_url(self) -> str | None:
        """How this node names itself to peers (``p2p_sync.runtime.reachability``): its HTTP URL
        once
        someone could dial it; ``p2p://<peer id>`` when nobody could and libp2p streams carry
        its data plane; nothing while nobody has answered yet. Without streams (no libp2p,
        the in-memory network) it has no other name: its HTTP URL, unless behind NAT."""
        verdict, streams = self.reach.state.verdict, self.streams
        if verdict is Verdict.REACHABLE:
            return self.url
        if streams:
            return peer_url(self.p2p.peer_id) if verdict is Verdict.BEHIND_NAT else None
        return None if verdict is Verdict.BEHIND_NAT else self.url

    def _lan_status(self) -> dict[str, Any] | None:
        """LAN shortcuts to ``p2p://`` peers (``transport.lan``); None without libp2p."""
        client = self.client
        lan = client.lan if isinstance(client, RoutedClient) else None
        return lan.status() if lan is not None else None

    @property
    def streams(self) -> bool:
        """Does libp2p carry this node's data plane too (``p2p://`` peers, serving behind
        NAT)? Not without libp2p, nor on the in-memory network."""
        return isinstance(self.client, RoutedClient)

    def renamed(self) -> None:
        """The reachability verdict changed: name the node accordingly everywhere."""
        name = self.peer_url
        if self.client is not None:
            self.client.self_url = name
        self.peering.directory.me = {u for u in (self.url, name) if u}
        if self.p2p is not None:
            behind_nat = self.reach.state.verdict is Verdict.BEHIND_NAT
            self.p2p.advertise(self.url if name == self.url else None, behind_nat)
        self._relink()
        log.info("reachability: %s", self.reach.describe())

    def _relink(self) -> None:
        """Behind NAT: reverse channels to the public peers known (up to the bound), which
        then fetch from this node over them; reachable: none (peers dial it)."""
        if self.links is None:
            return
        if self.reach.state.verdict is not Verdict.BEHIND_NAT:
            self.links.drop_all()
            return
        for url in self.peering.usable():
            self.links.offer(url)

    @property
    def peers(self) -> dict[str, PeerEntry]:
        return self.peering.known

    def add_peer(
        self, url: str, source: Source = Source.HEARSAY, address: str | None = None
    ) -> None:
        """Someone named a peer, with what it proved (``p2p_sync.protocol.peers.Source``;
        ``address``:
        where the naming request came from)."""
        name = self.peering.add(url, source, address)
        if name is None:  # refused, banned or ourselves
            return
        self.reach.peers_changed()
        if self.links is not None and self.reach.state.verdict is Verdict.BEHIND_NAT:
            self.links.offer(name)

    def ban(self, url: str, reason: str) -> None:
        self.peering.ban(url, reason)

    def linked(self, url: str) -> bool:
        """Does ``url`` (``p2p://<peer id>``) name a peer connected to this node over libp2p
        now (its key proved in the connection's handshake)?"""
        linked = getattr(self.p2p, "connected_ids", None) or ()  # none in memory, or off
        return url.removeprefix(P2P) in linked

    @property
    def accepted_version(self) -> int | None:
        state = self.store.state
        return state.version if state else None

    def _accepted_layout(self) -> str | None:
        """The layout of the weights held, when the artifact that made them is known."""
        state = self.store.state
        m = self.store.manifest(state.manifest) if state and state.manifest else None
        return m.layout if m else None

    def evict(self) -> None:
        """Keep the chunk packs within the store's budget (after each new version)."""
        dropped = self.store.evict()
        if dropped:
            log.info("evicted %d old artifacts to stay within the store budget", len(dropped))

    def status(self) -> dict[str, Any]:
        state = self.handed_off if self.reports_hand_off else self.store.state
        p2p = self.p2p.status() if self.p2p is not None else None
        latency = self.learner.announce_latency_ms
        return {
            "role": self.cfg.role,
            "url": self.url,
            "swarm": self.policy.swarm_id,
            "version": state.version if state else None,
            "state_hash": state.state_hash if state else None,
            "peers": sorted(self.peering.usable()),
            "given_peers": self.peering.status(),  # up / down, failures, next retry
            "banned": sorted(self.peering.banned),
            "bans": list(self.peering.bans.values()),
            "bytes_uploaded": self.metrics.bytes_uploaded,
            "bytes_downloaded": self.metrics.bytes_downloaded,
            "bytes_downloaded_from": self.metrics.downloaded_from,
            "manifests": self.store.manifest_count(),
            "multiaddr": self.multiaddr,
            "p2p": p2p,
            "announce_latency_ms": {str(v): ms for v, ms in latency.items()},
            "last_publish": self.last_publish,
            "last_update": self.last_update,
            "reachability": self.reach.status(),
            "reverse": self.transport.reverse_status(self),
            "tcp": self.transport.tcp_status(),
            "lan": self._lan_status(),
            "forwarded": self.learner.forwarder.status(),
        }
