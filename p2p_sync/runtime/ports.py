"""What each part of a node uses of the others, as small Protocols.

A node (``runtime.node.Node``) builds its parts and hands each its host; a part names only
what it reads or calls there, here, so it imports none of the other parts and none of them
imports the node: the modules of ``p2p_sync.runtime`` import each other in no circle (the
import contracts of pyproject.toml check it). The node satisfies every host below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from p2p_sync.protocol.peers import Source
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.early import EarlyFeeds
from p2p_sync.runtime.metrics import Metrics
from p2p_sync.runtime.peering import Peering
from p2p_sync.runtime.pushed import PushedChunks
from p2p_sync.runtime.timeline import Timeline
from p2p_sync.store import Store
from p2p_sync.store.restore import FrameSink
from p2p_sync.transport.announcement import Pushed
from p2p_sync.transport.client import PeerClient
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import Manifest, SwarmPolicy
from p2p_sync.trust.trusted import TrustedSet


class Naming(Protocol):
    """How the node names itself and who it knows: what every part may ask."""

    cfg: NodeConfig
    url: str | None
    client: PeerClient | None
    peering: Peering

    def add_peer(self, url: str, source: Source = ..., address: str | None = None) -> None: ...


class Announced(Protocol):
    """The learner, as the data plane and the transports hand it news."""

    def on_announce(self, url: str | None, digests: list[str], pushed: Pushed) -> None: ...

    def on_pushed(self, url: str, digest: str, index: int, data: bytes) -> None: ...


class DialBack(Protocol):
    """The reachability check, as the data plane answers a peer's dial-back question."""

    def issued(self, nonce: str) -> bool: ...

    async def dial_back(
        self, url: str, nonce: str, remote: str | None, outbound: bool = False
    ) -> dict[str, Any]: ...


class Served(Protocol):
    """What the data plane serves, as the learner and the forwarder tell it news."""

    def notify_have(self) -> None: ...

    def withdraw(self, peer: str) -> None: ...

    def followers(self) -> set[str]: ...

    def count_upload(self, nbytes: int) -> None: ...

    def behind_budget(self) -> float: ...

    def pushing(self, digest: str, peer: str, index: int, on: bool = True) -> None: ...

    def following(self, digest: str) -> list[str]: ...

    def offer(self, digest: str, peer: str) -> list[int] | None: ...

    def pushable(
        self, digest: str, peer: str, count: int, budget: int
    ) -> list[tuple[int, bytes]]: ...


class Uploads(Protocol):
    """The wire, as the forwarder asks how busy the uplink is."""

    def uploads_busy(self) -> int: ...


class ReachHost(Naming, Protocol):
    """The reachability check's host: it dials, names the node and renames it."""

    p2p: Any

    @property
    def peer_url(self) -> str | None: ...

    @property
    def streams(self) -> bool: ...

    def renamed(self) -> None: ...


class ViewHost(Naming, Protocol):
    """The data plane's host: the store it serves, the news it hands on."""

    store: Store
    metrics: Metrics
    learner: Announced
    reach: DialBack
    p2p: Any

    def status(self) -> dict[str, Any]: ...


class ForwardHost(Naming, Protocol):
    """The forwarder's host: it passes announcements on, with chunks when the uplink has room."""

    view: Served
    transport: Uploads


class LearnHost(Naming, Protocol):
    """The learner's host: the store and trust gate news passes, the peers it comes from."""

    store: Store
    policy: SwarmPolicy
    trusted: TrustedSet
    timeline: Timeline
    signer: SigningKey | None
    p2p: Any
    view: Served
    transport: Uploads

    @property
    def accepted_version(self) -> int | None: ...

    def ban(self, url: str, reason: str) -> None: ...


class Forwards(Protocol):
    """The forwarder, as a download hands it each verified chunk."""

    def forward(self, digest: str, index: int, data: bytes, source: str) -> None: ...


class Follows(Protocol):
    """The learner, as a download follows its news: offers and chunks pushed with
    announcements, feeds asked while the manifest came, and the order to ask peers in."""

    forwarder: Forwards
    pushed: PushedChunks
    early: EarlyFeeds
    seeds: Mapping[str, None]

    def take_offer(self, peer: str, digest: str) -> tuple[list[int] | None, list[int]]: ...

    def follow_order(self, digest: str) -> list[str]: ...


class EngineFeed(Protocol):
    """Where a rollout's applied versions go on to a tensor-parallel engine's ranks
    (``runtime.tp_engine.EngineQueue``)."""

    def collector(self) -> FrameSink: ...

    def took(self, m: Manifest, frames: Any) -> None: ...

    def lost(self) -> None: ...


class FetchHost(Naming, Protocol):
    """A download's host: the store it fills, the learner's news it follows (offers, pushed
    chunks, early feeds), where it notes progress, and who it bans."""

    store: Store
    timeline: Timeline
    metrics: Metrics
    view: Served
    learner: Follows

    @property
    def peer_url(self) -> str | None: ...

    def ban(self, url: str, reason: str) -> None: ...


class WireHost(Naming, Protocol):
    """The transports' host: what they serve, route and gossip for."""

    policy: SwarmPolicy
    store: Store
    view: Any  # served by the data plane (``transport.dataplane.NodeView``)
    learner: Any  # judges and takes gossip (``runtime.learning.Learner``)
    links: Any  # behind NAT: the reverse channels (``transport.reverse.ReverseLinks``)


__all__ = [
    "Announced",
    "DialBack",
    "FetchHost",
    "Follows",
    "Forwards",
    "ForwardHost",
    "LearnHost",
    "Naming",
    "ReachHost",
    "Served",
    "Uploads",
    "ViewHost",
    "WireHost",
]
