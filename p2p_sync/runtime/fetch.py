"""Download one payload into a node's store: the node's side of ``p2p_sync.transport.download``.

The driver, the scheduler and chunk verification live in the library; here the node supplies
its HTTP client as the chunk source, its store as the sink, and learns from every download who
served verified bytes (proven peers) and who served bad ones (banned).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from p2p_sync.protocol import sourcing
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.runtime.ports import FetchHost
from p2p_sync.transport.download import DataPlaneSource, HaveCursor, Timed, download
from p2p_sync.transport.frames import SCHEME
from p2p_sync.trust.manifest import Manifest

A = TypeVar("A", bound=tuple[Any, ...])  # a have-map answer: its indices first


class _Listener:
    """Carries a download's news into the node: proof, bans, counters, progress."""

    def __init__(
        self, node: FetchHost, manifest: Manifest, on_chunk: Callable[[int], None] | None
    ) -> None:
        self.node, self.digest, self.on_chunk = node, manifest.digest, on_chunk

    def served(self, peer: str, nbytes: int) -> None:
        self.node.timeline.note(self.digest, "first_have")  # a pushed chunk offered itself
        self.node.timeline.note(self.digest, "first_chunk")
        self.node.peering.served(peer)
        self.node.view.notify_have()
        self.node.metrics.count_download(nbytes, peer)
        if self.on_chunk is not None:
            self.on_chunk(nbytes)

    def misbehaved(self, peer: str, reason: str) -> None:
        self.node.ban(peer, reason)

    def forward(self, index: int, data: bytes, source: str) -> None:
        self.node.learner.forwarder.forward(self.digest, index, data, source)


class _NodeSource(DataPlaneSource):
    """The node's chunk source: its usable peers in the order a download should follow them,
    noting when a have-map first offered a chunk."""

    def __init__(self, node: FetchHost, digest: str) -> None:
        assert node.client is not None
        super().__init__(node.client, node.peering.usable)
        self.timeline, self.known = node.timeline, node.peering.directory.known
        self.offer = node.learner.take_offer  # a have-map answer pushed with the announcement
        self.inbox = node.learner.pushed  # and the chunks sent behind it
        self.early_feeds = node.learner.early  # and the feeds asked while the manifest came
        self.seeds = node.learner.seeds  # peers whose announcements carried offers
        self._order = partial(node.learner.follow_order, digest)
        self.public = node.peer_url == node.url  # reachable (or no NAT to speak of)

    def peers(self) -> list[str]:
        """In the order ``p2p_sync.runtime.early.follow_order`` gives (trusted, then behind NAT,
        then
        this node's own order for this payload): the early feeds went to the first of them.
        The simulator orders its sources the same way."""
        return self._order()

    def usable(self, peer: str) -> bool:
        return peer in self.known  # what ``peering.usable`` lists

    def owed(self, peer: str) -> bool:
        """A public node follows every peer behind NAT it knows, beyond ``max_sources``
        (``protocol.sourcing.owed`` says why)."""
        return sourcing.owed(peer.startswith(SCHEME), self.public)

    def pushed(self, peer: str, m: Manifest) -> tuple[list[int] | None, list[int]]:
        have, pushing = self.offer(peer, m.digest)
        if have:
            self.timeline.note(m.digest, "first_have")
        return have, pushing

    def pushes(self, m: Manifest) -> AsyncIterator[tuple[str, int, bytes]]:
        return self.inbox.follow(m.digest)

    def seed(self, peer: str) -> bool:
        return peer in self.seeds

    def early(self, peer: str, m: Manifest) -> AsyncIterator[Timed] | None:
        feed = self.early_feeds.take(m.digest, peer)
        return None if feed is None else self._noted(m, feed)

    def have_feed(
        self, peer: str, m: Manifest, since: HaveCursor
    ) -> AsyncIterator[tuple[list[int], HaveCursor]]:
        return self._noted(m, super().have_feed(peer, m, since))

    async def _noted(self, m: Manifest, feed: AsyncIterator[A]) -> AsyncIterator[A]:
        """``feed``'s answers (each with the indices first), noting when one first offered
        a chunk."""
        async with aclosing(feed) as answers:
            async for answer in answers:
                if answer[0]:
                    self.timeline.note(m.digest, "first_have")
                yield answer


def swarm_config(node: FetchHost) -> SwarmConfig:
    """The node's scheduler settings with a fresh tie-break seed: peers start on different
    chunks, so they have something to trade from the first second."""
    return replace(node.cfg.download, seed=random.getrandbits(31))


async def fetch_payload(
    node: FetchHost,
    manifest: Manifest,
    config: SwarmConfig | None = None,
    on_chunk: Callable[[int], None] | None = None,
    unserved: Mapping[int, Collection[str]] | None = None,
) -> None:
    """Fetch ``manifest``'s payload from the swarm into the node's store, verified; the
    peers ``unserved`` names for a chunk do not count as its sources (they claimed it and did
    not serve it when an earlier download of it stalled)."""
    config = config or swarm_config(node)
    listener = _Listener(node, manifest, on_chunk)
    source = _NodeSource(node, manifest.digest)
    try:
        await download(manifest, source, node.store, listener, config, unserved)
    finally:
        node.learner.early.close(manifest.digest)  # the feeds it did not follow
    node.timeline.note(manifest.digest, "fetched")
