"""Scheduler properties over random event sequences (Hypothesis), plus hand-built cases."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.protocol.schedule_events import (
    CancelRequest,
    ChunkCorrupted,
    ChunkFailed,
    ChunkVerified,
    DownloadCompleted,
    PeerBanned,
    PeerHad,
    PeerLost,
    PeerPushes,
    RequestChunk,
    TimerFired,
)
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.swarmconfig import SwarmConfig


class Harness:
    """Runs a scheduler against simulated peers and checks invariants on every action."""

    def __init__(
        self, n: int, honest: dict[str, set[int]], evil: dict[str, set[int]], config: SwarmConfig
    ) -> None:
        self.sched = Scheduler(n, config, (), 1000)  # chunks of 1000 bytes
        self.honest, self.evil = honest, evil
        self.now = 0.0
        self.pending: list[tuple[str, int]] = []
        self.verified: set[int] = set()
        self.banned: set[str] = set()
        self.done = False

    def feed(self, event) -> None:
        for action in self.sched.handle(event, self.now):
            self.check(action)

    def check(self, action) -> None:
        if isinstance(action, RequestChunk):
            assert action.peer not in self.banned, "requested from a banned peer"
            assert action.index not in self.verified, "requested a verified chunk"
            assert (
                len(self.sched.peer_inflight[action.peer])
                <= self.sched.config.max_requests_per_peer
            )
            assert self.sched.requests_in_flight() <= self.sched.config.max_requests_total
            self.pending.append((action.peer, action.index))
        elif isinstance(action, CancelRequest):
            if (action.peer, action.index) in self.pending:
                self.pending.remove((action.peer, action.index))
        elif isinstance(action, PeerBanned):
            assert action.peer in self.evil, f"honest peer {action.peer} banned: {action.reason}"
            self.banned.add(action.peer)
        elif isinstance(action, DownloadCompleted):
            self.done = True

    def deliver(self, k: int) -> None:
        peer, index = self.pending.pop(k % len(self.pending))
        self.now += 0.01
        if peer in self.evil:
            self.feed(ChunkCorrupted(peer, index))
        else:
            self.verified.add(index)
            self.feed(ChunkVerified(peer, index, 1000))


@st.composite
def swarms(draw: st.DrawFn):
    n = draw(st.integers(1, 30))
    n_honest, n_evil = draw(st.integers(1, 5)), draw(st.integers(0, 4))
    honest = {f"h{i}": set(draw(st.sets(st.integers(0, n - 1)))) for i in range(n_honest)}
    for i in range(n):  # every chunk has at least one honest source
        honest[f"h{draw(st.integers(0, n_honest - 1))}"].add(i)
    evil = {f"e{i}": set(draw(st.sets(st.integers(0, n - 1), min_size=1))) for i in range(n_evil)}
    config = SwarmConfig(
        max_requests_per_peer=draw(st.integers(1, 4)),
        max_requests_total=draw(st.integers(1, 12)),
        request_timeout_s=1.0,
        request_bytes=draw(st.sampled_from([0, 1000, 3000])),  # runs of 1 to 3 chunks
        request_s=draw(st.sampled_from([0.005, 1.0])),  # a second: runs once measured
        seed=draw(st.integers(0, 9)),
    )
    owed = draw(st.sets(st.sampled_from(sorted([*honest, *evil]))))  # asked first (behind NAT)
    return n, honest, evil, config, owed


@settings(max_examples=150, deadline=None)
@given(swarms(), st.lists(st.tuples(st.sampled_from("dftlp"), st.integers(0, 10**6)), max_size=60))
def test_random_event_sequences_keep_invariants_and_finish(swarm, script) -> None:
    n, honest, evil, config, owed = swarm
    h = Harness(n, honest, evil, config)
    for peer, chunks in [*honest.items(), *evil.items()]:
        h.feed(PeerHad(peer, frozenset(chunks), None, peer in owed))
    for op, k in script:  # adversarial interleaving: deliveries, failures, timeouts, churn
        if op == "d" and h.pending:
            h.deliver(k)
        elif op == "f" and h.pending:
            peer, index = h.pending.pop(k % len(h.pending))
            if peer in evil:
                h.feed(ChunkFailed(peer, index))
            else:
                h.pending.append((peer, index))  # honest peers do not fail in this test
        elif op == "t":
            h.now += 0.5
            h.feed(TimerFired())
        elif op == "l" and evil:
            h.feed(PeerLost(sorted(evil)[k % len(evil)]))
        elif op == "p":  # a push promised, never kept: the download must not wait for ever
            peers = sorted([*honest, *evil])
            chunks = frozenset(i for i in range(n) if (k >> (i % 20)) & 1)
            h.feed(PeerPushes(peers[k % len(peers)], chunks))
    for _ in range(20 * n + 50):  # then the network behaves: everything pending arrives
        if h.done:
            break
        if h.pending:
            h.deliver(0)
        else:
            h.now += 2.0  # nothing in flight: time passes, timers fire
            h.feed(TimerFired())
    assert h.done and h.verified == set(range(n))


def test_rarest_chunk_is_requested_first() -> None:
    s = Scheduler(3, SwarmConfig(max_requests_total=1))
    for peer, chunks in {"a": {0, 1, 2}, "b": {0, 1}, "c": {0}}.items():
        s._peer_had(peer, frozenset(chunks), None)  # learn all have-maps before scheduling
    assert s.handle(TimerFired(), 0) == [RequestChunk("a", 2)]


def _first_requests(owed: bool, failed: bool = False) -> list[str]:
    """Whom a download asks first when "public" and "nated" both hold every chunk and look
    alike ("public" wins a tie by name), one request in all; "nated" is ``owed`` (it is
    behind NAT, we are public), and ``failed`` a request once."""
    s = Scheduler(8, SwarmConfig(max_requests_total=1))
    s._peer_had("public", frozenset(range(8)), 0.02)
    s._peer_had("nated", frozenset(range(8)), 0.02, owed)
    if failed:
        s.stats["nated"].failures = 1
    return [a.peer for a in s.handle(TimerFired(), 0) if isinstance(a, RequestChunk)]


def test_an_owed_source_is_asked_first_while_it_has_room() -> None:
    """A NATed peer's uplink serves only the public peers that follow it: used first, it
    leaves public uplink for the NATed peers that have nowhere else to fetch from."""
    assert _first_requests(owed=False) == ["public"]
    assert _first_requests(owed=True) == ["nated"]
    assert _first_requests(owed=True, failed=True) == ["public"]  # it lost its precedence


def test_an_owed_source_fills_only_its_own_depth() -> None:
    """Owed first is not owed only: a measured depth of one request leaves the rest of the
    window to the other sources."""
    s = Scheduler(8, SwarmConfig(max_requests_total=8, max_requests_per_peer=1))
    s._peer_had("public", frozenset(range(8)), 0.02)
    s._peer_had("nated", frozenset(range(8)), 0.02, True)
    peers = [a.peer for a in s.handle(TimerFired(), 0) if isinstance(a, RequestChunk)]
    assert sorted(peers) == ["nated", "public"]
    s.handle(PeerLost("nated"), 0.1)
    assert "nated" not in s.owed  # forgotten with the peer; its next have-map says again


def test_corrupt_chunk_bans_only_the_sender_and_is_refetched() -> None:
    s = Scheduler(1, SwarmConfig())
    actions = s.handle(PeerHad("evil", frozenset({0})), 0)
    assert actions == [RequestChunk("evil", 0)]
    s.handle(PeerHad("good", frozenset({0})), 0)
    actions = s.handle(ChunkCorrupted("evil", 0), 1)
    assert PeerBanned("evil", "served chunk 0 failing its hash") in actions
    assert "good" in s.inflight[0] and "good" not in s.banned  # refetched (endgame or now)


def test_timeout_moves_the_request_elsewhere() -> None:
    s = Scheduler(1, SwarmConfig(request_timeout_s=5, endgame_sources=1))
    s.handle(PeerHad("slow", frozenset({0})), 0)
    s.handle(PeerHad("fast", frozenset({0})), 0)
    first = next(iter(s.inflight[0]))
    actions = s.handle(TimerFired(), 6)
    assert CancelRequest(first, 0) in actions
    assert any(isinstance(a, RequestChunk) and a.peer != first for a in actions)


def _measured(holders: dict[str, frozenset[int]]) -> Scheduler:
    """Chunk 0 verified from "seed" 0.1 s after its request: the adaptive limit is then
    0.4 s (4 x 0.1 s), far below the hard ``request_timeout_s`` of 5 s; chunk 1 is in flight
    at "seed" since 0.1 s."""
    s = Scheduler(2, SwarmConfig(request_timeout_s=5, endgame_sources=1))
    s.handle(PeerHad("seed", frozenset({0})), 0)
    for peer, chunks in holders.items():
        s.handle(PeerHad(peer, chunks), 0.1)
    s.handle(ChunkVerified("seed", 0, 1000), 0.1)
    assert set(s.inflight[1]) == {"seed"}
    return s


def test_a_request_to_the_only_holder_waits_the_hard_timeout() -> None:
    """Asking the only holder again cannot be faster, only make it upload twice."""
    s = _measured({"seed": frozenset({0, 1})})
    assert s.next_timer(0.2) == 5.1
    assert s.handle(TimerFired(), 1.0) == []  # past the adaptive limit: nothing cancelled
    assert set(s.inflight[1]) == {"seed"}
    actions = s.handle(TimerFired(), 5.1)  # the hard limit: a silent crash, asked again
    assert actions[0] == CancelRequest("seed", 1)
    assert s.stats["seed"].failures == 1


def test_a_request_with_another_holder_moves_at_the_adaptive_timeout() -> None:
    s = _measured({"seed": frozenset({0, 1}), "other": frozenset({1})})
    assert s.next_timer(0.2) == 0.5
    actions = s.handle(TimerFired(), 0.5)
    assert actions[0] == CancelRequest("seed", 1)  # then asked again where it scores best
    assert [a.index for a in actions[1:] if isinstance(a, RequestChunk)] == [1]


def test_a_cancelled_request_counts_as_a_chunk_time_of_at_least_its_age() -> None:
    """Only chunks that beat the timeout used to be measured, so every request waiting at a
    crowded uploader was cancelled in turn (a congestion collapse). The request cancelled at
    age 0.4 s moves the typical chunk time from 0.1 s to 0.3 x 0.4 + 0.7 x 0.1 = 0.19 s: the
    request asked next may run 4 x 0.19 s, not 4 x 0.1 s."""
    s = _measured({"seed": frozenset({0, 1}), "other": frozenset({1})})
    assert CancelRequest("seed", 1) in s.handle(TimerFired(), 0.5)
    assert len(s.inflight[1]) == 1  # asked again at 0.5 s
    assert s.next_timer(0.6) == pytest.approx(0.5 + 4 * 0.19)
    assert s.handle(TimerFired(), 0.9) == []  # the old limit (0.5 + 0.4): nothing cancelled
    s.handle(ChunkVerified(next(iter(s.inflight[1])), 1, 1000), 1.0)
    assert s.complete


def test_endgame_duplicates_then_cancels_the_loser() -> None:
    s = Scheduler(1, SwarmConfig(endgame_sources=2))
    s.handle(PeerHad("a", frozenset({0})), 0)
    actions = s.handle(PeerHad("b", frozenset({0})), 0)
    assert set(s.inflight[0]) == {"a", "b"}, actions
    actions = s.handle(ChunkVerified("b", 0, 10), 1)
    assert CancelRequest("a", 0) in actions and DownloadCompleted() in actions


def test_many_peers_spread_requests_over_sources() -> None:
    rnd = random.Random(0)
    s = Scheduler(64, SwarmConfig(max_requests_per_peer=2, max_requests_total=64))
    actions = []
    for p in range(16):
        actions += s.handle(PeerHad(f"p{p}", frozenset(rnd.sample(range(64), 40))), 0)
    peers = {a.peer for a in actions if isinstance(a, RequestChunk)}
    assert len(peers) >= 12


def _pipeline(rate: float, rtt: float, chunk: int, n: int = 400) -> int:
    """Requests the scheduler keeps at one source behind a FIFO pipe (``rate`` bytes/s, a
    reply ``rtt`` after its request at the earliest), after 80 chunks."""
    s = Scheduler(n, SwarmConfig(max_requests_total=256))
    queue: list[tuple[float, int]] = []  # (arrival time, index), in arrival order
    free_at = 0.0  # when the source's link is free for the next chunk

    def send(actions: list, now: float) -> None:
        nonlocal free_at
        for a in actions:
            if isinstance(a, RequestChunk):
                free_at = max(free_at, now + rtt / 2) + chunk / rate
                queue.append((free_at + rtt / 2, a.index))

    send(s.handle(PeerHad("p", frozenset(range(n)), rtt), 0.0), 0.0)
    for _ in range(80):
        now, index = queue.pop(0)
        send(s.handle(ChunkVerified("p", index, chunk), now), now)
    return len(s.peer_inflight["p"])


def test_requests_per_source_follow_its_bandwidth_delay_product() -> None:
    chunk = 128 * 1024
    # 100 MB/s at 40 ms: 4 MB in flight = 31 chunks (within the per-peer cap of 32)
    assert 28 <= _pipeline(100e6, 0.040, chunk) <= 32
    assert 3 <= _pipeline(10e6, 0.040, chunk) <= 5  # a tenth of the rate: a tenth of the pipe
    assert _pipeline(1e6, 0.005, chunk) == 2  # a slow, near peer: one in flight, one queued
    assert _pipeline(1e9, 1.0, chunk) == SwarmConfig().max_requests_per_peer  # capped


def test_an_unmeasured_source_gets_the_initial_depth_within_the_bounds() -> None:
    s = Scheduler(50, SwarmConfig(initial_requests_per_peer=5, max_requests_per_peer=3))
    actions = s.handle(PeerHad("p", frozenset(range(50))), 0.0)
    assert len(actions) == 3


def test_a_shorter_round_trip_lowers_the_depth_at_once() -> None:
    """A have-map answered faster than any chunk so far lowers the source's bandwidth-delay
    product: the scheduler must not refill the old, deeper pipe when a request ends."""
    s = Scheduler(50, SwarmConfig(initial_requests_per_peer=2, max_requests_per_peer=8))
    first = s.handle(PeerHad("p", frozenset(range(50))), 0.0)
    assert len(first) == 2 and all(isinstance(a, RequestChunk) for a in first)
    # both arrive at once after 1 s: a fast pipe (1 ms between deliveries) at a 1 s round trip
    got = [a for i in (0, 1) for a in s.handle(ChunkVerified("p", first[i].index, 1000), 1.0)]
    deep = len(s.peer_inflight["p"])
    assert deep == 8 and sum(isinstance(a, RequestChunk) for a in got) == 8
    assert s.handle(PeerHad("p", frozenset(), rtt_s=1e-9), 1.0) == []  # near: depth 2 now
    asked = s.handle(ChunkFailed("p", next(iter(s.peer_inflight["p"]))), 1.0)
    assert not any(isinstance(a, RequestChunk) for a in asked)
    assert len(s.peer_inflight["p"]) == 7


def test_a_lagging_pusher_is_asked_last_even_beside_a_peer_named_0() -> None:
    """A pusher that lagged on a chunk is its last resort, whatever the other holder is
    called (the simulator names its trainer 0, which is falsy: it once fell through to the
    best of all holders, the lagging pusher among them)."""
    sched = Scheduler(1, SwarmConfig(), (), 1000)
    sched.pushes.lagged[0] = 1  # its pusher lagged on it (``PushWait.expire``)
    actions = sched.handle_many(
        [PeerHad(0, frozenset({0}), 0.01), PeerHad(1, frozenset({0}), 0.01)], 0.0
    )
    asked = [a for a in actions if isinstance(a, RequestChunk)]
    assert asked[0] == RequestChunk(0, 0)  # (then, in the endgame, the pusher as well)
