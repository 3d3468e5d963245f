"""The sans-I/O peer directory: learning, failures, bans, poll targets, and the eclipse bound
(unproven peers are capped and cannot displace peers that served verified bytes)."""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.errors import MalformedPeerUrlError
from p2p_sync.protocol.peers import (
    PeerAdded,
    PeerAnswered,
    PeerBack,
    PeerBanned,
    PeerDirectory,
    PeerDown,
    PeerDropped,
    PeerFailed,
    PeerLimits,
    PeerMisbehaved,
    PeerNamed,
    PeerRefused,
    PeerServedVerified,
    Source,
    peer_name,
)
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.fetch import fetch_payload
from p2p_sync.runtime.node import Node
from p2p_sync.store import Store
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from tests.helpers import publish_snapshot

LIMITS = PeerLimits(max_peers=8, max_unproven=4, max_failures=3, poll_fanout=3)


def url(i: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{7000 + i}"


def directory(**kw) -> PeerDirectory:
    return PeerDirectory(LIMITS, me={url(0)}, **kw)


def test_a_named_peer_is_added_once_and_never_ourselves() -> None:
    d = directory()
    assert d.handle(PeerNamed(url(1)), 0.0) == [PeerAdded(url(1))]
    assert d.handle(PeerNamed(url(1)), 0.0) == []
    assert d.handle(PeerNamed(url(0)), 0.0) == [] and url(0) not in d


def test_unproven_peers_are_capped() -> None:
    d = directory()
    for i in range(1, 10):
        d.handle(PeerNamed(url(i)), 0.0)
    assert d.usable() == [url(i) for i in range(1, 5)]


def test_a_proven_peer_frees_an_unproven_slot_and_is_never_displaced() -> None:
    d = directory()
    for i in range(1, 5):
        d.handle(PeerNamed(url(i)), 0.0)
    d.handle(PeerServedVerified(url(1)), 0.0)
    assert d.handle(PeerNamed(url(5)), 0.0) == [PeerAdded(url(5))]  # url(1) no longer counts
    for i in range(100, 200):  # a flood, every fake failing once
        d.handle(PeerNamed(url(i, "10.0.0.1")), 0.0)
        d.handle(PeerFailed(url(i, "10.0.0.1")), 0.0)
    assert url(1) in d and len(d.unproven()) <= LIMITS.max_unproven


def test_a_failing_unproven_peer_makes_room_for_a_newcomer_a_healthy_one_does_not() -> None:
    d = directory()
    for i in range(1, 5):
        d.handle(PeerNamed(url(i)), 0.0)
    assert d.handle(PeerNamed(url(5)), 0.0) == []  # full, nobody failing: refused
    d.handle(PeerFailed(url(3)), 0.0)
    actions = d.handle(PeerNamed(url(5)), 0.0)
    assert actions == [
        PeerDropped(url(3), "displaced while unproven and failing"),
        PeerAdded(url(5)),
    ]


def test_failures_in_a_row_drop_a_peer_and_an_answer_resets_the_count() -> None:
    d = directory()
    d.handle(PeerNamed(url(1)), 0.0)
    d.handle(PeerFailed(url(1)), 0.0)
    d.handle(PeerFailed(url(1)), 0.0)
    d.handle(PeerAnswered(url(1)), 0.0)
    assert d.failures(url(1)) == 0
    for _ in range(2):
        assert d.handle(PeerFailed(url(1)), 0.0) == []
    assert d.handle(PeerFailed(url(1)), 0.0) == [PeerDropped(url(1), "3 failures in a row")]
    assert d.handle(PeerNamed(url(1)), 0.0) == [PeerAdded(url(1))]  # back when named again


def test_a_banned_peer_is_removed_once_and_never_added_again() -> None:
    d = directory()
    d.handle(PeerNamed(url(1)), 0.0)
    assert d.handle(PeerMisbehaved(url(1), "bad chunk"), 0.0) == [PeerBanned(url(1), "bad chunk")]
    assert d.handle(PeerMisbehaved(url(1), "again"), 0.0) == []
    assert d.handle(PeerNamed(url(1), Source.GIVEN), 0.0) == [] and url(1) not in d


def test_given_peers_are_trusted_whoever_names_them_and_always_polled() -> None:
    d = directory(given=frozenset({url(1)}))
    for i in range(1, 6):
        d.handle(PeerNamed(url(i)), 0.0)
    assert d.unproven() == [url(i) for i in range(2, 6)]
    rng = random.Random(1)
    rounds = [d.poll_targets(rng, 0.0) for _ in range(30)]
    assert all(r[0] == url(1) and len(r) == len(set(r)) == 3 for r in rounds)
    assert len({u for r in rounds for u in r[1:]}) == 4  # rounds sample different peers


def test_the_table_never_exceeds_max_peers() -> None:
    d = directory(given=frozenset(url(i) for i in range(1, 20)))
    for i in range(1, 20):
        d.handle(PeerNamed(url(i)), 0.0)
    assert len(d) == LIMITS.max_peers


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("nrdcfavmg"), st.integers(0, 15), st.floats(0, 100)),
        max_size=120,
    )
)
def test_random_events_keep_the_bounds_and_never_drop_a_proven_or_given_peer(script) -> None:
    """Whatever happens, in any order: the table's bounds hold (one address included), a proven
    peer leaves only by failing or a ban, a given one only by a ban, a claim never enters."""
    limits = replace(LIMITS, max_per_address=3)
    d = PeerDirectory(limits, me={url(0)}, given=frozenset({url(0, "10.9.9.9")}))
    proven: set[str] = set()
    for op, i, now in script:
        host = "127.0.0.1" if i < 8 else "10.0.0.1"
        u = url(i) if i < 8 else url(i, host)
        event = {
            "n": PeerNamed(u),
            "r": PeerNamed(u, Source.REQUESTER, host),
            "d": PeerNamed(u, Source.DIALED, host),
            "c": PeerNamed(u, Source.CLAIM, host),
            "f": PeerFailed(u),
            "a": PeerAnswered(u),
            "v": PeerServedVerified(u),
            "m": PeerMisbehaved(u, "x"),
            "g": PeerNamed(url(0, "10.9.9.9"), Source.GIVEN),
        }[op]
        before = set(d.known)
        actions = d.handle(event, now)
        if op == "v" and u in d:
            proven.add(u)
        for a in actions:
            if isinstance(a, PeerDropped):
                assert a.url not in proven or op == "f", "a proven peer was displaced"
                assert a.url != url(0, "10.9.9.9"), "a given peer was dropped"
                proven.discard(a.url)
            if isinstance(a, PeerBanned):
                proven.discard(a.url)
        assert len(d) <= limits.max_peers and len(d.unproven()) <= limits.max_unproven
        for address in ("127.0.0.1", "10.0.0.1"):
            on_it = [x for x in d.unproven() if d.known[x].address == address]
            assert len(on_it) <= limits.max_per_address
        assert not d.banned & set(d.known)
        assert set(d.known) - before <= ({u} if op != "c" else set()) | {url(0, "10.9.9.9")}
        assert set(d.shared()) <= set(d.known)


# ---------------------------------------------------------------- given peers: never dropped


def test_a_given_peer_is_never_dropped_and_says_once_when_it_goes_down_and_comes_back() -> None:
    d = directory(given=frozenset({url(1)}))
    d.handle(PeerNamed(url(1), Source.GIVEN), 0.0)
    d.handle(PeerNamed(url(2)), 0.0)
    actions = [a for t in range(50) for a in d.handle(PeerFailed(url(1), "refused"), float(t))]
    assert actions == [PeerDown(url(1), "refused")]  # once, not one line per failed poll
    assert url(1) in d and d.failures(url(1)) == 50
    [status] = d.given_status(49.0)
    assert status["state"] == "down" and status["failures"] == 50 and status["error"] == "refused"
    assert 0 < status["retry_in_s"] <= LIMITS.retry_max_s
    assert d.handle(PeerAnswered(url(1)), 60.0) == [PeerBack(url(1))]
    assert d.handle(PeerAnswered(url(1)), 61.0) == []
    assert d.given_status(61.0)[0] | {"retry_in_s": 0} == {
        "url": url(1),
        "state": "up",
        "failures": 0,
        "retry_in_s": 0,
        "error": "",
    }
    for t in range(LIMITS.max_failures):  # a peer the operator did not give is dropped
        d.handle(PeerFailed(url(2)), float(t))
    assert url(2) not in d


def test_a_given_peer_is_polled_again_only_once_its_back_off_has_passed() -> None:
    d = directory(given=frozenset({url(1)}))
    d.handle(PeerNamed(url(1), Source.GIVEN), 0.0)
    rng = random.Random(0)
    d.handle(PeerFailed(url(1)), 10.0)
    retry_at = d.known[url(1)].retry_at
    assert url(1) not in d.poll_targets(rng, retry_at - 1e-6)
    assert url(1) in d.poll_targets(rng, retry_at)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32),
    st.floats(0.01, 5.0),
    st.floats(1.0, 100.0),
    st.integers(1, 200),
)
def test_the_back_off_doubles_up_to_its_cap_with_jitter_from_the_rng_passed_in(
    seed: int, low: float, factor: float, failures: int
) -> None:
    limits = PeerLimits(retry_min_s=low, retry_max_s=low * factor)
    delays = [
        PeerDirectory(limits, rng=random.Random(seed)).retry_delay(failures) for _ in range(2)
    ]
    cap = min(low * factor, low * 2.0 ** (failures - 1))
    assert delays[0] == delays[1]  # the jitter is the rng's: replayable
    assert cap / 2 <= delays[0] <= cap <= limits.retry_max_s
    jittered = {PeerDirectory(limits, rng=random.Random(s)).retry_delay(failures) for s in range(8)}
    assert len(jittered) > 1  # peers that lost the same peer do not all come back at once


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        ("http://127.0.0.1:8700", "http://127.0.0.1:8700"),
        ("http://Trainer.Example:8700/", "http://trainer.example:8700"),
        ("https://trainer.example", "https://trainer.example:443"),
        ("http://trainer", "http://trainer:80"),
        ("http://[::1]:8700", "http://[::1]:8700"),
        ("http://[0:0:0:0:0:ffff:7f00:1]:9", "http://127.0.0.1:9"),
        (f"p2p://12D3KooW{'A' * 44}", f"p2p://12D3KooW{'A' * 44}"),
    ],
)
def test_a_peer_url_is_normalised_to_scheme_host_and_port(raw: str, name: str) -> None:
    assert peer_name(raw) == name
    assert peer_name(name) == name


@pytest.mark.parametrize(
    "raw",
    [
        "file:///etc/passwd",
        "not-a-url",
        "http://127.0.0.1:18803/evil?x=",
        "http://127.0.0.1:18803/evil",
        "http://127.0.0.1:18803?x=1",
        "http://127.0.0.1:18803#top",
        "http://user:pw@127.0.0.1:18803",
        "ftp://127.0.0.1:21",
        "javascript:alert(1)",
        "http://127.0.0.1:0",
        "http://127.0.0.1:65536",
        "http://127.0.0.1:port",
        "http://:8700",
        "http://0.0.0.0:8700",
        "http://[::]:8700",
        "http://[fe80::1%25eth0]:8700",
        "http://224.0.0.1:8700",
        "http://127.1:8700",
        "http://2130706433:8700",
        "http://bad_host!:8700",
        "http://a b:8700",
        "p2p://not-a-peer-id",
        f"p2p://12D3KooW{'A' * 44}/path",
        "http://x" + "y" * 300 + ":1",
        "",
        42,
        None,
        ["http://127.0.0.1:1"],
    ],
)
def test_anything_else_is_refused(raw: object) -> None:
    with pytest.raises(MalformedPeerUrlError):
        peer_name(raw)
    d = directory()
    actions = d.handle(PeerNamed(raw, Source.HEARSAY), 0.0)  # type: ignore[arg-type]
    assert len(d) == 0 and all(isinstance(a, PeerRefused) for a in actions)


_HOSTS = st.one_of(
    st.ip_addresses(v=4).filter(
        lambda ip: not (ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255")
    ),
    st.from_regex(
        r"[a-z]([a-z0-9-]{0,18}[a-z0-9])?(\.[a-z]([a-z0-9-]{0,8}[a-z0-9])?){0,3}", fullmatch=True
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["http", "https", "HTTP"]), _HOSTS, st.integers(1, 65535), st.booleans())
def test_valid_urls_normalise_to_their_own_fixed_point(scheme, host, port, slash) -> None:
    raw = f"{scheme}://{str(host).upper()}:{port}{'/' if slash else ''}"
    name = peer_name(raw)
    assert name == f"{scheme.lower()}://{str(host).lower()}:{port}"
    assert peer_name(name) == name


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=80), st.from_regex(r"(https?|p2p|file)://[ -~]{0,40}")))
def test_any_text_is_a_normal_name_or_refused(raw: str) -> None:
    try:
        name = peer_name(raw)
    except MalformedPeerUrlError:
        return
    assert peer_name(name) == name
    assert re.fullmatch(
        r"https?://[a-z0-9._\-]+:\d{1,5}|https?://\[[0-9a-f:]+\]:\d{1,5}", name
    ) or (name.startswith("p2p://") and "/" not in name[6:])


# ---------------------------------------------------------------- admission and sharing


def test_a_name_nobody_vouched_for_takes_no_slot() -> None:
    d = directory()
    assert d.handle(PeerNamed(url(1), Source.CLAIM, "127.0.0.1"), 0.0) == []
    # a requester or a dial-back proves something only for its own address
    assert d.handle(PeerNamed(url(2, "10.0.0.9"), Source.REQUESTER, "10.0.0.1"), 0.0) == []
    assert d.handle(PeerNamed(url(3, "10.0.0.9"), Source.DIALED, "10.0.0.1"), 0.0) == []
    assert len(d) == 0
    assert d.handle(PeerNamed(url(2, "10.0.0.1"), Source.REQUESTER, "10.0.0.1"), 0.0) == [
        PeerAdded(url(2, "10.0.0.1"))
    ]


def test_one_address_holds_at_most_max_per_address_slots_and_newcomers_still_get_in() -> None:
    limits = PeerLimits(max_peers=16, max_unproven=8, max_per_address=3)
    d = PeerDirectory(limits)
    for i in range(200):  # a flood of requesters from one address
        d.handle(PeerNamed(url(i, "10.0.0.1"), Source.REQUESTER, "10.0.0.1"), 0.0)
        d.handle(PeerNamed(url(i, "10.0.0.1"), Source.DIALED, "10.0.0.1"), 0.0)
    for i in range(200):  # and from one IPv6 /64
        host = f"[2001:db8::{i:x}]"
        d.handle(PeerNamed(f"http://{host}:1", Source.DIALED, host), 0.0)
    assert len(d) == 6
    honest = url(1, "10.0.0.2")
    assert d.handle(PeerNamed(honest, Source.REQUESTER, "10.0.0.2"), 0.0) == [PeerAdded(honest)]
    for i in range(3):  # p2p:// names count against the address they came from
        d.handle(PeerNamed(f"p2p://12D3KooW{chr(65 + i) * 44}", Source.REQUESTER, "10.0.0.3"), 0.0)
    assert d.handle(PeerNamed(f"p2p://12D3KooW{'Z' * 44}", Source.REQUESTER, "10.0.0.3"), 0.0) == []
    d.handle(PeerFailed(url(0, "10.0.0.1")), 0.0)  # a failing one of that address makes room
    late = url(300, "10.0.0.1")
    assert d.handle(PeerNamed(late, Source.REQUESTER, "10.0.0.1"), 0.0) == [
        PeerDropped(url(0, "10.0.0.1"), "displaced while unproven and failing"),
        PeerAdded(late),
    ]


def test_peers_lists_only_given_proven_and_checked_names_while_they_answer() -> None:
    d = directory(given=frozenset({url(1)}))
    d.handle(PeerNamed(url(1), Source.GIVEN), 0.0)
    d.handle(PeerNamed(url(2), Source.HEARSAY), 0.0)  # listed by someone: not checked yet
    d.handle(PeerNamed(url(3), Source.REQUESTER, "127.0.0.1"), 0.0)  # its port: unchecked
    d.handle(PeerNamed(url(4), Source.DIALED, "127.0.0.1"), 0.0)
    assert d.shared() == [url(1), url(4)]
    d.handle(PeerAnswered(url(2)), 0.0)
    d.handle(PeerAnswered(url(3)), 0.0)
    assert d.shared() == [url(1), url(2), url(3), url(4)]
    d.handle(PeerFailed(url(4)), 0.0)
    d.handle(PeerFailed(url(1)), 0.0)
    assert d.shared() == [url(2), url(3)]  # not while they fail
    assert [d.vouches(url(i)) for i in range(1, 5)] == [True, False, False, False]
    d.handle(PeerServedVerified(url(3)), 0.0)
    assert d.vouches(url(3))  # proven: its /peers list is taken


def test_a_request_header_names_a_peer_only_with_upload_demand_or_a_libp2p_link(
    tmp_path: Path,
) -> None:
    cfg = NodeConfig(role="rollout", data_dir=tmp_path, trust=("x",), p2p=False)
    node = Node(cfg, SwarmPolicy("t", (SigningKey.generate().public,)), Store.open(tmp_path))
    linked, stranger = f"p2p://12D3KooW{'L' * 44}", f"p2p://12D3KooW{'S' * 44}"
    node.p2p = SimpleNamespace(connected_ids=[linked.removeprefix("p2p://")])
    try:
        node.view.requester("http://10.0.0.1:9000", "10.0.0.1", False)  # a header alone
        node.view.requester("http://10.0.0.9:9000", "10.0.0.1", True)  # a third party's name
        node.view.requester(stranger, "10.0.0.1", False)  # a peer id not linked to us
        assert node.peers == {}
        node.view.requester("http://10.0.0.1:9000", "10.0.0.1", True)  # fetched chunks
        node.view.requester(linked, "10.0.0.2", False)  # its key proved in libp2p's handshake
        assert {u: e.source for u, e in node.peers.items()} == {
            "http://10.0.0.1:9000": Source.REQUESTER,
            linked: Source.RECORD,
        }
    finally:
        node.p2p = None


def test_a_record_signed_by_a_bootstrap_peer_names_a_peer_whose_list_is_taken(
    tmp_path: Path,
) -> None:
    """The operator names a bootstrap by its key (``--bootstrap .../p2p/<id>``): the URL its
    signed record carries is given, so the peers it lists are taken. A node behind NAT is
    known to its bootstrap and nobody else: without this, nobody would ever find it."""
    cfg = NodeConfig(role="rollout", data_dir=tmp_path, trust=("x",), p2p=False)
    node = Node(cfg, SwarmPolicy("t", (SigningKey.generate().public,)), Store.open(tmp_path))

    async def records() -> None:
        node.learner.on_p2p_peer("http://10.0.0.1:9000", True)  # signed by a --bootstrap peer
        node.learner.on_p2p_peer("http://10.0.0.2:9000", False)  # signed by anyone else
        await node.learner.stop()  # the head questions it spawned: not sent

    asyncio.run(records())
    directory = node.peering.directory
    assert {u: e.source for u, e in node.peers.items()} == {
        "http://10.0.0.1:9000": Source.GIVEN,
        "http://10.0.0.2:9000": Source.RECORD,
    }
    assert directory.vouches("http://10.0.0.1:9000")
    assert not directory.vouches("http://10.0.0.2:9000")


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
    m1, _ = publish_snapshot(seed, key, 1)
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
        m2, payload = publish_snapshot(seed, key, 2)
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
