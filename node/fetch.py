"""Download one payload into a node's store: the node's side of ``p2p_sync.transport.download``.

The driver, the scheduler and chunk verification live in the library; here the node supplies
its HTTP client as the chunk source, its store as the sink, and learns from every download who
served verified bytes (proven peers) and who served bad ones (banned).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from node.runtime import Node
from p2p_sync.manifest import Manifest
from p2p_sync.swarm import SwarmConfig
from p2p_sync.transport.download import DataPlaneSource, download


class _Listener:
    """Carries a download's news into the node: proof, bans, counters, progress."""

    def __init__(self, node: Node, on_chunk: Callable[[int], None] | None) -> None:
        self.node, self.on_chunk = node, on_chunk

    def served(self, peer: str, nbytes: int) -> None:
        self.node.peering.served(peer)
        self.node.view.notify_have()
        self.node.metrics.count_download(nbytes)
        if self.on_chunk is not None:
            self.on_chunk(nbytes)

    def misbehaved(self, peer: str, reason: str) -> None:
        self.node.ban(peer, reason)


def swarm_config(node: Node) -> SwarmConfig:
    """The node's scheduler settings with a fresh tie-break seed: peers start on different
    chunks, so they have something to trade from the first second."""
    return replace(node.cfg.download, seed=random.getrandbits(31))


async def fetch_payload(
    node: Node,
    manifest: Manifest,
    config: SwarmConfig | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Fetch ``manifest``'s payload from the swarm into the node's store, verified."""
    assert node.client is not None
    source = DataPlaneSource(node.client, node.peering.usable)
    config = config or swarm_config(node)
    await download(manifest, source, node.store, _Listener(node, on_chunk), config)
