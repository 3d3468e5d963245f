"""A running node: store, trust gate, peers, data plane and client, libp2p, metrics.

Trainer and rollout share this; each adds its own loop (``trainer.Publisher``,
``rollout.Follower``). The node builds its parts, one concern each, and starts and stops
them: ``Peering`` (the sans-I/O peer directory and what its actions do), ``Learner``
(manifests in and out: announcements, gossip, polls), ``ReachabilityCheck`` (how peers see
it), ``DataView`` (what the HTTP data plane serves), ``Metrics``. Each part names what it
uses of the node in ``runtime.ports``, so none of them imports this module.

Peers are learned from ``--peers``, from what proves a peer (a dial-back, a signed libp2p
record, chunks it fetched from us: ``p2p_sync.protocol.peers``) and from trusted peers'
``/peers`` lists (peer exchange), so one shared list bootstraps everyone. New versions spread
by push (``POST /announce``, relayed once by every node that accepts the manifest) with a
periodic pull of ``/manifests`` as the fallback for anything missed.

The wire is the node's ``transport`` (``runtime.transports``): sockets (aiohttp, libp2p) by
default, or an in-memory network that puts many nodes in one process for tests; the node's
parts answer and judge the same way on either. libp2p (on unless ``--no-p2p``) is an
addition, not a second code path: peers from signed records feed ``add_peer``, gossiped
announcements the same ``learn`` path; HTTP pushes then go only to peers gossip misses.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

from p2p_sync.protocol.peers import PeerDirectory, PeerEntry, Source
from p2p_sync.protocol.reachability import Verdict
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.dataview import DataView
from p2p_sync.runtime.learning import Learner
from p2p_sync.runtime.metrics import Metrics
from p2p_sync.runtime.peering import Peering
from p2p_sync.runtime.reachability import ReachabilityCheck
from p2p_sync.runtime.timeline import Timeline
from p2p_sync.runtime.transports import HttpTransport, MemoryTransport
from p2p_sync.runtime.warm import warm_codec
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


class Node:
    """Shared machinery of trainer and rollout nodes."""

    view_class: type[DataView] = DataView  # the trainer's super-seeds
    # What /status reports as the node's version: the store's head, or for a rollout the last
    # version handed off (logged *and* exported: the log comes first, rollout.py)
    reports_hand_off: bool = False
    handed_off: AcceptedState | None = None

    def __init__(
        self,
        cfg: NodeConfig,
        policy: SwarmPolicy,
        store: Store,
        transport: Transport | None = None,
    ) -> None:
        """``transport``: sockets by default; ``MemoryTransport`` puts the node on an
        in-memory network (tests with many nodes in one process)."""
        self.cfg, self.policy, self.store = cfg, policy, store
        self.transport: Transport = transport or HttpTransport()
        self.metrics = Metrics()
        self.timeline = Timeline()  # when each step of a version happened here
        directory = PeerDirectory(cfg.directory, given=frozenset(cfg.peers))  # normalised
        self.peering = Peering(directory, self.metrics)
        layout = functools.partial(accepted_layout, store)
        version = lambda: self.accepted_version  # noqa: E731 (read when asked)
        self.trusted = TrustedSet(policy, version, cfg.trust_limits, layout, store.state_at)
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
        drop_refused(self)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        self.url = await self.transport.serve(self)
        self.client = self.transport.client(self)
        self.peering.directory.me = {self.url}
        for peer in self.cfg.peers:
            self.add_peer(peer, Source.GIVEN)
        if self.cfg.p2p:  # an addition: if it cannot start, the node carries on from --peers
            self.p2p = await self.transport.gossip(self)
            self.multiaddr = self.p2p.addr if self.p2p is not None else None
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
        """How this node names itself to peers (``runtime.reachability``): its HTTP URL once
        someone could dial it; ``p2p://<peer id>`` when nobody could and libp2p streams carry
        its data plane; nothing while nobody has answered yet. Without streams (no libp2p,
        the in-memory network) it has no other name: its HTTP URL, unless behind NAT."""
        verdict, streams = self.reach.state.verdict, self.streams
        if verdict is Verdict.REACHABLE:
            return self.url
        if streams:
            return peer_url(self.p2p.peer_id) if verdict is Verdict.BEHIND_NAT else None
        return None if verdict is Verdict.BEHIND_NAT else self.url

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
        relink(self.links, self.reach.state.verdict, self.peering.usable)
        log.info("reachability: %s", self.reach.describe())

    def add_peer(
        self, url: str, source: Source = Source.HEARSAY, address: str | None = None
    ) -> None:
        """Someone named a peer, with what it proved (``p2p_sync.protocol.peers.Source``;
        ``address``: where the naming request came from)."""
        name = self.peering.add(url, source, address)
        if name is None:  # refused, banned or ourselves
            return
        self.reach.peers_changed()
        if self.links is not None and self.reach.state.verdict is Verdict.BEHIND_NAT:
            self.links.offer(name)

    def ban(self, url: str, reason: str) -> None:
        self.peering.ban(url, reason)

    @property
    def peers(self) -> dict[str, PeerEntry]:
        return self.peering.known

    @property
    def accepted_version(self) -> int | None:
        state = self.store.state
        return state.version if state else None

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
            "lan": lan_status(self.client),
            "forwarded": self.learner.forwarder.status(),
        }


def drop_refused(node: Node) -> None:
    """What the store holds passes the same gate as news (a key no longer trusted, a manifest
    past its lifetime): refused ones are dropped."""
    node.metrics.version.set(node.accepted_version if node.store.state else -1)
    for digest, why in node.store.drop_refused(node.trusted.admit_stored):
        log.warning("dropped stored manifest %s: %s", digest[:16], why)


def accepted_layout(store: Store) -> str | None:
    """The layout of the weights held, when the artifact that made them is known."""
    state = store.state
    m = store.manifest(state.manifest) if state and state.manifest else None
    return m.layout if m else None


def relink(links: ReverseLinks | None, verdict: Verdict, usable: Callable[[], list[str]]) -> None:
    """Behind NAT: reverse channels to the public peers known (up to the bound), which then
    fetch from this node over them; reachable: none (peers dial it)."""
    if links is None:
        return
    if verdict is not Verdict.BEHIND_NAT:
        links.drop_all()
        return
    for url in usable():
        links.offer(url)


def lan_status(client: PeerClient | None) -> dict[str, Any] | None:
    """LAN shortcuts to ``p2p://`` peers (``transport.lan``); None without libp2p."""
    lan = client.lan if isinstance(client, RoutedClient) else None
    return lan.status() if lan is not None else None
