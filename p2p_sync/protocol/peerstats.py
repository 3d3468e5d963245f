"""What the chunk scheduler knows of one peer's service: its delivery rate, round trip and
failures, and from them its score, how many chunks one request asks of it and how many
requests it keeps in flight (its bandwidth-delay product)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Set
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

    def depth_run(self, chunk_bytes: float, config: SwarmConfig, runs: bool) -> tuple[int, int]:
        """``(depth, run)`` in one call: :meth:`run` (1 unless ``runs``), then :meth:`depth`
        with it; the same arithmetic (the scheduler asks after every delivery)."""
        throughput, run = self.throughput, 1
        if runs and throughput:
            most = int(config.request_bytes // chunk_bytes)
            if most > 1:
                run = max(1, min(most, math.ceil(throughput * config.request_s / chunk_bytes)))
        if self.rtt is not None and throughput:
            want = math.ceil(throughput * self.rtt / chunk_bytes) + run
        else:
            want = config.initial_requests_per_peer + run - 1
        return min(config.max_requests_per_peer, max(config.min_requests_per_peer, want)), run

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


class Depths:
    """Each peer's ``(depth, run)`` (:meth:`PeerStats.depth_run`) at the download's mean chunk
    size, kept until its stats or that size move. Both fall (or stay) as the size grows (each
    is a ceiling or a floor of a correctly rounded quotient by it), so a peer whose pair is
    the same at the smallest and the largest size seen keeps it at every size between
    (``steady``): a move of the mean within them (after a short last chunk, a fraction of a
    chunk at every delivery) recounts only the other peers."""

    __slots__ = ("config", "runs", "size", "low", "high", "pairs", "steady")

    def __init__(self, config: SwarmConfig, size: float, runs: bool) -> None:
        self.config, self.runs = config, runs
        self.size = self.low = self.high = size
        self.pairs: dict[str, tuple[int, int]] = {}
        self.steady: set[str] = set()  # the same pair at every size in [low, high]

    def of(self, peer: str, stats: PeerStats) -> tuple[int, int]:
        pair = self.pairs.get(peer)
        if pair is None:
            pair = self.pairs[peer] = stats.depth_run(self.size, self.config, self.runs)
        return pair

    def forget(self, peer: str) -> None:
        """``peer``'s stats moved."""
        self.pairs.pop(peer, None)
        self.steady.discard(peer)

    def resize(self, size: float, stats: dict[str, PeerStats]) -> list[str]:
        """The mean chunk size is now ``size``: the peers whose pair was taken anew."""
        self.size, config, runs = size, self.config, self.runs
        if not self.low <= size <= self.high:
            self.low, self.high = min(self.low, size), max(self.high, size)
            self.steady.clear()
        low, high, steady, pairs = self.low, self.high, self.steady, self.pairs
        taken = [p for p in stats if p not in steady]
        for peer in taken:
            s = stats[peer]
            pairs[peer] = s.depth_run(size, config, runs)
            if s.depth_run(low, config, runs) == s.depth_run(high, config, runs):
                steady.add(peer)
        return taken


def best(
    candidates: Set[str],
    stats: Mapping[str, PeerStats],
    load: Mapping[str, Collection[int]],
    owed: Set[str],
) -> str | None:
    """The peer to ask first: owed and never failing, then score per request in flight
    (``load``: each peer's), then the greatest name (a fixed order)."""
    if len(candidates) <= 1:
        return next(iter(candidates), None)
    return max(
        candidates,
        key=lambda p: (
            p in owed and not stats[p].failures,
            stats[p].score() / (1 + len(load.get(p, ()))),
            p,
        ),
    )
