"""What the chunk scheduler knows of one peer's service: its delivery rate, round trip and
failures, and from them its score, how many chunks one request asks of it and how many
requests it keeps in flight (its bandwidth-delay product)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2p_sync.protocol.swarmconfig import SwarmConfig


@dataclass
class PeerStats:
    """What the scheduler knows of one peer's service."""

    throughput: float = 0.0  # EWMA of its delivery rate, bytes/s (``Scheduler._measure``)
    failures: int = 0
    verified: int = 0
    rtt: float | None = None  # smallest round trip seen (have-map answers, chunk replies)
    last_delivery: float = float("-inf")  # when its last chunk arrived

    def score(self) -> float:
        return (self.throughput + 1.0) / (1 + self.failures)

    def rtt_sample(self, rtt: float) -> None:
        self.rtt = rtt if self.rtt is None else min(self.rtt, rtt)

    def run(self, chunk_bytes: float, config: SwarmConfig) -> int:
        """Chunks to ask for in one request: what it delivers in ``request_s``, at most
        ``request_bytes`` (one until its rate is measured)."""
        most = int(config.request_bytes // chunk_bytes)
        if most <= 1 or not self.throughput:
            return 1
        return max(1, min(most, math.ceil(self.throughput * config.request_s / chunk_bytes)))

    def depth(self, chunk_bytes: float, config: SwarmConfig, run: int = 1) -> int:
        """Requests to keep in flight: its bandwidth-delay product in chunks, plus one run
        (``run`` chunks asked at once), so the next request is already there when a chunk
        leaves (one per source leaves the link idle for a round trip after every chunk, and
        the round trip sampled does not hold the uploader's own work per chunk; much more
        than the product only queues)."""
        want = config.initial_requests_per_peer + run - 1
        if self.rtt is not None and self.throughput:
            want = math.ceil(self.throughput * self.rtt / chunk_bytes) + run
        return min(config.max_requests_per_peer, max(config.min_requests_per_peer, want))
