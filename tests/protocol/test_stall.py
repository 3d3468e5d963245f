"""A chunk nobody can serve: the scheduler reports a stall, the driver stops with a clear error
instead of waiting for ever, and a rollout re-plans through an anchor.

The driver runs against an in-process chunk source (the same driver the node runs over HTTP);
the rollout test runs real trainer and rollout nodes on loopback.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from p2p_sync.errors import DownloadStalledError, PeerError
from p2p_sync.protocol.schedule_events import (
    Action,
    CancelRequest,
    ChunkFailed,
    ChunkMoving,
    ChunkVerified,
    DownloadCompleted,
    DownloadStalled,
    Event,
    PeerBusy,
    PeerHad,
    PeerLost,
    RequestChunk,
    TimerFired,
)
from p2p_sync.protocol.stalls import carry_unserved
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.store import Store
from p2p_sync.transport.download import DataPlaneSource, Download, HaveCursor, Timed, download
from p2p_sync.transport.http import DataClient
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, SwarmPolicy
from p2p_sync.weights.statehash import state_hash
from tests import evil_peer
from tests.helpers import bit_equal, rollout_config, stop_follower_pair, trainer_config
from tests.nodebase import MemorySwarm

CHUNK = 16 * 1024

# ---------------------------------------------------------------- the scheduler alone


def test_a_chunk_whose_only_holder_fails_it_stalls_once_after_the_timeout() -> None:
    s = Scheduler(2, SwarmConfig(stall_timeout_s=5.0))
    s.handle(PeerHad("a", frozenset({0, 1})), 0.0)
    s.handle(ChunkVerified("a", 0, 10), 1.0)
    assert s.handle(ChunkFailed("a", 1), 2.0) == []  # chunk 1 has no source from now on
    assert not any(isinstance(a, DownloadStalled) for a in s.handle(TimerFired(), 5.0))
    assert s.next_timer(5.0) == pytest.approx(7.0)
    assert not any(isinstance(a, DownloadStalled) for a in s.handle(TimerFired(), 6.9))
    stalled = [a for a in s.handle(TimerFired(), 7.0) if isinstance(a, DownloadStalled)]
    assert stalled == [DownloadStalled(frozenset({1}))]
    assert not any(isinstance(a, DownloadStalled) for a in s.handle(TimerFired(), 20.0))


def test_chunks_without_a_source_do_not_stall_while_others_keep_arriving() -> None:
    s = Scheduler(4, SwarmConfig(stall_timeout_s=10.0))
    asked = [a.index for a in s.handle(PeerHad("a", frozenset({0, 1, 2})), 0.0)]
    for t in (4.0, 8.0, 12.0):  # chunk 3 has no source all along; each asked one comes
        actions = s.handle(ChunkVerified("a", asked.pop(0), 10), t)
        assert not any(isinstance(a, DownloadStalled) for a in actions)
        asked += [a.index for a in actions if isinstance(a, RequestChunk)]
    assert s.next_timer(12.0) == pytest.approx(22.0)
    assert s.handle(PeerHad("b", frozenset({3})), 16.0)  # a source appears: request it
    assert s.next_timer(16.0) is not None and s.next_timer(16.0) > 22.0  # timeout, no stall


def test_a_lost_peer_takes_its_claims_with_it() -> None:
    s = Scheduler(1, SwarmConfig(stall_timeout_s=1.0))
    s.handle(PeerHad("a", frozenset({0})), 0.0)
    s.handle(PeerLost("a"), 0.5)
    assert [a for a in s.handle(TimerFired(), 1.5) if isinstance(a, DownloadStalled)]


def test_the_timer_follows_the_oldest_request_and_busy_backoff() -> None:
    cfg = SwarmConfig(request_timeout_s=3.0, busy_backoff_s=0.5, stall_timeout_s=100.0)
    s = Scheduler(1, cfg)
    assert s.next_timer(0.0) == pytest.approx(100.0)  # nothing known yet: only a stall
    s.handle(PeerHad("a", frozenset({0})), 1.0)
    assert s.next_timer(1.0) == pytest.approx(4.0)  # the request sent at 1.0 times out at 4.0


# ---------------------------------------------------------------- claims that are never served


def _stalls(actions: list[Action]) -> list[DownloadStalled]:
    return [a for a in actions if isinstance(a, DownloadStalled)]


def _asked(actions: list[Action], peer: str | None = None) -> list[int]:
    return [a.index for a in actions if isinstance(a, RequestChunk) and peer in (None, a.peer)]


def _claimed_but_not_served(answer: str) -> tuple[float, int]:
    """Chunk 0's only claimant re-sends its claim every half second (its have feed) and
    answers each request for it by ``answer``; time goes by in steps of 0.25 s. When the
    stall came, and how often the chunk was asked for until then."""
    s = Scheduler(1, SwarmConfig(stall_timeout_s=5.0, request_timeout_s=1.0))
    inflight, asked, t = False, 0, 0.0
    while t < 30.0:
        events: list[Event] = [TimerFired()]
        if t % 0.5 == 0:
            events.append(PeerHad("liar", frozenset({0})))
        if inflight and answer == "fails":
            events.append(ChunkFailed("liar", 0))  # a 404, or a transfer cut by its transport
        elif inflight and answer == "is busy":
            events.append(PeerBusy("liar", 0))
        elif inflight and answer == "sends half, then nothing":
            events += [ChunkMoving("liar", 0, 500), ChunkFailed("liar", 0)]
        for event in events:
            actions = s.handle(event, t)
            asked += len(_asked(actions))
            if _asked(actions):
                inflight = True
            if any(isinstance(a, CancelRequest) for a in actions) or isinstance(
                event, ChunkFailed | PeerBusy
            ):
                inflight = bool(_asked(actions))
            if _stalls(actions):
                assert _stalls(actions) == [DownloadStalled(frozenset({0}))]
                return t, asked
        t += 0.25
    raise AssertionError(f"no stall in 30 s (asked {asked} times)")


@pytest.mark.parametrize(
    ("answer", "stalled_at"),
    [("times out", 5.0), ("fails", 5.0), ("is busy", 5.0), ("sends half, then nothing", 5.5)],
)
def test_a_chunk_claimed_again_and_again_but_never_served_stalls(
    answer: str, stalled_at: float
) -> None:
    """However often its claim comes again, a chunk asked for at 0.0 and never delivered is
    stalled ``stall_timeout_s`` (5 s) later: re-claims and re-requests are no progress, nor is
    the same half of its bytes at every request (the first half, at 0.25, was: the request
    then in flight fails at 5.25, and the stall comes with the next claim)."""
    at, asked = _claimed_but_not_served(answer)
    assert at == stalled_at
    assert asked >= 2  # its claim put it back in play, and it was asked again


def test_a_peer_that_serves_other_chunks_but_never_this_one_lets_it_stall() -> None:
    """The liar serves every chunk it is asked for a tenth of a second later, except chunk 3,
    and claims them all again every half second: chunk 3 stalls 5 s after it was first asked
    for (once the request for it then in flight timed out: within a second), though the
    download as a whole keeps moving."""
    s = Scheduler(4, SwarmConfig(stall_timeout_s=5.0, request_timeout_s=1.0))
    due: list[tuple[float, int]] = []
    first: dict[int, float] = {}
    t = 0.0
    while t < 20.0:
        events: list[Event] = [TimerFired(), PeerHad("liar", frozenset({0, 1, 2, 3}))]
        events += [ChunkVerified("liar", i, 10) for at, i in due if at <= t and i != 3]
        due = [(at, i) for at, i in due if at > t]
        for event in events:
            actions = s.handle(event, t)
            for i in _asked(actions):
                first.setdefault(i, t)
                due.append((t + 0.1, i))
            if _stalls(actions):
                assert _stalls(actions) == [DownloadStalled(frozenset({3}))]
                assert first[3] + 5.0 <= t <= first[3] + 6.0
                assert s.missing == {3}
                return
        t = round(t + 0.1, 1)
    raise AssertionError("chunk 3 never stalled")


def test_a_slow_chunk_whose_bytes_keep_moving_does_not_stall() -> None:
    """Its only holder sends a chunk over 12 s (stall_timeout_s is 5), its bytes arriving
    all along: progress, so no stall, and the download completes."""
    s = Scheduler(1, SwarmConfig(stall_timeout_s=5.0, request_timeout_s=30.0))
    assert _asked(s.handle(PeerHad("slow", frozenset({0})), 0.0)) == [0]
    for second in range(1, 12):
        assert s.handle(ChunkMoving("slow", 0, 100 * second), float(second)) == []
        assert s.next_timer(float(second)) == pytest.approx(second + 5.0)
        assert not _stalls(s.handle(TimerFired(), second + 0.5))
    assert s.handle(ChunkVerified("slow", 0, 1200), 12.0) == [DownloadCompleted()]


def test_a_chunk_one_claimant_never_serves_is_verified_from_another_and_never_stalls() -> None:
    """The liar claims every chunk and answers nothing; an honest peer serves each chunk a
    second after it is asked: what was asked of the liar is asked again of the honest peer
    and arrives, well within ``stall_timeout_s``."""
    s = Scheduler(6, SwarmConfig(stall_timeout_s=5.0, request_timeout_s=1.0))
    due: list[tuple[float, str, int]] = []
    t, done = 0.0, False
    while not done:
        assert t < 30.0, "never completed"
        events: list[Event] = [TimerFired()]
        if t % 0.5 == 0:
            events += [PeerHad("liar", frozenset(range(6))), PeerHad("honest", frozenset(range(6)))]
        events += [ChunkVerified(p, i, 10) for at, p, i in due if at <= t]
        due = [(at, p, i) for at, p, i in due if at > t]
        for event in events:
            actions = s.handle(event, t)
            assert not _stalls(actions)
            due += [(t + 1.0, "honest", i) for i in _asked(actions, "honest")]
            done = done or DownloadCompleted() in actions
        t = round(t + 0.25, 2)
    assert not s.stalls.unserved


def test_after_a_stall_its_claimants_lose_standing_for_that_chunk_only() -> None:
    """The liar served chunk 0 and never chunk 1: once chunk 1 stalls, the liar's claim of
    it counts no more (it is not asked for again), while its claim of chunk 2 still does; a
    peer that never failed it is asked for it at once."""
    s = Scheduler(3, SwarmConfig(stall_timeout_s=5.0, request_timeout_s=1.0))
    assert sorted(_asked(s.handle(PeerHad("liar", frozenset({0, 1})), 0.0))) == [0, 1]
    s.handle(ChunkVerified("liar", 0, 10), 0.5)
    stalls, t = [], 1.0
    while not stalls and t < 20.0:  # asked again at each time-out, claimed again each second
        stalls = _stalls(s.handle(TimerFired(), t) + s.handle(PeerHad("liar", frozenset({1})), t))
        t += 1.0
    assert len(stalls) == 1 and 1 in stalls[0].indices and t > 5.0  # 2: nobody had it yet
    assert stalls[0].disowned == {1: frozenset({"liar"})}
    assert s.stalls.unserved == {1: {"liar"}}
    assert _asked(s.handle(PeerHad("liar", frozenset({1, 2})), t)) == [2]  # not 1
    assert not s.holders[1] and s.holders[2] == {"liar"}
    assert _asked(s.handle(PeerHad("other", frozenset({1})), t)) == [1]
    assert s.inflight[1].keys() == {"other"}


def test_a_later_download_starts_without_the_claims_that_failed_before() -> None:
    """A stall's ``disowned`` is carried to the next download of the same payload: the liar's
    claim of chunk 0 does not count there; a chunk that stalled with nobody to disown gives
    everyone a fresh chance."""
    record: dict[int, set[str]] = {}
    carry_unserved(record, {0, 1}, {0: frozenset({"liar"}), 1: frozenset({"slow"})})
    carry_unserved(record, {0, 2}, {0: frozenset({"other"})})
    assert record == {0: {"liar", "other"}, 1: {"slow"}}
    carry_unserved(record, {1}, {})  # chunk 1 stalled again with no claimant left
    assert record == {0: {"liar", "other"}}
    s = Scheduler(2, SwarmConfig(), unserved=record)
    assert _asked(s.handle(PeerHad("liar", frozenset({0, 1})), 0.0)) == [1]
    assert not s.holders[0]


# ---------------------------------------------------------------- the driver, in process


class _Sink:
    """An in-memory store: what the driver writes, and whether it re-verifies."""

    def __init__(self) -> None:
        self.chunks: dict[str, bytes] = {}

    def have_indices(self, m: Manifest) -> list[int]:
        return [i for i, sha in enumerate(m.chunks) if sha in self.chunks]

    def put_chunk(self, data: bytes, digest: str | None = None) -> str:
        assert digest is not None
        self.chunks[digest] = bytes(data)
        return digest

    def verify_pack(self, m: Manifest) -> bool:
        return all(sha in self.chunks for sha in m.chunks)


class _Source:
    """Peers in this process; ``lost`` chunks are claimed by their holder but never served."""

    def __init__(self, payload: bytes, peers: list[str], lost: set[int]) -> None:
        self.payload, self._peers, self.lost = payload, peers, lost
        self.requests: list[tuple[str, int]] = []
        self.followed: list[str] = []  # whose have-map was asked for, in order
        self.asked: list[tuple[str, int]] = []  # (peer, known) of every have-map question
        self.push: dict[str, list[int]] = {}  # have-maps pushed with the announcement
        self.pushing: dict[str, list[int]] = {}  # chunks of them sent behind it
        self.sent: list[tuple[str, int, bytes]] = []  # those chunks as they come
        # have feeds opened before the download (answers, then the feed ends)
        self.early_feeds: dict[str, list[tuple[list[int], HaveCursor]]] = {}
        self.seeds: set[str] = set()  # peers known as seeds (their announcements had offers)
        self.logs: dict[str, str] = {}  # peers whose have-maps are logs (rollouts'), by log id
        self.claims: dict[str, list[int]] = {}  # what a peer's have-map lists (else every chunk)
        self.promised: dict[str, list[int]] = {}  # what its answer says it pushes us ("pushed")
        self.push_delay_s = 0.0

    def peers(self) -> list[str]:
        return list(self._peers)

    def usable(self, peer: str) -> bool:
        return peer in self._peers

    def owed(self, peer: str) -> bool:
        return peer.startswith("p2p://")  # as a public node's: peers behind NAT

    async def chunk(
        self, peer: str, m: Manifest, index: int, moved: Callable[[int], None] | None = None
    ) -> bytes:
        self.requests.append((peer, index))
        if index in self.lost:
            raise PeerError(f"{peer}: 404")
        return self.payload[index * CHUNK : (index + 1) * CHUNK]

    async def chunks(self, peer: str, m: Manifest, indices: list[int]) -> AsyncIterator[bytes]:
        for index in indices:  # a run stops at the first chunk its peer lacks
            if index in self.lost:
                self.requests.append((peer, index))
                return
            yield await self.chunk(peer, m, index)

    def runs(self, peer: str) -> bool:
        return True

    def pushed(self, peer: str, m: Manifest) -> tuple[list[int] | None, list[int]]:
        return self.push.pop(peer, None), self.pushing.pop(peer, [])

    async def pushes(self, m: Manifest) -> AsyncIterator[tuple[str, int, bytes]]:
        for item in self.sent:  # chunks behind the announcements, then nothing more
            await asyncio.sleep(self.push_delay_s)  # a push's way here
            yield item
        await asyncio.Event().wait()

    def seed(self, peer: str) -> bool:
        return peer in self.seeds

    def early(self, peer: str, m: Manifest) -> AsyncIterator[Timed] | None:
        answers = self.early_feeds.pop(peer, None)
        return None if answers is None else self._early(answers)

    async def _early(self, answers: list[tuple[list[int], HaveCursor]]) -> AsyncIterator[Timed]:
        for at, (have, cursor) in enumerate(answers):
            await asyncio.sleep(0)
            yield have, cursor, (0.04 if at == 0 else None)

    async def have_feed(
        self, peer: str, m: Manifest, since: HaveCursor
    ) -> AsyncIterator[tuple[list[int], HaveCursor]]:
        self.followed.append(peer)
        self.asked.append((peer, since.known))
        if since.known < 0:  # a whole list (a seed's offer) unless it keeps a log
            have = self.claims.get(peer, list(range(len(m.chunks))))
            pushed = frozenset(self.promised.get(peer, ()))
            yield have, HaveCursor(len(have), self.logs.get(peer), pushed)
        await asyncio.Event().wait()  # nothing new will come


class _Counting:
    def __init__(self) -> None:
        self.bytes = 0
        self.forwarded: list[tuple[int, str]] = []  # (index, source) passed on

    def served(self, peer: str, nbytes: int) -> None:
        self.bytes += nbytes

    def forward(self, index: int, data: bytes, source: str) -> None:
        self.forwarded.append((index, source))

    def misbehaved(self, peer: str, reason: str) -> None:
        raise AssertionError(f"{peer} banned: {reason}")


class _Banning(_Counting):
    def __init__(self) -> None:
        super().__init__()
        self.banned: list[str] = []

    def misbehaved(self, peer: str, reason: str) -> None:
        self.banned.append(peer)


def _manifest(payload: bytes) -> Manifest:
    return manifest_for(
        payload,
        swarm="stall",
        version=0,
        kind=SNAPSHOT,
        target_state="aa" * 16,
        layout="bb" * 16,
        now=int(time.time()),
        chunk_size=CHUNK,
    )


async def _download(
    lost: set[int],
    peers: tuple[str, ...] = ("p1", "p2"),
    push: dict[str, list[int]] | None = None,
    sent: dict[str, dict[int, bytes | None]] | None = None,
    early: dict[str, list[tuple[list[int], HaveCursor]]] | None = None,
    logs: dict[str, str] | None = None,
    seeds: set[str] | None = None,
    claims: dict[str, list[int]] | None = None,
    promised: dict[str, list[int]] | None = None,
    delay: float = 0.0,
    **settings: int,
) -> tuple[_Sink, _Source, _Banning, float]:
    """``sent``: chunks each peer sends behind its announcement (None: the true bytes);
    ``early``: answers of have feeds opened before the download; ``logs``: peers whose
    have-maps are logs (else offers, as a seed's), ``seeds``: peers known as seeds,
    ``claims``: what a peer's have-map lists (else every chunk), ``promised``: what its
    answer says it pushes us, ``delay``: how long each push takes to come."""
    payload = random.Random(0).randbytes(5 * CHUNK)
    m = _manifest(payload)
    sink, source, listener = _Sink(), _Source(payload, list(peers), lost), _Banning()
    source.push = dict(push or {})
    source.early_feeds = dict(early or {})
    source.logs, source.seeds = dict(logs or {}), set(seeds or ())
    source.claims, source.promised = dict(claims or {}), dict(promised or {})
    source.push_delay_s = delay
    for peer, chunks in (sent or {}).items():
        if not promised:  # behind an announcement (else forwarded: the answers say so)
            source.pushing[peer] = list(chunks)
        for i, data in chunks.items():
            if data != b"":  # b"": promised, never sent
                true = payload[i * CHUNK : (i + 1) * CHUNK]
                source.sent.append((peer, i, true if data is None else data))
    config = SwarmConfig(stall_timeout_s=0.3, seed=1, have_poll_s=0.05, **settings)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(download(m, source, sink, listener, config), 20)
    finally:
        took = time.monotonic() - t0
    return sink, source, listener, took


def test_the_driver_fetches_every_chunk_from_an_in_process_source() -> None:
    sink, source, listener, _ = asyncio.run(_download(lost=set()))
    assert len(sink.chunks) == 5
    assert 5 * CHUNK <= listener.bytes <= 2 * 5 * CHUNK  # endgame: at most 2 copies a chunk
    assert {p for p, _ in source.requests} == {"p1", "p2"}  # both sources used


def test_a_pushed_have_map_is_the_first_answer_and_the_peer_is_only_long_polled() -> None:
    # p1 pushed chunks 0 and 1 with its announcement (as the trainer hands a follower its own)
    sink, source, _, _ = asyncio.run(_download(set(), ("p1", "p2"), {"p1": [0, 1]}))
    assert len(sink.chunks) == 5
    assert ("p1", -1) not in source.asked and ("p1", 2) in source.asked  # no round trip
    assert ("p2", -1) in source.asked  # nothing pushed: asked as before
    assert source.push == {}  # taken once


def test_a_have_feed_opened_before_the_download_is_taken_over_and_asked_on_from_its_end() -> None:
    """The node asked p1's have-map while the manifest came: the download takes that feed's
    answers (two, the second only news) instead of asking, and once it ends asks p1 again
    from where it left off."""
    log = "0123456789abcdef"
    early = {"p1": [([0, 3], HaveCursor(2, log)), ([4], HaveCursor(3, log))]}
    sink, source, _, _ = asyncio.run(_download(set(), ("p1", "p2"), early=early))
    assert len(sink.chunks) == 5
    assert ("p1", -1) not in source.asked and ("p1", 3) in source.asked  # asked on from 3
    assert ("p2", -1) in source.asked
    assert source.early_feeds == {}  # taken once


def test_chunks_sent_behind_an_announcement_are_taken_and_never_requested() -> None:
    sent = {"p1": {0: None, 1: None}}
    sink, source, listener, _ = asyncio.run(_download(set(), ("p1", "p2"), {"p1": [0, 1]}, sent))
    assert len(sink.chunks) == 5 and not listener.banned
    assert not {i for _, i in source.requests} & {0, 1}  # on their way: not asked again


def test_a_corrupt_chunk_sent_behind_an_announcement_bans_its_sender_and_is_fetched() -> None:
    sent = {"p1": {0: b"x" * CHUNK}}
    sink, source, listener, _ = asyncio.run(_download(set(), ("p1", "p2"), {"p1": [0, 1]}, sent))
    assert len(sink.chunks) == 5  # chunk 0 from p2, verified
    assert listener.banned == ["p1"]
    assert ("p2", 0) in source.requests


def test_a_chunk_promised_behind_an_announcement_that_never_comes_is_pulled() -> None:
    sent = {"p1": {0: b""}}  # the body was cut before it
    sink, source, listener, _ = asyncio.run(_download(set(), ("p1", "p2"), {"p1": [0, 1]}, sent))
    assert len(sink.chunks) == 5 and not listener.banned
    assert 0 in {i for _, i in source.requests}  # requested once the push was overdue


def test_rare_chunks_from_a_seed_are_passed_on_and_no_others() -> None:
    """p1 answers whole lists (a seed's offers), p2 keeps a have log (a rollout) listing
    chunks 3 and 4: what came from p1 and p2 does not claim is forwarded, each chunk once;
    nothing from p2, nothing p2 holds too (out in the swarm already); with
    ``forward_seed_chunks = 0`` nothing is."""
    logs, claims = {"p2": "0123456789abcdef"}, {"p2": [3, 4]}
    sink, source, listener, _ = asyncio.run(
        _download(set(), ("p1", "p2"), logs=logs, claims=claims)
    )
    assert len(sink.chunks) == 5
    forwarded = [i for i, _ in listener.forwarded]
    assert forwarded and len(set(forwarded)) == len(forwarded)  # each at most once
    assert set(forwarded) <= {0, 1, 2} & {i for p, i in source.requests if p == "p1"}
    assert {p for _, p in listener.forwarded} == {"p1"}
    _, _, quiet, _ = asyncio.run(
        _download(set(), ("p1", "p2"), logs=logs, claims=claims, forward_seed_chunks=0)
    )
    assert quiet.forwarded == []


def test_a_chunk_a_have_map_answer_says_is_pushed_is_waited_for_not_requested() -> None:
    """p1's answer lists chunk 0 as "pushed" (it forwards it to us, unasked; it takes 0.15 s
    to come, less than the push wait's floor): the download waits for it and asks nobody
    for chunk 0, though p1 and p2 both list it."""
    logs = {"p1": "0123456789abcdef", "p2": "fedcba9876543210"}
    source_push = {"p1": {0: None}}
    sink, source, listener, _ = asyncio.run(
        _download(
            set(), ("p1", "p2"), sent=source_push, logs=logs, promised={"p1": [0]}, delay=0.15
        )
    )
    assert len(sink.chunks) == 5 and not listener.banned
    assert 0 not in {i for _, i in source.requests}  # on its way: never requested


@pytest.mark.parametrize(
    ("pushed", "promised"),
    [([0, 2], {0, 2}), ([0, 9], {0}), ("0", set()), ([True, "1", 1.0, None], set()), (None, set())],
)
def test_a_have_map_answer_promises_only_chunks_it_lists(pushed: Any, promised: set) -> None:
    """ "pushed" names chunks of the answer's own list; anything else in it is ignored."""
    res = {"have": [0, 1, 2], "from": 0, "log": "0123456789abcdef", "pushed": pushed}
    _, after = DataPlaneSource.answer("p1", res, HaveCursor())
    assert after.pushed == frozenset(promised)


def test_chunks_a_known_seed_sent_behind_its_announcement_are_passed_on() -> None:
    """p1 keeps a have log but its announcement carried an offer (``ChunkSource.seed``):
    the chunks it sent behind the announcement are forwarded as they are taken."""
    logs = {"p1": "0123456789abcdef", "p2": "fedcba9876543210"}
    sent, claims = {"p1": {0: None, 1: None}}, {"p2": [2, 3, 4]}
    _, _, listener, _ = asyncio.run(
        _download(set(), ("p1", "p2"), {"p1": [0, 1]}, sent, logs=logs, seeds={"p1"}, claims=claims)
    )
    assert {0, 1} <= {i for i, p in listener.forwarded if p == "p1"}
    assert all(p == "p1" for _, p in listener.forwarded)


def test_a_download_follows_at_most_max_sources_peers_the_preferred_first() -> None:
    peers = tuple(f"p{i}" for i in range(10))
    sink, source, _, _ = asyncio.run(_download(set(), peers, max_sources=3))
    assert len(sink.chunks) == 5
    assert set(source.followed) == {"p0", "p1", "p2"}  # the source's first three
    assert {p for p, _ in source.requests} <= {"p0", "p1", "p2"}


def test_a_download_follows_every_owed_peer_beyond_max_sources() -> None:
    peers = ("p0", "p1", "p2", "p2p://n0", "p3", "p2p://n1")
    _, source, _, _ = asyncio.run(_download(set(), peers, max_sources=3))
    assert set(source.followed) == {"p0", "p1", "p2", "p2p://n0", "p2p://n1"}  # never p3


def test_a_chunk_nobody_can_serve_stops_the_download_with_a_clear_error() -> None:
    with pytest.raises(DownloadStalledError) as err:
        asyncio.run(_download(lost={3}))
    assert err.value.indices == frozenset({3})
    assert "no reachable source" in str(err.value)


def test_the_driver_keeps_what_it_verified_before_the_stall() -> None:
    payload = random.Random(0).randbytes(5 * CHUNK)
    m = _manifest(payload)
    sink, source = _Sink(), _Source(payload, ["p1"], {4})
    d = Download(m, source, sink, _Counting(), SwarmConfig(stall_timeout_s=0.2))
    with pytest.raises(DownloadStalledError):
        asyncio.run(asyncio.wait_for(d.run(), 20))
    assert sink.have_indices(m) == [0, 1, 2, 3]  # the next try only needs chunk 4
    assert not d.requests and all(t.done() for t in d.followers.values())  # nothing leaks


# ---------------------------------------------------------------- the driver, over HTTP


def _origin(m: Manifest, payload: bytes, pieces: int = 1, pace_s: float = 0.0) -> web.Application:
    """An honest peer on loopback holding ``m``: its manifest, a have-map listing every chunk,
    and each chunk sent in ``pieces`` pieces ``pace_s`` apart (a slow uplink)."""
    by_sha = {sha: payload[i * CHUNK : (i + 1) * CHUNK] for i, sha in enumerate(m.chunks)}

    async def chunk(request: web.Request) -> web.StreamResponse:
        data = by_sha[request.match_info["sha"]]
        reply = web.StreamResponse()
        reply.content_length = len(data)
        await reply.prepare(request)
        step = -(-len(data) // pieces)
        for at in range(0, len(data), step):
            if at:
                await asyncio.sleep(pace_s)  # the uplink's pace, not a wait for the test
            await reply.write(data[at : at + step])
        return reply

    async def manifest(_request: web.Request) -> web.Response:
        return web.json_response({"signed": m.signed()})

    async def have(_request: web.Request) -> web.Response:
        return web.json_response({"have": list(range(len(m.chunks)))})

    app = web.Application()
    app.add_routes(
        [
            web.get("/manifest/{d}", manifest),
            web.get("/have/{d}", have),
            web.get("/chunk/{sha}", chunk),
        ]
    )
    return app


async def _over_http(
    payload: bytes, hostile: bool, pieces: int, pace_s: float, config: SwarmConfig
) -> tuple[BaseException | None, float, int, str]:
    """Download ``payload`` over loopback HTTP from the origin, or only from a hostile peer
    (claims every chunk, sends half of each and falls silent) relaying its manifest; what it
    raised, how long it took, how many chunk requests the hostile peer took, and its URL."""
    m = _manifest(payload)
    origin, origin_url = await evil_peer.serve(_origin(m, payload, pieces, pace_s))
    half = evil_peer.app(origin_url, "half")
    evil, evil_url = await evil_peer.serve(half)
    client = DataClient(None, HttpLimits(request_timeout_s=0.2))  # cut after 0.4 s of silence
    source = DataPlaneSource(client, lambda: [evil_url if hostile else origin_url])
    t0, raised = time.monotonic(), None
    try:
        await asyncio.wait_for(download(m, source, _Sink(), _Counting(), config), 10)
    except (DownloadStalledError, TimeoutError) as exc:
        raised = exc
    finally:
        took = time.monotonic() - t0
        await client.close()
        await evil.cleanup()
        await origin.cleanup()
    return raised, took, half[evil_peer.STATS]["served"], evil_url


@pytest.mark.serial  # a timing bound: run alone
def test_a_peer_that_sends_half_of_every_chunk_then_nothing_stalls_the_download() -> None:
    """Over real HTTP: each request gets half its chunk and then silence; the transport cuts
    it (no byte for twice ``HttpLimits.request_timeout_s``), the chunk is asked again and
    gets the same half: not served, so the download stalls one ``stall_timeout_s`` after it
    began, naming the peer that claimed every chunk and served none."""
    config = SwarmConfig(stall_timeout_s=1.0, have_poll_s=0.05, request_timeout_s=5.0, seed=1)
    payload = random.Random(1).randbytes(3 * CHUNK)
    raised, took, served, hostile = asyncio.run(_over_http(payload, True, 1, 0.0, config))
    assert isinstance(raised, DownloadStalledError), raised
    assert took < 3.0
    assert raised.indices and set(raised.disowned) == raised.indices
    assert {p for peers in raised.disowned.values() for p in peers} == {hostile}
    assert served > len(raised.indices)  # asked again after the transport cut the first


def test_a_chunk_trickling_in_over_several_stall_timeouts_completes() -> None:
    """Over real HTTP: the only holder sends its one chunk in 8 pieces over 2.1 s, more than
    twice ``stall_timeout_s``: its bytes keep arriving, so no stall."""
    config = SwarmConfig(stall_timeout_s=0.8, have_poll_s=0.05, seed=1)
    payload = random.Random(2).randbytes(CHUNK)
    raised, took, _, _ = asyncio.run(_over_http(payload, False, 8, 0.3, config))
    assert raised is None, raised
    assert took >= 2.1


# ---------------------------------------------------------------- a rollout re-plans


async def _plans_around(tmp_path: Path, versions: list[dict[str, torch.Tensor]]) -> list:
    """A rollout knowing the trainer's manifests plans a path; then every artifact on it
    stalls once, and it plans again."""
    async with MemorySwarm(tmp_path) as swarm:
        trainer = await swarm.start_trainer()
        for tensors in versions:
            await swarm.publish(tensors)
        node = await swarm.node("r0")
        for m in trainer.store.manifests():
            node.store.put_manifest(m, trainer.store.manifest_bytes(m.digest) or b"")
        follower = Follower(node)
        first = [m.digest for m in follower._plan()]
        follower.stalled.update(first)
        return [first, [m.digest for m in follower._plan()], set(follower.stalled)]


@pytest.mark.parametrize("count", [1, 3])
def test_a_stalled_artifact_on_the_only_path_is_planned_again(
    tmp_path: Path, tiny_versions: list, count: int
) -> None:
    """Planning around stalled artifacts must not read "no artifact left" as "at the head":
    a rollout whose only way to the head stalled (a late joiner whose one other source of
    v0 served garbage) tries that way again, and the stalled artifacts get a fresh chance."""
    first, again, stalled = asyncio.run(_plans_around(tmp_path, tiny_versions[:count]))
    assert first and again == first and not stalled


async def _replan(
    tmp_path: Path, versions: list[dict[str, torch.Tensor]], hostile: str | None = None
) -> dict:
    """A trainer and a rollout on loopback; the trainer's copy of the v1 patch's first chunk
    is gone. With ``hostile`` (an ``evil_peer`` mode), the rollout also knows a hostile peer
    that claims every chunk of every artifact and serves none of them that way."""
    key = SigningKey.generate()
    policy = SwarmPolicy("stall", (key.public,))
    tcfg = trainer_config(tmp_path, p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    url = await trainer.start()
    evil, peers, extra = None, (url,), {}
    if hostile is not None:
        evil, evil_url = await evil_peer.serve(evil_peer.app(url, hostile))
        peers = (evil_url, url)
        extra = {"http": HttpLimits(request_timeout_s=0.5)}  # 1 s of silence cuts a transfer
    stalls = SwarmConfig(have_poll_s=0.05, stall_timeout_s=0.5)
    if hostile is not None:  # a request is asked again elsewhere after 0.25 s at first
        stalls = SwarmConfig(have_poll_s=0.05, stall_timeout_s=1.0, request_timeout_s=0.25)
    rcfg = rollout_config(tmp_path, key, url, peers=peers, download=stalls, p2p=False, **extra)
    rollout = Node(rcfg, policy, Store.open(rcfg.data_dir))
    await rollout.start()
    blocked: set[str] = set()
    serve = trainer.store.get_chunk

    def get_chunk(sha: str) -> bytes | None:  # the trainer's copy of one patch chunk is gone
        return None if sha in blocked else serve(sha)

    trainer.store.get_chunk = get_chunk  # type: ignore[method-assign]
    follower = Follower(rollout)
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    publisher = Publisher(
        trainer, key, PublishPolicy(anchor_every=1, catchup_spans=(), chunk_size=CHUNK), 10
    )
    try:
        await publisher.publish(versions[0])
        async with asyncio.timeout(60):
            while follower.state.version != 0:
                await follower.advanced.wait()
        t0 = time.monotonic()
        for m in await publisher.publish(versions[1]):
            if m.kind != SNAPSHOT:
                blocked.add(m.chunks[0])
        async with asyncio.timeout(60 if hostile is None else 15):
            while follower.state.version != 1:
                await follower.advanced.wait()
        took = time.monotonic() - t0
        kinds = [u.kind for u in follower.updates]
    finally:
        stop.set()
        try:  # a follower waiting on a download that never ends is cancelled
            await asyncio.wait_for(asyncio.shield(task), 10)
        except TimeoutError:
            task.cancel()
        await stop_follower_pair(stop, task, publisher, rollout, trainer)
        if evil is not None:
            await evil.cleanup()
    return {"kinds": kinds, "weights": follower.weights, "stalled": follower.stalled, "took": took}


def test_a_rollout_whose_patch_stalls_re_plans_through_the_anchor(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = asyncio.run(_replan(tmp_path, tiny_versions[:2]))
    assert out["kinds"] == [SNAPSHOT, SNAPSHOT]  # the patch stalled, the anchor came instead
    assert bit_equal(out["weights"], tiny_versions[1])
    assert state_hash(out["weights"]) == state_hash(tiny_versions[1])


@pytest.mark.serial  # a timing bound: run alone
@pytest.mark.parametrize("mode", ["silent", "half"])
def test_a_peer_claiming_every_chunk_and_serving_none_cannot_hold_a_rollout_back(
    tmp_path: Path, tiny_versions: list, mode: str
) -> None:
    """Real trainer and rollout over loopback HTTP, and a hostile peer that claims every chunk
    of every artifact, answering its chunk requests with nothing (``silent``) or half the
    bytes and then silence (``half``), and claiming them again all the time. The v1 patch's
    first chunk is held by nobody else: the patch stalls a ``stall_timeout_s`` (1 s) after
    it is asked for, whatever the claims, and the rollout reaches the head through the
    anchor."""
    out = asyncio.run(_replan(tmp_path, tiny_versions[:2], mode))
    assert out["kinds"] == [SNAPSHOT, SNAPSHOT]
    assert bit_equal(out["weights"], tiny_versions[1])
    assert out["took"] < 8.0
