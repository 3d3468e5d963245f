"""The limits of one download (``[download]`` in a node's configuration; a simulation scenario
embeds the same table): the scheduler's (``protocol.swarm``) and its driver's
(``transport.download``). Apart from the scheduler so that configuration, the simulator's
scenarios and the node read them without the scheduler's state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwarmConfig:
    """Every limit of one download (``[download]`` in a node's config; a simulation scenario
    embeds the same table): the scheduler's, and its driver's (the last five)."""

    # Requests in flight per source follow its bandwidth-delay product (delivery rate x round
    # trip / chunk size, plus one), within these bounds; before the first measurement a source
    # gets ``initial_requests_per_peer``. All sources together: at most ``max_requests_total``.
    max_requests_per_peer: int = 32
    min_requests_per_peer: int = 1
    initial_requests_per_peer: int = 2
    max_requests_total: int = 256
    # One request asks a peer for what it delivers in ``request_s`` at its measured rate,
    # several chunks when it delivers one faster (a request costs ~0.7 ms of CPU at both
    # ends over HTTP; each chunk is still verified and relayed as soon as its bytes are in),
    # at most ``request_bytes`` (0: one chunk a request). A peer keeps its bandwidth-delay
    # product plus one such run in flight and is asked again once a whole run has room.
    # 34 MB in 64 KiB chunks to 2 rollouts on loopback (2 cores, medians): 5 ms 0.82 s, 10 ms 0.78,
    # 20 ms 0.85, a chunk a request 1.07; simulated, 1,000 peers at 1 Gbit/s and 20 ms:
    # 5 ms x1.549, 10 ms x1.578, 20 ms x1.565, a chunk a request x1.568 (within run-to-run noise).
    request_s: float = 0.01
    request_bytes: int = 1 << 20
    request_timeout_s: float = 10.0  # before any chunk time is measured; a sole holder's floor
    min_request_timeout_s: float = 0.25  # the floor of the adaptive timeout (round trips too)
    timeout_factor: float = 4.0
    endgame_sources: int = 2
    score_alpha: float = 0.3
    busy_backoff_s: float = 0.05
    # a chunk asked for and not served (no byte of it moving) by any peer claiming it for this
    # long (or timeout_factor x the longest a chunk of the download waited, if longer), or one
    # nobody holds while nothing arrives: give up on the payload and re-plan
    stall_timeout_s: float = 30.0
    seed: int = 0  # tie-break salt (a node draws a fresh one per download)
    have_poll_s: float = 0.2  # driver: how often the set of peers to follow is refreshed
    # driver: peers one download follows (have-maps, requests), the source's preferred first.
    # More only queue: each uploader then serves more requesters, and a receiver's minimum
    # of one request per source outgrows its downlink (simulated, 200 peers at 5 ms / 100
    # Mbit/s: 16 x1.51, 32 x1.30, 64 x1.58; 100 peers at 20 ms / 1 Gbit/s: 32 x1.52, 64 x1.55)
    max_sources: int = 32
    have_failures: int = 3  # driver: have-map errors in a row before a peer counts as lost
    max_attempts: int = 3  # driver: downloads of one payload when stored chunks rot on disk
    # driver: each chunk a seed handed us (its offer), pushed unasked to this many of the peers
    # following our have-map (0: none). Pull costs a relay hop three latencies (have-map news,
    # request, bytes); the seed hands each chunk to one rollout first, so its first hop from
    # there is the swarm's slowest. Only a chunk no other followed peer claims, and only
    # beside at most this many uploads (``p2p_sync.runtime.forwarding``; the figures:
    # docs/decisions/2026-11-27-forwarding-the-seeds-fresh-chunks.md)
    forward_seed_chunks: int = 4
