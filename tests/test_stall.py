"""A chunk nobody can serve: the scheduler reports a stall, the driver stops with a clear error
instead of waiting for ever, and a rollout re-plans through an anchor.

The driver runs against an in-process chunk source (the same driver the node runs over HTTP);
the rollout test runs real trainer and rollout nodes on loopback.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from node.rollout import Follower
from node.runtime import Node
from node.trainer import Publisher, TrainerNode
from p2p_sync.chunks import manifest_for
from p2p_sync.errors import DownloadStalledError, PeerError
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import SNAPSHOT, Manifest, SwarmPolicy
from p2p_sync.statehash import state_hash
from p2p_sync.store import Store
from p2p_sync.swarm import (
    ChunkFailed,
    ChunkVerified,
    DownloadStalled,
    PeerHad,
    PeerLost,
    Scheduler,
    SwarmConfig,
    TimerFired,
)
from p2p_sync.transport.download import DataPlaneSource, Download, HaveCursor, Timed, download
from p2p_sync.versions import PublishPolicy
from tests.helpers import bit_equal, rollout_config, stop_follower_pair, trainer_config

CHUNK = 16 * 1024

# ---------------------------------------------------------------- the scheduler alone


def test_a_chunk_whose_only_holder_fails_it_stalls_once_after_the_timeout() -> None:
    s = Scheduler(2, SwarmConfig(stall_timeout_s=5.0))
    s.handle(PeerHad("a", frozenset({0, 1})), 0.0)
    s.handle(ChunkVerified("a", 0, 10), 1.0)
    assert s.handle(ChunkFailed("a", 1), 2.0) == []  # chunk 1 has no source from now on
    assert s.next_timer(2.0) == pytest.approx(7.0)
    assert not any(isinstance(a, DownloadStalled) for a in s.handle(TimerFired(), 6.9))
    stalled = [a for a in s.handle(TimerFired(), 7.0) if isinstance(a, DownloadStalled)]
    assert stalled == [DownloadStalled(frozenset({1}))]
    assert not any(isinstance(a, DownloadStalled) for a in s.handle(TimerFired(), 20.0))


def test_chunks_without_a_source_do_not_stall_while_others_keep_arriving() -> None:
    s = Scheduler(4, SwarmConfig(stall_timeout_s=5.0))
    s.handle(PeerHad("a", frozenset({0, 1, 2})), 0.0)
    for t, i in ((4.0, 0), (8.0, 1), (12.0, 2)):  # chunk 3 has no source all along
        actions = s.handle(ChunkVerified("a", i, 10), t)
        assert not any(isinstance(a, DownloadStalled) for a in actions)
    assert s.next_timer(12.0) == pytest.approx(17.0)
    assert s.handle(PeerHad("b", frozenset({3})), 16.0)  # a source appears: request it
    assert s.next_timer(16.0) is not None and s.next_timer(16.0) > 17.0  # timeout, no stall


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

    async def chunk(self, peer: str, m: Manifest, index: int) -> bytes:
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


# ---------------------------------------------------------------- a rollout re-plans


async def _replan(tmp_path: Path, versions: list[dict[str, torch.Tensor]]) -> dict:
    key = SigningKey.generate()
    policy = SwarmPolicy("stall", (key.public,))
    tcfg = trainer_config(tmp_path, p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    url = await trainer.start()
    stalls = SwarmConfig(have_poll_s=0.05, stall_timeout_s=0.5)
    rcfg = rollout_config(tmp_path, key, url, download=stalls, p2p=False)
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
        for m in await publisher.publish(versions[1]):
            if m.kind != SNAPSHOT:
                blocked.add(m.chunks[0])
        async with asyncio.timeout(60):
            while follower.state.version != 1:
                await follower.advanced.wait()
        kinds = [u.kind for u in follower.updates]
    finally:
        await stop_follower_pair(stop, task, publisher, rollout, trainer)
    return {"kinds": kinds, "weights": follower.weights, "stalled": follower.stalled}


def test_a_rollout_whose_patch_stalls_re_plans_through_the_anchor(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = asyncio.run(_replan(tmp_path, tiny_versions[:2]))
    assert out["kinds"] == [SNAPSHOT, SNAPSHOT]  # the patch stalled, the anchor came instead
    assert bit_equal(out["weights"], tiny_versions[1])
    assert state_hash(out["weights"]) == state_hash(tiny_versions[1])
