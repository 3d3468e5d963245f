"""Prometheus metrics and byte counters of one node (its own registry, so several nodes fit in
one process, as the tests run them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

SOURCES_KEPT = 64  # peers whose downloaded bytes are kept apart; the rest add up as "other"


class Metrics:
    """What a node counts: bytes each way (downloads also by source), its version, its peers,
    its bans."""

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
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.downloaded_from: dict[str, int] = {}  # verified bytes by the peer that served them

    def count_upload(self, nbytes: int) -> None:
        self.bytes_uploaded += nbytes
        self.uploaded.inc(nbytes)

    def count_download(self, nbytes: int, source: str | None = None) -> None:
        self.bytes_downloaded += nbytes
        self.downloaded.inc(nbytes)
        if source is not None:
            full = len(self.downloaded_from) >= SOURCES_KEPT
            key = "other" if full and source not in self.downloaded_from else source
            self.downloaded_from[key] = self.downloaded_from.get(key, 0) + nbytes

    def text(self) -> bytes:
        return generate_latest(self.registry)
