"""The sans-I/O peer directory: learning, failures, bans, poll targets, and the eclipse bound
(unproven peers are capped and cannot displace peers that served verified bytes)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from node.config import NodeConfig
from node.fetch import fetch_payload
from node.runtime import Node
from p2p_sync.chunks import manifest_for
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import SNAPSHOT, Manifest, SwarmPolicy, sign
from p2p_sync.peers import (
    PeerAdded,
    PeerAnswered,
    PeerBanned,
    PeerDirectory,
    PeerDropped,
    PeerFailed,
    PeerLimits,
    PeerMisbehaved,
    PeerNamed,
    PeerServedVerified,
    Source,
)
from p2p_sync.store import Store

LIMITS = PeerLimits(max_peers=8, max_unproven=4, max_failures=3, poll_fanout=3)


def url(i: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{7000 + i}"


def directory(**kw) -> PeerDirectory:
    return PeerDirectory(LIMITS, me=url(0), **kw)


def test_a_named_peer_is_added_once_and_never_ourselves() -> None:
    d = directory()
    assert d.handle(PeerNamed(url(1))) == [PeerAdded(url(1))]
    assert d.handle(PeerNamed(url(1))) == []
    assert d.handle(PeerNamed(url(0))) == [] and url(0) not in d


def test_unproven_peers_are_capped() -> None:
    d = directory()
    for i in range(1, 10):
        d.handle(PeerNamed(url(i)))
    assert d.usable() == [url(i) for i in range(1, 5)]


def test_a_proven_peer_frees_an_unproven_slot_and_is_never_displaced() -> None:
    d = directory()
    for i in range(1, 5):
        d.handle(PeerNamed(url(i)))
    d.handle(PeerServedVerified(url(1)))
    assert d.handle(PeerNamed(url(5))) == [PeerAdded(url(5))]  # url(1) no longer counts
    for i in range(100, 200):  # a flood, every fake failing once
        d.handle(PeerNamed(url(i, "10.0.0.1")))
        d.handle(PeerFailed(url(i, "10.0.0.1")))
    assert url(1) in d and len(d.unproven()) <= LIMITS.max_unproven


def test_a_failing_unproven_peer_makes_room_for_a_newcomer_a_healthy_one_does_not() -> None:
    d = directory()
    for i in range(1, 5):
        d.handle(PeerNamed(url(i)))
    assert d.handle(PeerNamed(url(5))) == []  # full, nobody failing: refused
    d.handle(PeerFailed(url(3)))
    actions = d.handle(PeerNamed(url(5)))
    assert actions == [
        PeerDropped(url(3), "displaced while unproven and failing"),
        PeerAdded(url(5)),
    ]


def test_failures_in_a_row_drop_a_peer_and_an_answer_resets_the_count() -> None:
    d = directory()
    d.handle(PeerNamed(url(1)))
    d.handle(PeerFailed(url(1)))
    d.handle(PeerFailed(url(1)))
    d.handle(PeerAnswered(url(1)))
    assert d.failures(url(1)) == 0
    for _ in range(2):
        assert d.handle(PeerFailed(url(1))) == []
    assert d.handle(PeerFailed(url(1))) == [PeerDropped(url(1), "3 failures in a row")]
    assert d.handle(PeerNamed(url(1))) == [PeerAdded(url(1))]  # back when named again


def test_a_banned_peer_is_removed_once_and_never_added_again() -> None:
    d = directory()
    d.handle(PeerNamed(url(1)))
    assert d.handle(PeerMisbehaved(url(1), "bad chunk")) == [PeerBanned(url(1), "bad chunk")]
    assert d.handle(PeerMisbehaved(url(1), "again")) == []
    assert d.handle(PeerNamed(url(1), Source.GIVEN)) == [] and url(1) not in d


def test_given_peers_are_trusted_whoever_names_them_and_always_polled() -> None:
    d = directory(given=frozenset({url(1)}))
    for i in range(1, 6):
        d.handle(PeerNamed(url(i)))
    assert d.unproven() == [url(i) for i in range(2, 6)]
    rng = random.Random(1)
    rounds = [d.poll_targets(rng) for _ in range(30)]
    assert all(r[0] == url(1) and len(r) == len(set(r)) == 3 for r in rounds)
    assert len({u for r in rounds for u in r[1:]}) == 4  # rounds sample different peers


def test_the_table_never_exceeds_max_peers() -> None:
    d = directory(given=frozenset(url(i) for i in range(1, 20)))
    for i in range(1, 20):
        d.handle(PeerNamed(url(i)))
    assert len(d) == LIMITS.max_peers


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("nfavm"), st.integers(0, 15)), max_size=120))
def test_random_events_keep_the_bounds_and_never_drop_a_proven_peer_for_hearsay(script) -> None:
    d = directory(given=frozenset({url(0, "10.9.9.9")}))
    proven: set[str] = set()
    for op, i in script:
        u = url(i) if i < 8 else url(i, "10.0.0.1")
        event = {
            "n": PeerNamed(u),
            "f": PeerFailed(u),
            "a": PeerAnswered(u),
            "v": PeerServedVerified(u),
            "m": PeerMisbehaved(u, "x"),
        }[op]
        before = set(d.known)
        actions = d.handle(event)
        if op == "v" and u in d:
            proven.add(u)
        for a in actions:
            if isinstance(a, PeerDropped) and a.url in proven:
                assert op == "f", "a proven peer was displaced by hearsay"
                proven.discard(a.url)
            if isinstance(a, PeerBanned):
                proven.discard(a.url)
        assert len(d) <= LIMITS.max_peers and len(d.unproven()) <= LIMITS.max_unproven
        assert not d.banned & set(d.known)
        assert set(d.known) - before <= {u}


# ---------------------------------------------------------------- real nodes on loopback

FAKES = 300


def _node(tmp_path: Path, name: str, policy: SwarmPolicy, **kw) -> Node:
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path / name,
        trust=("x",),
        p2p=False,
        directory=PeerLimits(max_peers=16, max_unproven=6, poll_interval_s=0.05),
        **kw,
    )
    return Node(cfg, policy, Store.open(cfg.data_dir))


def _publish(node: Node, key: SigningKey, version: int) -> tuple[Manifest, bytes]:
    payload = random.Random(version).randbytes(70_000)  # distinct chunks
    m = manifest_for(
        payload,
        swarm=node.policy.swarm_id,
        version=version,
        kind=SNAPSHOT,
        target_state=f"{version:032x}",
        layout="bb" * 16,
        now=int(time.time()),
        chunk_size=16 * 1024,
    )
    node.store.put_payload(m, payload)
    node.store.put_manifest(m, sign(m, [key]))
    return m, payload


async def _flood(target: str) -> None:
    """Name fake peers to ``target`` the ways any HTTP client can: the X-P2PSync-Peer header on
    a request, and the url of an announcement."""
    async with aiohttp.ClientSession() as s:
        for i in range(FAKES):
            fake = f"http://127.0.0.1:{1 + i % 1000}"  # closed ports: connections are refused
            async with s.get(f"{target}/status", headers={"X-P2PSync-Peer": fake}) as r:
                await r.read()
            async with s.post(f"{target}/announce", json={"url": fake, "digests": []}) as r:
                await r.read()


async def _flooded_swarm(tmp_path: Path) -> tuple[bool, int, bytes, bytes]:
    key = SigningKey.generate()
    policy = SwarmPolicy("flood", (key.public,))
    seed, rollout = _node(tmp_path, "seed", policy), _node(tmp_path, "rollout", policy)
    m1, _ = _publish(seed, key, 1)
    seed_url = await seed.start()
    await rollout.start()
    try:
        rollout.add_peer(seed_url)  # hearsay at first ...
        await rollout.learner.learn(seed_url, [m1.digest])
        assert rollout.peering.directory.unproven() == [seed_url]  # (a manifest proves nothing)
        await asyncio.wait_for(fetch_payload(rollout, m1), 30)  # ... proven by its chunks
        assert rollout.peering.directory.unproven() == []
        await _flood(rollout.url)
        survived = seed_url in rollout.peers
        unproven = len(rollout.peering.directory.unproven())
        flood = asyncio.create_task(_flood(rollout.url))  # and it goes on while v2 spreads
        m2, payload = _publish(seed, key, 2)
        await seed.learner.announce(
            [m2.digest]
        )  # the push path: the seed learned the rollout's URL
        await asyncio.wait_for(_until_stored(rollout, m2.digest), 30)
        await asyncio.wait_for(fetch_payload(rollout, m2), 30)
        got = bytes(rollout.store.payload(m2) or b"")
        await asyncio.wait_for(flood, 60)
        survived = survived and seed_url in rollout.peers
    finally:
        await rollout.stop()
        await seed.stop()
    return survived, unproven, got, payload


async def _until_stored(node: Node, digest: str) -> None:
    while not node.store.has_manifest(digest):  # bounded by the caller's wait_for
        node.learner.new_info.clear()
        if node.store.has_manifest(digest):
            return
        await node.learner.new_info.wait()


def test_a_flood_of_fake_peers_cannot_push_out_a_proven_peer_and_the_node_converges(
    tmp_path: Path,
) -> None:
    survived, unproven, got, payload = asyncio.run(_flooded_swarm(tmp_path))
    assert survived, "the flood pushed out the peer that had served verified bytes"
    assert unproven <= 6
    assert got == payload
