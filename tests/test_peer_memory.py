"""What one download measured starts the next: the scheduler, the memory file, the node."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.fetch import fetch_payload
from node.runtime import MEMORY_FILE, Node
from p2p_sync.errors import PeerMemoryError
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import SwarmPolicy
from p2p_sync.peermemory import Measured, PeerMemory
from p2p_sync.swarm import (
    ChunkCorrupted,
    ChunkFailed,
    ChunkVerified,
    PeerHad,
    RequestChunk,
    SwarmConfig,
)
from tests.test_peers import _node, _publish

CHUNK = 128 * 1024
CONFIG = SwarmConfig(initial_requests_per_peer=2, max_requests_per_peer=32, request_bytes=0)


def _asked(memory: PeerMemory, peer: str = "p") -> int:
    s = memory.scheduler(100, CONFIG, (), CHUNK)
    return sum(
        isinstance(a, RequestChunk) for a in s.handle(PeerHad(peer, frozenset(range(100))), 0.0)
    )


def test_a_remembered_source_gets_its_bandwidth_delay_product_at_once() -> None:
    """100 MB/s at 40 ms is 31 chunks of 128 KiB in flight, plus one: asked with the first
    have-map, where a source measured by nobody gets ``initial_requests_per_peer``."""
    assert _asked(PeerMemory()) == 2
    memory = PeerMemory(peers={"p": Measured(100e6, 0.040)})
    assert _asked(memory) == 32
    assert _asked(memory, "q") == 2  # another peer: nothing known of it
    assert _asked(PeerMemory(peers={"p": Measured(1e6, 0.005)})) == 2  # a slow, near one


def _measured(banned: str | None = None) -> tuple[PeerMemory, float]:
    """A download that measured peers a and b (b failed once), banned ``banned`` if given."""
    memory = PeerMemory(limit=8)
    s = memory.scheduler(10, CONFIG, (), CHUNK)
    have = frozenset(range(10))
    asked = [a for p in "ab" for a in s.handle(PeerHad(p, have, rtt_s=0.02), 0.0)]
    reqs = [a for a in asked if isinstance(a, RequestChunk)]
    by = {p: [a.index for a in reqs if a.peer == p] for p in "ab"}
    s.handle(ChunkVerified("a", by["a"][0], CHUNK), 0.1)
    s.handle(ChunkFailed("b", by["b"][0]), 0.1)
    s.handle(ChunkVerified("b", by["b"][1], CHUNK), 0.2)
    if banned:
        s.handle(ChunkCorrupted(banned, by[banned][-1]), 0.3)
    memory.learn(s)
    assert s.typical_chunk_time is not None
    return memory, s.typical_chunk_time


def test_learning_keeps_rate_round_trip_and_chunk_time_but_not_failures() -> None:
    memory, chunk_time = _measured()
    assert set(memory.peers) == {"a", "b"}
    assert memory.peers["a"] == Measured(CHUNK / 0.1, 0.02)
    assert memory.peers["b"].rate == CHUNK / 0.2 and memory.peers["b"].rtt == 0.02
    assert (memory.chunk_bytes, memory.chunk_time) == (CHUNK, chunk_time)
    s = memory.scheduler(10, CONFIG, (), CHUNK)
    assert s.stats["b"].failures == 0 and s.stats["b"].throughput == CHUNK / 0.2
    assert s.typical_chunk_time == chunk_time  # time-outs start from it
    assert memory.scheduler(10, CONFIG, (), CHUNK * 2).typical_chunk_time is None  # other size


def test_a_banned_peer_is_forgotten() -> None:
    memory, _ = _measured(banned="a")
    assert set(memory.peers) == {"b"}


def test_the_memory_keeps_the_most_recently_measured_peers() -> None:
    """Limit 3, holding w, x, y: a download measures w again and z for the first time; x and
    y it never heard from. y is older than x: x goes."""
    memory = PeerMemory(limit=3, peers={p: Measured(1.0, None) for p in "wxy"})
    s = memory.scheduler(4, CONFIG, (), CHUNK)
    s.handle(PeerHad("w", frozenset(range(4)), rtt_s=0.01), 0.0)
    s.handle(PeerHad("z", frozenset(range(4)), rtt_s=0.01), 0.0)
    memory.learn(s)
    assert list(memory.peers) == ["y", "w", "z"]
    assert memory.peers["w"] == Measured(1.0, 0.01) and memory.peers["z"] == Measured(0.0, 0.01)


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=40),
        st.tuples(
            st.floats(0, 1e12, allow_nan=False),
            st.none() | st.floats(0, 100, allow_nan=False),
        ),
        max_size=20,
    ),
    st.integers(0, 1 << 24),
    st.none() | st.floats(0, 60, allow_nan=False),
)
def test_the_file_round_trips(peers, chunk_bytes: int, chunk_time: float | None) -> None:
    memory = PeerMemory(64, {p: Measured(r, t) for p, (r, t) in peers.items()}, chunk_bytes)
    memory.chunk_time = chunk_time
    back = PeerMemory.loads(memory.dumps(), 64)
    assert back == memory
    assert list(back.peers) == list(memory.peers)  # the order is the recency
    assert list(PeerMemory.loads(memory.dumps(), 5).peers) == list(memory.peers)[-5:]


def _doc(**change: object) -> bytes:
    doc = {"format": 1, "chunk_bytes": 0, "chunk_time": None, "peers": [["u", 1.0, 0.1]]}
    return json.dumps(doc | change).encode()


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not JSON"),
        (_doc()[:-9], "not JSON"),  # torn
        (_doc(format=2), "not format 1"),
        (b"[1]", "not format 1"),
        (_doc(chunk_bytes=-1), "chunk_bytes"),
        (_doc(chunk_time=math.inf), "chunk_time inf"),  # Python's json reads Infinity
        (_doc(chunk_time="1"), "chunk_time"),
        (_doc(peers={}), "peers is not a list"),
        (_doc(peers=[["u", 1.0]]), "is not [peer, rate, rtt]"),
        (_doc(peers=[["", 1.0, None]]), "peer name"),
        (_doc(peers=[["u" * 600, 1.0, None]]), "peer name"),
        (_doc(peers=[["u", -1.0, None]]), "rate -1.0"),
        (_doc(peers=[["u", 1.0, "x"]]), "rtt 'x'"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_file_this_node_did_not_write_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(PeerMemoryError, match=says.replace("[", r"\[").replace("]", r"\]")):
        PeerMemory.loads(data)


# ---------------------------------------------------------------- a node on loopback


async def _fetch(tmp_path: Path, **cfg: object) -> tuple[Node, str]:
    """A rollout that fetched one payload from a seed on loopback, both stopped since."""
    key = SigningKey.generate()
    policy = SwarmPolicy("memory", (key.public,))
    seed, rollout = _node(tmp_path, "seed", policy), _node(tmp_path, "rollout", policy, **cfg)
    m1, _ = _publish(seed, key, 1)
    seed_url = await seed.start()
    await rollout.start()
    try:
        rollout.add_peer(seed_url)
        await rollout.learner.learn(seed_url, [m1.digest])
        await asyncio.wait_for(fetch_payload(rollout, m1), 30)
    finally:
        await rollout.stop()
        await seed.stop()
    return rollout, seed_url


def _restarted(node: Node) -> Node:
    return Node(node.cfg, node.policy, node.store)  # the same data dir


def test_a_restarted_node_starts_from_what_its_last_download_measured(
    tmp_path: Path,
) -> None:
    rollout, seed_url = asyncio.run(_fetch(tmp_path))
    first = rollout.memory
    assert list(first.peers) == [seed_url]
    assert first.peers[seed_url].rate > 0 and first.peers[seed_url].rtt is not None
    assert first.chunk_bytes == 16 * 1024 and first.chunk_time is not None
    assert _restarted(rollout).memory == first


def test_no_memory_when_turned_off(tmp_path: Path) -> None:
    rollout, _ = asyncio.run(_fetch(tmp_path, download=SwarmConfig(remembered_peers=0)))
    assert not (tmp_path / "rollout" / MEMORY_FILE).exists()
    assert rollout.memory.peers == {} and _restarted(rollout).memory.peers == {}


def test_an_unreadable_memory_file_is_a_cold_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rollout, seed_url = asyncio.run(_fetch(tmp_path))
    path = tmp_path / "rollout" / MEMORY_FILE
    path.write_bytes(path.read_bytes()[:-5])  # torn
    with caplog.at_level(logging.WARNING, "p2psync.node"):
        again = _restarted(rollout)
    assert again.memory.peers == {} and again.memory.limit == 256
    said = [r.getMessage() for r in caplog.records]
    assert any("not JSON" in m and MEMORY_FILE in m for m in said), said
    assert again.store.payload(next(iter(again.store.manifests()))) is not None  # nothing lost
