"""Nodes behind NAT: the reachability verdict from peers' dial-backs, the data plane over libp2p
streams (``p2p://`` peers), and what hostile peers can and cannot do with either. Real aiohttp
servers and real libp2p hosts on loopback; the netns tier (tests/processes/test_emulated.py) runs
them
behind real emulated NATs."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.peer.id import ID

from p2p_sync import Rollout, Trainer
from p2p_sync.errors import PeerError
from p2p_sync.protocol.reachability import Reachability, ReachabilityLimits, Verdict
from p2p_sync.runtime.config import ConfigError
from p2p_sync.runtime.configfile import load
from p2p_sync.transport import frames, streams
from p2p_sync.transport.messages import valid_peer_url
from p2p_sync.trust.keys import SigningKey, write_keypair
from p2p_sync.weights.workloads import Workload
from tests.helpers import bit_equal

# ---------------------------------------------------------------- framing (pure)

_text = st.text(st.characters(codec="utf-8"), max_size=40)


@given(
    method=st.sampled_from(["GET", "POST"]),
    path=_text.map(lambda t: "/" + t),
    query=st.dictionaries(_text, _text, max_size=4),
    peer=st.none() | _text,
    body=st.binary(max_size=200),
)
def test_a_request_frame_reads_back_as_written(method, path, query, peer, body) -> None:
    frame = frames.encode_request(method, path, query, peer, body)
    (n,) = struct.unpack(">I", frame[:4])
    head = frames.parse_request_header(frame[4 : 4 + n], max_body=200)
    assert (head["method"], head["path"], head["query"], head["peer"]) == (
        method,
        path,
        query,
        peer,
    )
    assert frame[4 + n :] == body and head["body"] == len(body)


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"method": "PUT", "path": "/x", "query": {}, "body": 0}, "method"),
        ({"method": "GET", "path": "x", "query": {}, "body": 0}, "path"),
        ({"method": "GET", "path": "/x", "query": {"a": 1}, "body": 0}, "query"),
        ({"method": "GET", "path": "/x", "query": {}, "peer": 3, "body": 0}, "peer"),
        ({"method": "GET", "path": "/x", "query": {}, "body": 10**9}, "body length"),
        ({"method": "GET", "path": "/x", "query": {}, "body": -1}, "body length"),
    ],
)
def test_a_malformed_request_header_is_refused_naming_the_field(doc, why) -> None:
    with pytest.raises(ValueError, match=why):
        frames.parse_request_header(json.dumps(doc).encode(), max_body=64 * 1024)


def test_p2p_urls_split_and_refuse_what_is_not_one() -> None:
    pid = "12D3KooWK5vggqznNioT6L4cMa5njSEfvegwGMBQHBo7Fu6u2B42"
    assert frames.split_url(f"p2p://{pid}/have/ab?known=3") == (pid, "/have/ab", {"known": "3"})
    assert valid_peer_url(frames.peer_url(pid))
    for bad in ("http://h:1/x", "p2p://0OIl/x", f"p2p:/{pid}/x", "p2p://"):
        with pytest.raises(PeerError):
            frames.split_url(bad)


def test_the_stream_pool_hands_out_only_young_usable_streams_and_keeps_a_few() -> None:
    import trio.testing

    async def scenario() -> None:
        pool = streams.StreamPool()
        assert all(pool.give_back("a", f"s{i}") for i in range(streams.POOL_PER_PEER))
        assert not pool.give_back("a", "one too many")
        assert pool.take("b") is None
        # the newest first; one that is not usable (a relayed stream once a hole is punched)
        # is dropped, not handed out later
        last = f"s{streams.POOL_PER_PEER - 1}"
        assert pool.take("a", lambda s: s != last) == f"s{streams.POOL_PER_PEER - 2}"
        assert pool.take("a") == f"s{streams.POOL_PER_PEER - 3}"
        pool.give_back("b", "old")
        await trio.sleep(streams.IDLE_S)  # trio's virtual clock: no wall time
        assert pool.take("b") is None and pool.take("a") is None  # idled out

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


LOW, HIGH = ID(b"\x00\x24" + b"\x01" * 34), ID(b"\x00\x24" + b"\x02" * 34)  # two peer IDs


@given(st.binary(min_size=1, max_size=40), st.binary(min_size=1, max_size=40))
def test_exactly_one_side_of_a_pair_drives_the_hole_punch(a: bytes, b: bytes) -> None:
    from p2p_sync.transport.relay import drives

    if a != b:
        assert drives(ID(a), ID(b)) != drives(ID(b), ID(a))
    else:
        assert not drives(ID(a), ID(b))  # nobody punches a hole to itself


class _Link:
    """A connection to the peer as py-libp2p shows it: relayed, or direct."""

    def __init__(self, relayed: bool) -> None:
        self.relayed = relayed

    def get_connection_type(self) -> object:
        from libp2p.connection_types import ConnectionType

        return ConnectionType.RELAYED if self.relayed else ConnectionType.DIRECT

    def get_transport_addresses(self) -> list:
        return []


class _Host:
    """A host whose connections to its one peer are ``links``."""

    def __init__(self, own: ID) -> None:
        self.own, self.links = own, [_Link(relayed=True)]

    def get_id(self) -> ID:
        return self.own

    def get_network(self) -> _Host:
        return self

    def get_connections(self, peer: object) -> list:
        return self.links


def _trying(monkeypatch: pytest.MonkeyPatch) -> list[tuple[ID, float]]:
    """py-libp2p's tries (and answers) made no-ops that record which host tried, when."""
    import trio
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    tried: list[tuple[ID, float]] = []

    async def attempt(self: DCUtRProtocol, peer_id: ID) -> bool:
        tried.append((self.host.get_id(), trio.current_time()))
        return False

    async def answer(self: DCUtRProtocol, stream: object) -> None:
        self.host.links.append(_Link(relayed=False))  # the peer's session punched through

    monkeypatch.setattr(DCUtRProtocol, "initiate_hole_punch", attempt)
    monkeypatch.setattr(DCUtRProtocol, "_handle_dcutr_stream", answer)
    return tried


def test_the_peer_with_the_higher_id_answers_and_starts_only_if_the_other_never_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two py-libp2p peers started together both drive, every 2 s from the same moment: two
    sessions at once, and each side's two dials from its one listen port collide. Ours: the
    lower ID drives; the higher one answers, counts the punch, and drives itself only after
    ``YIELD_S`` without a session from a peer that never drives."""
    import trio.testing

    from p2p_sync.transport import relay

    tried = _trying(monkeypatch)

    async def loop(puncher: relay.HolePuncher, seconds: float) -> None:
        for _ in range(int(seconds / 2)):  # py-libp2p's loop: every 2 s while relayed
            await puncher.initiate_hole_punch(LOW if puncher.host.get_id() == HIGH else HIGH)
            await trio.sleep(2.0)

    async def scenario() -> tuple[float, int]:
        low, high = relay.HolePuncher(_Host(LOW), 3.0), relay.HolePuncher(_Host(HIGH), 3.0)
        async with trio.open_nursery() as nursery:
            low._nursery = high._nursery = nursery
            nursery.start_soon(loop, low, 6.0)
            nursery.start_soon(loop, high, 30.0)
            await trio.sleep(5.0)
            assert [who for who, _ in tried] == [LOW] * 3  # at once, and every 2 s
            assert high.tried == 0  # the higher ID waits for the session
            stream = type("S", (), {"muxed_conn": type("C", (), {"peer_id": LOW})})()
            await high._handle_dcutr_stream(stream)  # LOW's session: a direct connection
            assert high.punched == 1
            high.host.links = [_Link(relayed=True)]  # the direct one drops: relayed again
            await trio.sleep(30.0)
            assert high.tried == 0  # LOW drives this pair: HIGH never starts
            passive = relay.HolePuncher(_Host(HIGH), 3.0)  # a peer that never drives
            passive._nursery = nursery
            start = trio.current_time()
            tried.clear()
            await loop(passive, 30.0)
            return start, passive.tried

    start, n = trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    assert n == len(tried) > 0 and {who for who, _ in tried} == {HIGH}
    first = tried[0][1] - start  # then every 2 s, as py-libp2p's loop asks
    assert relay.YIELD_S <= first <= relay.YIELD_S + 2.0, first


def test_a_peer_whose_hole_punch_tries_ran_out_gets_fresh_ones_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """py-libp2p tries a relayed peer 3 times, 2 s apart, then never again; a try that misses
    its moment on a busy CPU is not a NAT that defeats it, so the peer gets fresh rounds of
    tries, ever further apart, a bounded number of times."""
    import trio.testing
    from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol

    from p2p_sync.transport import relay

    class Relayed:  # the host: every connection to the peer goes through a relay
        def get_network(self) -> Relayed:
            return self

        def get_connections(self, peer: object) -> list:
            return []

        def get_id(self) -> ID:
            return LOW  # this side drives

    async def missed(self: DCUtRProtocol, peer_id: object) -> bool:  # py-libp2p's budget
        n = self._hole_punch_attempts.get(peer_id, 0)  # type: ignore[call-overload]
        if n < MAX_HOLE_PUNCH_ATTEMPTS:
            self._hole_punch_attempts[peer_id] = n + 1  # type: ignore[index]
        return False

    monkeypatch.setattr(DCUtRProtocol, "initiate_hole_punch", missed)

    async def scenario() -> list[float]:
        puncher = relay.HolePuncher(Relayed(), 3.0)
        tries: list[float] = []
        async with trio.open_nursery() as nursery:
            puncher._nursery = nursery
            for _ in range(100):  # py-libp2p's loop: every 2 s, skipping a peer out of tries
                if puncher._hole_punch_attempts.get(HIGH, 0) < MAX_HOLE_PUNCH_ATTEMPTS:
                    await puncher.initiate_hole_punch(HIGH)
                    tries.append(trio.current_time())
                await trio.sleep(2.0)
            nursery.cancel_scope.cancel()
        assert puncher.tried == len(tries) and puncher.punched == 0
        return tries

    tries = trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    rounds = [tries[i : i + 3] for i in range(0, len(tries), 3)]
    assert len(rounds) == 1 + relay.REARM_ROUNDS and all(len(r) == 3 for r in rounds)
    pauses = [b[0] - a[-1] for a, b in zip(rounds, rounds[1:], strict=False)]
    for n, pause in enumerate(pauses):  # REARM_S doubling, rounded up to the loop's 2 s tick
        # (a refill due at a tick lands before or after that tick's check: trio's order)
        assert relay.REARM_S * 2**n <= pause <= relay.REARM_S * 2**n + 2.0, pauses
    assert tries[-1] < 200  # and then no more, with 100 s of the loop left


# ---------------------------------------------------------------- the verdict (sans-I/O)


def test_one_dial_back_proves_reachable_two_failures_mean_behind_nat() -> None:
    r = Reachability(ReachabilityLimits(max_asks=2))
    assert r.to_ask(["a", "b", "c"], 0.0) == ["a", "b"]
    assert r.to_ask(["a", "b", "c"], 0.0) == []  # two questions pending: no more
    assert not r.answered("a", False, "1.2.3.4") and r.verdict is Verdict.UNKNOWN
    assert r.to_ask(["a", "b", "c"], 0.0) == ["c"]
    assert r.answered("c", False, "1.2.3.4") and r.verdict is Verdict.BEHIND_NAT
    assert r.observed == "1.2.3.4"
    assert r.answered("b", True, None) and r.verdict is Verdict.REACHABLE  # a success wins


def test_a_silent_peer_is_asked_again_only_after_retry_s() -> None:
    r = Reachability(ReachabilityLimits(retry_s=2.0))
    assert r.to_ask(["a"], 0.0) == ["a"]
    r.answered("a", None, None)
    assert r.to_ask(["a"], 1.0) == [] and r.to_ask(["a"], 2.5) == ["a"]


def test_a_lone_peer_saying_no_decides_once_nobody_else_is_left() -> None:
    r = Reachability()
    r.to_ask(["t"], 0.0)
    r.answered("t", False, "9.9.9.9")
    assert r.verdict is Verdict.UNKNOWN and not r.exhausted(["t", "new"])
    assert r.exhausted(["t"]) and r.verdict is Verdict.BEHIND_NAT


def test_a_new_round_after_recheck_s_can_change_the_verdict() -> None:
    r = Reachability(ReachabilityLimits(recheck_s=10.0, needed_noes=1))
    r.to_ask(["a"], 0.0)
    r.answered("a", True, None)
    assert r.to_ask(["b"], 5.0) == []  # decided this round
    assert r.to_ask(["b"], 11.0) == ["b"]
    assert r.answered("b", False, None) and r.verdict is Verdict.BEHIND_NAT


@pytest.mark.parametrize(("mode", "verdict"), [("public", "reachable"), ("private", "behind NAT")])
def test_the_operator_s_word_asks_nobody(mode: str, verdict: str) -> None:
    r = Reachability(ReachabilityLimits(mode=mode))
    assert r.verdict.value == verdict and r.to_ask(["a"], 0.0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([True, False, None])), max_size=40))
def test_verdicts_follow_the_answers(answers: list[tuple[int, bool | None]]) -> None:
    """Whatever peers answer: no more than max_asks questions pending, nobody asked twice in a
    round while pending, behind NAT never while this round has a success."""
    limits = ReachabilityLimits(max_asks=3, needed_noes=2)
    r, peers, pending, yes = Reachability(limits), [f"p{i}" for i in range(6)], set(), False
    for i, answer in answers:
        asked = r.to_ask(peers, 0.0)
        assert not pending & set(asked) and len(pending) + len(asked) <= limits.max_asks
        pending |= set(asked)
        peer = peers[i]
        if peer in pending:
            pending.discard(peer)
            r.answered(peer, answer, None)
            yes |= answer is True
        assert r.verdict is not Verdict.BEHIND_NAT or not yes
        assert r.verdict is Verdict.REACHABLE or not yes


# ---------------------------------------------------------------- real nodes on loopback


def _keyfile(tmp_path: Path) -> tuple[Path, str]:
    """A trainer key file and its public key's file, for ``trust``."""
    path = tmp_path / "trainer.key"
    return path, str(write_keypair(SigningKey.generate(), path))


async def _status(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/status") as resp:
        return await resp.json()


async def _until(check, what: str, timeout: float = 30.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.05)  # polling a condition, bounded by the timeout
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


FAST = {"download": {"have_poll_s": 0.05}, "directory": {"poll_interval_s": 0.2}}


def _slow_trainer(tmp_path: Path, mbps: float = 4.0) -> tuple[Trainer, str]:
    """A trainer alone too slow to serve everyone (rollouts must trade), and its public key."""
    keyfile, pub = _keyfile(tmp_path)
    http = {"max_upload_mbps": mbps}
    trainer = Trainer(
        key=keyfile,
        data_dir=tmp_path / "t",
        p2p=True,
        publish={"chunk_size": 16384},
        http=http,
        **FAST,
    )
    return trainer, pub


def _joining(trainer: Trainer, pub: str) -> dict:
    return {"trust": [pub], "peers": [trainer.url], "bootstrap": [trainer.multiaddr], **FAST}


async def _publish_all(
    trainer: Trainer, versions: list, rollouts: tuple[Rollout, ...], first: int = 0
) -> None:
    """Each version in turn (numbered from ``first``), once every rollout has the one before."""
    for v, weights in enumerate(versions, first):
        await trainer.apublish(weights)
        for r in rollouts:
            await _until(lambda r=r, v=v: _at(r, v), f"v{v}", 60)


async def _nat_swarm(tmp_path: Path, versions: list, channels: int = 64) -> dict:
    """A trainer, a rollout behind (declared) NAT and a public one taking at most
    ``channels`` reverse channels (on loopback the public one could reach the NATed one's
    HTTP port, its "LAN": no shortcuts here, see ``_lan_swarm``)."""
    trainer, pub = _slow_trainer(tmp_path, 4.0 if channels else 1.0)
    async with trainer:
        join = _joining(trainer, pub)
        nat = Rollout(data_dir=tmp_path / "n", reachability={"mode": "private"}, **join)
        reach = {"max_channels": channels, "lan": False}
        public = Rollout(data_dir=tmp_path / "p", reachability=reach, **join)
        async with nat:
            first = 0
            if not channels:  # the NATed node holds v0 before the public one joins, which
                await _publish_all(trainer, versions[:1], (nat,))  # then has a source far
                first = 1  # faster than the trainer's 1 Mbit/s: the NATed one, over streams
            async with public:
                if channels:  # versions go out once the NATed node's channel is up
                    await _until(lambda: _holds_a_channel(public), "the reverse channel", 30)
                else:  # once the public node knows it by its peer id (else it may never ask)
                    await _until(lambda: _knows(public, nat), "the NATed node's name", 30)
                    await _until(lambda: _at(public, 0), "v0 at the public node", 60)
                await _publish_all(trainer, versions[first:], (nat, public), first)
                return {
                    "nat": await _status(nat.url),
                    "public": await _status(public.url),
                    "trainer": await _status(trainer.url),
                    "weights": [nat.weights, public.weights],
                }


async def _holds_a_channel(public: Rollout) -> bool:
    return bool((await _status(public.url))["reverse"]["channels"])


async def _knows(a: Rollout, b: Rollout) -> bool:
    """Whether ``a`` lists ``b`` among its peers by the name ``b`` gives itself."""
    name = (await _status(b.url))["reachability"].get("name")
    return bool(name) and name in (await _status(a.url))["peers"]


async def _at(r: Rollout, v: int) -> bool:
    return r.version == v


def _named_by_peer_id(out: dict) -> None:
    nat, public, trainer = out["nat"], out["public"], out["trainer"]
    assert nat["reachability"]["verdict"] == "behind NAT"
    assert nat["reachability"]["name"] == f"p2p://{nat['p2p']['peer_id']}"
    assert public["reachability"]["verdict"] == "reachable"  # the trainer dialed it back
    assert trainer["reachability"]["verdict"] == "reachable"  # a rollout dialed it back
    assert nat["url"] not in trainer["peers"] and nat["url"] not in public["peers"]
    assert nat["reachability"]["name"] in public["peers"]


def test_a_node_behind_nat_serves_over_the_reverse_channel_it_opened(tmp_path: Path) -> None:
    versions = list(Workload("tiny", lr=3e-4, seed=3).versions(2))
    out = asyncio.run(_nat_swarm(tmp_path, versions))
    nat, public, trainer = out["nat"], out["public"], out["trainer"]
    _named_by_peer_id(out)
    assert nat["reverse"]["links"] == [public["url"]]  # the trainer takes no channels
    assert public["reverse"]["channels"] == [nat["p2p"]["peer_id"]]
    assert trainer["reverse"]["channels"] == [] and trainer["reverse"]["links"] == []
    assert nat["reverse"]["bytes_uploaded"] > 0  # its uploads went over the channel
    assert nat["bytes_uploaded"] >= nat["reverse"]["bytes_uploaded"]
    for weights in out["weights"]:
        assert bit_equal(weights, versions[-1])


def test_without_a_channel_a_node_behind_nat_serves_over_libp2p_streams(tmp_path: Path) -> None:
    versions = list(Workload("tiny", lr=3e-4, seed=3).versions(2))
    out = asyncio.run(_nat_swarm(tmp_path, versions, channels=0))
    nat, public = out["nat"], out["public"]
    _named_by_peer_id(out)
    assert public["reverse"]["channels"] == [] and nat["reverse"]["bytes_uploaded"] == 0
    assert nat["p2p"]["streams_bytes_uploaded"] > 0  # its uploads went over libp2p streams
    assert nat["bytes_uploaded"] >= nat["p2p"]["streams_bytes_uploaded"]
    for weights in out["weights"]:
        assert bit_equal(weights, versions[-1])


async def _lan_swarm(tmp_path: Path, versions: list) -> dict:
    """A slow trainer and two rollouts behind (declared) NAT on one network (loopback): they
    meet over a direct libp2p connection and must trade to finish in time."""
    trainer, pub = _slow_trainer(tmp_path)
    async with trainer:
        join = _joining(trainer, pub) | {"reachability": {"mode": "private"}}
        a, b = Rollout(data_dir=tmp_path / "a", **join), Rollout(data_dir=tmp_path / "b", **join)
        async with a, b:
            await _publish_all(trainer, versions, (a, b))
            return {
                "rollouts": [await _status(r.url) for r in (a, b)],
                "weights": [a.weights, b.weights],
            }


def test_nodes_behind_one_nat_trade_over_plain_http_on_their_network(tmp_path: Path) -> None:
    versions = list(Workload("tiny", lr=3e-4, seed=4).versions(3))
    out = asyncio.run(_lan_swarm(tmp_path, versions))
    a, b = out["rollouts"]
    for me, other in ((a, b), (b, a)):
        assert me["reachability"]["name"] == f"p2p://{me['p2p']['peer_id']}"  # behind NAT
        # a node that fetched nothing from the other over libp2p had no reason to look
        assert me["lan"]["routes"] in ({}, {other["reachability"]["name"]: other["url"]})
    assert a["lan"]["routes"] or b["lan"]["routes"]
    got = sum(r["lan"]["bytes_downloaded"] for r in (a, b))
    over_http = sum(
        r["bytes_uploaded"] - r["p2p"]["streams_bytes_uploaded"] - r["reverse"]["bytes_uploaded"]
        for r in (a, b)
    )
    assert 0 < got <= over_http  # each counts what it sent whole / received whole
    for weights in out["weights"]:
        assert bit_equal(weights, versions[-1])


# ---------------------------------------------------------------- hostile dial-back requests


async def _dial_back_refusals(tmp_path: Path) -> dict:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    port = silent.getsockname()[1]
    limits = {"max_concurrent": 1, "dial_timeout_s": 3.0}
    async with Trainer(
        key=_keyfile(tmp_path)[0], data_dir=tmp_path / "t", reachability=limits
    ) as trainer:
        async with aiohttp.ClientSession() as s:

            async def ask(doc: object) -> tuple[int, object]:
                async with s.post(f"{trainer.url}/dialback", json=doc) as resp:
                    body = await resp.read()
                    return resp.status, json.loads(body) if resp.status == 200 else body

            nonce = "ab" * 16
            out = {
                "third party": await ask({"url": "http://127.0.0.2:9", "nonce": nonce}),
                "bad nonce": await ask({"url": f"http://127.0.0.1:{port}", "nonce": "x"}),
                "not http": await ask({"url": "p2p://12D3KooWabc", "nonce": nonce}),
                "not an object": await ask([1, 2]),
            }
            hang = asyncio.ensure_future(ask({"url": f"http://127.0.0.1:{port}", "nonce": nonce}))
            await asyncio.to_thread(silent.accept)  # the first dial-back is in progress
            out["busy"] = await ask({"url": f"http://127.0.0.1:{port}", "nonce": nonce})
            out["hung"] = await hang
            async with s.get(f"{trainer.url}/dialback/{nonce}") as resp:
                out["unissued nonce"] = resp.status
    silent.close()
    return out


def test_dial_back_requests_never_reach_a_third_party_and_are_bounded(tmp_path: Path) -> None:
    out = asyncio.run(_dial_back_refusals(tmp_path))
    status, doc = out["third party"]
    assert status == 200 and doc["reachable"] is False and doc["observed"] == "127.0.0.1"
    assert "not the address" in doc["why"]
    assert out["bad nonce"][0] == 400 and b"nonce" in out["bad nonce"][1]
    assert out["not http"][0] == 400 and out["not an object"][0] == 400
    assert out["busy"][1]["busy"] is True and out["busy"][1]["reachable"] is False
    assert out["hung"][1]["reachable"] is False and "no answer" in out["hung"][1]["why"]
    assert out["unissued nonce"] == 404


# ---------------------------------------------------------------- hostile streams


async def _garbage_streams(tmp_path: Path) -> dict:
    import trio

    keyfile, pub = _keyfile(tmp_path)
    async with Trainer(key=keyfile, data_dir=tmp_path / "t", p2p=True) as trainer:
        async with Rollout(
            data_dir=tmp_path / "r", trust=[pub], bootstrap=[trainer.multiaddr]
        ) as rollout:
            host, target = rollout.node.p2p, trainer.node.p2p.peer_id

            async def send(libp2p_host: object, raw: bytes) -> bytes:
                from libp2p.peer.id import ID

                stream = await libp2p_host.new_stream(ID.from_base58(target), [streams.PROTOCOL])
                await stream.write(raw)
                await stream.close_write()
                got = b""
                with trio.move_on_after(5):
                    try:
                        while piece := await stream.read(65536):
                            got += piece
                    except Exception:  # reset or EOF: what the server did is what we got
                        pass
                return got

            huge = struct.pack(">I", 10**6) + b"{}"
            out = {
                "huge header": await host.with_host(send, huge),
                "garbage": await host.with_host(send, struct.pack(">I", 5) + b"nope!"),
                "bad route": await host.with_host(
                    send, frames.encode_request("GET", "/nope", {}, None, b"")
                ),
            }
            client = rollout.node.client
            out["status"] = await client.get_json(f"p2p://{target}/status")
            with pytest.raises(PeerError, match="404"):
                await client.get_bytes(f"p2p://{target}/chunk/{'ab' * 32}")
            return out


def test_malformed_streams_get_nothing_and_the_node_keeps_serving(tmp_path: Path) -> None:
    out = asyncio.run(_garbage_streams(tmp_path))
    assert out["huge header"] == b"" and out["garbage"] == b""  # reset before the router
    n = struct.unpack(">I", out["bad route"][:4])[0]
    assert json.loads(out["bad route"][4 : 4 + n])["status"] == 404  # the router's answer
    assert out["status"]["role"] == "trainer"  # served over a stream afterwards


# ---------------------------------------------------------------- settings


def test_a_bad_reachability_mode_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match="reachability.mode: 'sometimes' is not one of auto"):
        load(None, {"role": "rollout", "trust": ["x"], "reachability.mode": "sometimes"})


# ---------------------------------------------------------------- relays


async def _relayed_swarm(tmp_path: Path, versions: list) -> dict:
    """A public trainer offering relay within tight limits, two NATed rollouts nobody can
    dial (their libp2p addresses are advertised at an unroutable host)."""
    keyfile, pub = _keyfile(tmp_path)
    fast = {"download": {"have_poll_s": 0.05}, "directory": {"poll_interval_s": 0.2}}
    relay = {"mbps": 2.0, "max_reservations": 1}
    async with Trainer(
        key=keyfile,
        data_dir=tmp_path / "t",
        p2p=True,
        publish={"chunk_size": 16384},
        http={"max_upload_mbps": 2.0},
        relay=relay,
        libp2p={"refresh_s": 1.0},
        **fast,
    ) as trainer:
        join = {
            "trust": [pub],
            "peers": [trainer.url],
            "bootstrap": [trainer.multiaddr],
            "advertise_host": "192.0.2.1",  # TEST-NET-1: never routed
            "reachability": {"mode": "private"},
            "libp2p": {"refresh_s": 1.0},
            **fast,
        }
        a, b = Rollout(data_dir=tmp_path / "a", **join), Rollout(data_dir=tmp_path / "b", **join)
        async with a, b:
            await _until(lambda: _reserved([a, b]), "a relay reservation", 30)
            started = asyncio.get_running_loop().time()
            # what it relayed while the reservation was made counts against no window here
            before = trainer.node.p2p.status()["relayed_bytes"]
            for v, weights in enumerate(versions):
                await trainer.apublish(weights)
                for r in (a, b):
                    await _until(lambda r=r, v=v: _at(r, v), f"v{v}", 90)
            elapsed = asyncio.get_running_loop().time() - started
            return {
                "trainer": trainer.node.p2p.status(),
                "rollouts": [r.node.p2p.status() for r in (a, b)],
                "elapsed": elapsed,
                "relayed_in_window": trainer.node.p2p.status()["relayed_bytes"] - before,
                "weights": [a.weights, b.weights],
            }


async def _reserved(rollouts: list[Rollout]) -> bool:
    return any(r.node.p2p.status()["relay_reservations"] for r in rollouts)


def test_nated_nodes_trade_through_a_public_relay_within_its_limits(tmp_path: Path) -> None:
    versions = list(Workload("tiny", lr=3e-4, seed=5).versions(2))
    out = asyncio.run(_relayed_swarm(tmp_path, versions))
    relay, rollouts = out["trainer"], out["rollouts"]
    assert relay["relay_offered"] and relay["relayed_bytes"] > 0
    assert sum(r["relay_reservations"] for r in rollouts) == 1  # max_reservations = 1
    assert sum(r["streams_bytes_uploaded"] for r in rollouts) > 0
    budget = 2.0e6 / 8 * out["elapsed"] + 2.0e6 / 8 / 20 + 64 * 1024  # rate * time + burst
    assert out["relayed_in_window"] <= budget
    for weights in out["weights"]:
        assert bit_equal(weights, versions[-1])


# ---------------------------------------------------------------- download order


async def _source_order(tmp_path: Path) -> list[str]:
    from p2p_sync.protocol.peers import Source
    from p2p_sync.runtime.fetch import _NodeSource
    from tests.nodebase import MemorySwarm

    nat = [f"p2p://12D3KooW{c * 44}" for c in "ABC"]
    public = [f"http://p{i}.mem:9{i}" for i in range(6)]
    async with MemorySwarm(tmp_path) as swarm:
        node = await swarm.node("r0", peers=("http://given.mem:1",))
        for url in [*public[:3], *nat, *public[3:]]:
            node.add_peer(url, Source.HEARSAY)
        order = _NodeSource(node, "ab" * 32).peers()
        assert order == _NodeSource(node, "ab" * 32).peers()  # the early feeds' order
        assert order == node.learner.follow_order("ab" * 32)
        return order


def test_a_download_follows_trusted_peers_then_peers_behind_nat_then_the_rest(
    tmp_path: Path,
) -> None:
    order = asyncio.run(_source_order(tmp_path))
    assert order[0] == "http://given.mem:1"
    assert all(u.startswith("p2p://") for u in order[1:4])
    assert all(u.startswith("http://p") for u in order[4:]) and len(order) == 10


async def _ask_a_nated_node(tmp_path: Path) -> dict:
    keyfile, pub = _keyfile(tmp_path)
    async with Trainer(key=keyfile, data_dir=tmp_path / "t") as trainer:
        async with Rollout(
            data_dir=tmp_path / "r",
            trust=[pub],
            peers=[trainer.url],
            reachability={"mode": "private"},
        ) as nated:
            async with aiohttp.ClientSession() as s:
                doc = {"url": trainer.url, "nonce": "cd" * 16}
                async with s.post(f"{nated.url}/dialback", json=doc) as resp:
                    return await resp.json()


def test_a_node_behind_nat_does_not_vouch_for_whoever_reached_it_on_its_lan(
    tmp_path: Path,
) -> None:
    """Nobody outside can dial a NATed node, so a question that reached it directly came from
    its own LAN, where its dial-back would succeed and prove nothing about the outside."""
    answer = asyncio.run(_ask_a_nated_node(tmp_path))
    assert answer["reachable"] is False and answer["busy"] is True
    assert "behind NAT" in answer["why"]
