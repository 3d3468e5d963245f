"""How a node meets the wire: real sockets (:class:`HttpTransport`: aiohttp data plane, libp2p
gossip) or the in-memory network of tests (:class:`MemoryTransport`, N nodes in one process).

Either way the node's own parts answer and judge: the data plane's router
(``transport.dataplane``) and the gossip validator (``transport.gossip``); a transport only
carries bytes, so a control-plane test in memory checks what a real node does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

from p2p_sync.errors import ConfigError
from p2p_sync.runtime.ports import WireHost
from p2p_sync.transport.client import PeerClient
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.http import DataClient, DataServer
from p2p_sync.transport.lan import LanShortcuts
from p2p_sync.transport.memory import MemoryClient, MemoryGossipHost, MemoryNetwork
from p2p_sync.transport.reverse import ReverseClient, ReverseHub, ReverseLinks
from p2p_sync.transport.streams import RoutedClient, StreamClient, direct_address
from p2p_sync.transport.tls import PrivateSwarmFiles, SwarmTls, identity_key
from p2p_sync.trust import announce

log = logging.getLogger("p2psync.node")


class HttpTransport:
    """Sockets: the aiohttp server and client, and a libp2p host when ``p2p`` is on."""

    def __init__(self) -> None:
        self.server: DataServer | None = None
        self.tls: SwarmTls | None = None  # a private swarm's (``transport.tls``)

    async def serve(self, node: WireHost) -> str:
        """Listen on the node's address; returns its advertised URL."""
        host, port = node.cfg.host_port
        self.tls = private_tls(node)
        self.server = DataServer(node.view, node.cfg.http, self.tls)
        bound = await self.server.start(host, port)
        return f"http://{node.cfg.advertise_host or host}:{bound}"

    def client(self, node: WireHost) -> PeerClient:
        return DataClient(node.url, node.cfg.http, self.tls)

    async def gossip(self, node: WireHost) -> Any:
        """A started libp2p host (its record names no HTTP URL until a peer could dial it);
        libp2p is an addition: if it cannot start, the node carries on from --peers (None).
        A private swarm's host admits members only (``transport.p2p_gate``)."""
        try:
            host = await _start_p2p(node, self.tls)
        except Exception as exc:  # any failure (import, identity file, bind): HTTP only
            log.warning("libp2p unavailable, using --peers only: %s", exc)
            return None
        self._serve_streams(node, host)
        return host

    def _serve_streams(self, node: WireHost, host: Any) -> None:
        """The data plane over libp2p streams and reverse channels too: the same router
        answers (one set of upload slots); ``p2p://`` peers are asked over their LAN shortcut
        (``transport.lan``), else the channel they opened here, else over streams. Behind NAT
        the node opens channels to public peers (``node.links``); a rollout takes channels
        from NATed peers (a trainer or bootstrap fetches nothing, so it has no use for them)."""
        assert self.server is not None and node.client is not None and node.url is not None
        router, limits = self.server.router, node.cfg.reachability
        host.serve_data(router)
        router.identity = {"peer": host.peer_id, "port": urlsplit(node.url).port}
        streams = StreamClient(host, node.client.self_url, node.cfg.http)
        reverse = None
        if node.cfg.role == "rollout":
            hub = ReverseHub(node.cfg.http, limits.max_channels, lambda: node.url, node.add_peer)
            self.server.reverse, reverse = hub, ReverseClient(hub, node.client.self_url)
        lan = None
        if limits.lan:
            lan = LanShortcuts(node.client, streams, lambda p: host.call(direct_address, host, p))
        node.client = RoutedClient(node.client, streams, reverse, lan)
        node.links = ReverseLinks(router, host.key_pair, host.peer_id, limits.links, self.tls)

    def reverse_status(self, node: WireHost) -> dict[str, Any] | None:
        """Reverse channels (``transport.reverse``): the ones this node opened behind NAT and
        the ones NATed peers opened to it; None without libp2p."""
        if node.links is None or self.server is None:
            return None
        hub = self.server.reverse  # None: this node takes no channels
        channels, accepted = (sorted(hub.channels), hub.accepted) if hub else ([], 0)
        return node.links.status() | {"channels": channels, "accepted": accepted}

    def revocations(self) -> dict[str, str]:
        """What a private node's announcements carry: the revocation list it holds, its file
        looked at first (the admin revokes into it); nothing in an open swarm."""
        if self.tls is None:
            return {}
        self.tls.refresh(time.time())
        return {"revocations": self.tls.membership.crl_pem.decode()}

    def adopt_revocations(self, pem: bytes) -> bool:
        """A revocation list an announcement carried: adopted if newer and signed by the
        admin (``SwarmTls.adopt``); an open swarm's node has none to keep."""
        return self.tls is not None and self.tls.adopt(pem, time.time())

    def uploads_busy(self) -> int:
        """Chunk uploads in progress now (``p2p_sync.runtime.forwarding`` pushes only beside
        few)."""
        return 0 if self.server is None else self.server.router.uploads_busy

    def tcp_status(self) -> dict[str, Any] | None:
        """The data plane's congestion control and whether idle connections restart in slow
        start (``transport.tcp``)."""
        return self.server.tcp if self.server is not None else None

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()


async def _start_p2p(node: WireHost, tls: SwarmTls | None) -> Any:
    """The node's libp2p host, started: gossip, discovery and its streams (a private
    swarm's: with the membership gate, from the node's TLS credentials)."""
    from p2p_sync.transport import identity, multiaddrs, p2p, p2p_gate  # --no-p2p: never loaded

    cfg, learner = node.cfg, node.learner
    settings = p2p.P2PSettings(
        listen=cfg.p2p_listen or multiaddrs.default_listen(cfg.host_port[0]),
        advertise_host=cfg.advertise_host,
        identity_path=cfg.data_dir / identity.IDENTITY_FILE,
        topic=announce.topic(node.policy.swarm_id),
        bootstrap=cfg.bootstrap,
        relay=cfg.relay,
        **asdict(cfg.libp2p),
    )
    host = p2p.P2PHost(
        settings,
        learner.judge,
        learner.on_gossip,
        learner.on_p2p_peer,
        node.store.has_manifest,
        learner.heard,
        None
        if tls is None
        else p2p_gate.MemberCredentials(tls.membership, tls.admission, tls.refresh),
    )
    await host.start()
    return host


def private_tls(node: WireHost) -> SwarmTls | None:
    """A private node's TLS, from its membership files and its libp2p identity key (the
    key its admission binds); None for an open swarm's node."""
    cfg = node.cfg
    if not cfg.private:
        return None
    assert cfg.swarm_ca and cfg.admission and cfg.revocations  # config.check saw to it
    from p2p_sync.transport.identity import IDENTITY_FILE

    files = PrivateSwarmFiles(cfg.swarm_ca, cfg.admission, cfg.revocations)
    key = identity_key(cfg.data_dir / IDENTITY_FILE)
    tls = SwarmTls.load(files, key, time.time(), cfg.membership)
    if tls.membership.swarm_id != node.policy.swarm_id:
        raise ConfigError(
            f"config: swarm_ca: {files.ca} is the CA of swarm"
            f" {tls.membership.swarm_id[:16]}, not of this node's swarm"
            f" {node.policy.swarm_id[:16]} (same --swarm and --trust as p2psync swarm init?)"
        )
    return tls


class MemoryTransport:
    """One node's attachment to a :class:`MemoryNetwork` under ``name``."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.network, self.name = network, name
        self.url: str | None = None
        self.router: DataRouter | None = None

    async def serve(self, node: WireHost) -> str:
        self.router = DataRouter(node.view, node.cfg.http)
        self.url = self.network.listen(self.router, self.name)
        return self.url

    def client(self, node: WireHost) -> PeerClient:
        return MemoryClient(self.network, node.url, node.cfg.http)

    async def gossip(self, node: WireHost) -> MemoryGossipHost:
        assert node.url is not None
        learner, limits = node.learner, node.cfg.libp2p
        host = MemoryGossipHost(
            self.network,
            node.url,
            learner.judge,
            learner.on_gossip,
            learner.on_p2p_peer,
            node.store.has_manifest,
            learner.heard,
            limits.max_rejects,
        )
        await host.start()
        return host

    def uploads_busy(self) -> int:
        return 0 if self.router is None else self.router.uploads_busy

    def revocations(self) -> dict[str, str]:
        return {}  # the in-memory network runs open swarms only

    def adopt_revocations(self, pem: bytes) -> bool:
        return False

    def tcp_status(self) -> None:
        return None  # no sockets

    def reverse_status(self, node: WireHost) -> None:
        return None  # the in-memory network has no NAT

    async def stop(self) -> None:
        if self.url is not None:
            self.network.close(self.url)
