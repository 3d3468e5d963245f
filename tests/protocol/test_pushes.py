"""Pushed chunks in the scheduler: waited for while the push is on time, pulled once it is not
(the pusher stopped, lags on one chunk, left or was banned)."""

from __future__ import annotations

from dataclasses import replace

from p2p_sync.protocol.pushes import PushWait
from p2p_sync.protocol.schedule_events import (
    ChunkCorrupted,
    ChunkVerified,
    DownloadCompleted,
    PeerHad,
    PeerLost,
    PeerPushes,
    PushStopped,
    RequestChunk,
    TimerFired,
)
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.swarmconfig import SwarmConfig

CONFIG = SwarmConfig(min_request_timeout_s=0.25, timeout_factor=4.0, endgame_sources=1)


def requested(actions) -> set[tuple[str, int]]:
    return {(a.peer, a.index) for a in actions if isinstance(a, RequestChunk)}


def pushed_swarm() -> Scheduler:
    """Chunks 0-3; "parent" promised 0 and 2; "other" holds 1 and 3 (requested at once)."""
    s = Scheduler(4, CONFIG)
    s.handle(PeerPushes("parent", frozenset({0, 2})), 0.0)
    s.handle(PeerHad("parent", frozenset()), 0.0)
    assert requested(s.handle(PeerHad("other", frozenset({1, 3})), 0.0)) == {
        ("other", 1),
        ("other", 3),
    }
    return s


def test_promised_chunks_are_not_requested_while_the_push_is_on_time() -> None:
    s = pushed_swarm()
    assert requested(s.handle(PeerHad("mesh", frozenset(range(4))), 0.0)) == set()
    s.handle(ChunkVerified("parent", 0, 1000), 0.05)  # pushed: counts like any verified chunk
    assert requested(s.handle(TimerFired(), 0.2)) == set()
    s.handle(ChunkVerified("parent", 2, 1000), 0.2)
    s.handle(ChunkVerified("other", 1, 1000), 0.2)
    assert s.handle(ChunkVerified("other", 3, 1000), 0.2) == [DownloadCompleted()]


def test_a_pusher_silent_while_others_hold_its_chunks_is_given_up() -> None:
    s = pushed_swarm()
    assert requested(s.handle(PeerHad("mesh", frozenset({0, 2})), 1.0)) == set()
    assert s.next_timer(1.0) == 1.25  # the floor: "parent" has no push rhythm yet
    assert s.handle(TimerFired(), 1.2) == []
    actions = s.handle(TimerFired(), 1.25)
    assert PushStopped("parent") in actions
    assert requested(actions) == {("mesh", 0), ("mesh", 2)}
    assert not s.pushes.pusher


def test_a_live_pusher_that_lags_on_one_chunk_loses_only_that_chunk() -> None:
    s = Scheduler(12, replace(CONFIG, initial_requests_per_peer=16))  # "mesh" has room
    s.handle(PeerPushes("parent", frozenset(range(0, 12, 2))), 0.0)
    s.handle(PeerHad("mesh", frozenset(range(12))), 0.0)
    t = 0.0
    for i in (0, 2, 4):  # a push every 0.1 s: patience 0.4 s
        t += 0.1
        s.handle(ChunkVerified("parent", i, 1000), t)
    s.handle(PeerHad("parent", frozenset({6, 8})), t)  # it has 6 and 8 at 0.3 s ...
    t += 0.1
    s.handle(ChunkVerified("parent", 8, 1000), t)  # ... and pushes 8, not 6
    assert s.next_timer(t) is not None and abs(s.next_timer(t) - 0.7) < 1e-9  # 0.3 + 4 x 0.1
    actions = s.handle(TimerFired(), 0.7)
    assert PushStopped("parent") not in actions
    assert ("mesh", 6) in requested(actions)  # not the parent: it lags there
    assert set(s.pushes.pusher) == {10}  # still waited for: not claimed by the parent yet


def test_a_banned_or_lost_pusher_stops_its_pushes_at_once() -> None:
    for gone in (ChunkCorrupted("parent", 0), PeerLost("parent")):
        s = pushed_swarm()
        s.handle(PeerHad("mesh", frozenset({0, 2})), 0.0)
        actions = s.handle(gone, 0.1)
        assert PushStopped("parent") in actions
        assert requested(actions) == {("mesh", 0), ("mesh", 2)}


def test_a_banned_peer_cannot_promise_pushes() -> None:
    s = Scheduler(2, CONFIG)
    s.handle(PeerHad("evil", frozenset({0, 1})), 0.0)
    s.handle(ChunkCorrupted("evil", 0), 0.0)
    s.handle(PeerPushes("evil", frozenset({0, 1})), 0.1)
    assert not s.pushes.pusher


def test_patience_follows_the_pushers_rhythm_and_others_before_its_own() -> None:
    w = PushWait(floor_s=0.25, factor=4.0, alpha=1.0)
    w.expect("a", {0, 1, 2}, 0.0)
    w.expect("b", {3}, 0.0)
    w.arrived("a", 0, 0.5)  # the first push sets no rhythm (it waited for the chunk itself)
    w.arrived("a", 1, 0.6)  # 0.1 s between pushes: patience 0.4 s
    w.claimed("x", {2, 3}, 1.0)
    assert w.pushed_any("a") and not w.pushed_any("b")
    assert sorted(w.deadlines()) == [1.4, 1.4]  # "b" has no rhythm: the others' median
    assert w.expire(1.39) == []
    assert sorted(w.expire(1.4)) == ["a", "b"]
    assert w.pusher == {}


def test_only_missing_chunks_are_waited_for() -> None:
    s = Scheduler(3, CONFIG, have=[1])
    s.handle(PeerPushes("parent", frozenset({0, 1, 2})), 0.0)
    assert set(s.pushes.pusher) == {0, 2}
