"""The node's face of the sans-I/O peer directory: events in, and its actions carried out
(ban logs, metrics). The directory decides; this only executes."""

from __future__ import annotations

import logging

from node.metrics import Metrics
from p2p_sync.peers import (
    PeerAction,
    PeerBanned,
    PeerDirectory,
    PeerEntry,
    PeerEvent,
    PeerMisbehaved,
    PeerNamed,
    PeerServedVerified,
    Source,
)

log = logging.getLogger("p2psync.node")


class Peering:
    """Who a node knows, trusts and bans."""

    def __init__(self, directory: PeerDirectory, metrics: Metrics) -> None:
        self.directory, self.metrics = directory, metrics

    @property
    def known(self) -> dict[str, PeerEntry]:
        return self.directory.known

    @property
    def banned(self) -> set[str]:
        return self.directory.banned

    def handle(self, event: PeerEvent) -> None:
        """Feed the directory; carry out what it says. Runs on every request that names its
        sender, so a known peer costs a dict lookup, no more."""
        actions: list[PeerAction] = self.directory.handle(event)
        for a in actions:
            if isinstance(a, PeerBanned):
                log.warning("banned %s: %s", a.url, a.reason)
                self.metrics.bans.inc()
        if actions:
            self.metrics.peers.set(len(self.directory))

    def add(self, url: str, source: Source = Source.HEARSAY) -> None:
        """Someone named a peer (unproven unless the operator gave it)."""
        self.handle(PeerNamed(url, source))

    def ban(self, url: str, reason: str) -> None:
        self.handle(PeerMisbehaved(url, reason))

    def served(self, url: str) -> None:
        """``url`` served a chunk that verified against its signed manifest: a proven peer."""
        self.handle(PeerServedVerified(url))

    def usable(self) -> list[str]:
        return self.directory.usable()
