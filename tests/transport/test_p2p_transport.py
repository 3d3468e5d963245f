"""The libp2p host behind its asyncio bridge, in one process on loopback: discovery of data-plane
URLs from signed peer records, gossip, validation before forwarding, identity persistence,
clean shutdown (no thread or listening socket left behind)."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID

from p2p_sync.transport.identity import load_or_create_identity
from p2p_sync.transport.p2p import P2PHost, P2PSettings
from p2p_sync.trust.announce import Announcement, Decision, Verdict

TOPIC = "p2psync/test/announce"


class Peer:
    """A host plus what its judge saw and what it accepted."""

    def __init__(self, root: Path, name: str, member=None, **settings) -> None:
        self.seen: list[bytes] = []  # every message its judge was asked about
        self.accepted: list[bytes] = []
        self.urls: list[str] = []
        self.by_bootstrap: dict[str, bool] = {}  # each URL: signed by a --bootstrap peer?
        base = {
            "listen": "/ip4/127.0.0.1/tcp/0",
            "identity_path": root / f"{name}.key",
            "topic": TOPIC,
            "http_url": f"http://127.0.0.1:{_free_port()}",
        }
        self.http_url = base["http_url"]
        self.host = P2PHost(
            P2PSettings(**{**base, **settings}),
            self.judge,
            self.on_accept,
            self.on_url,
            member=member,  # a private swarm's credentials (``transport.p2p_gate``)
        )

    def on_url(self, url: str, bootstrap: bool) -> None:
        self.urls.append(url)
        self.by_bootstrap[url] = bootstrap

    def judge(self, data: bytes, known: Callable[[str], bool]) -> Decision:
        """Test rule: messages starting with b"good" are news, anything else an attack."""
        self.seen.append(data)
        if not data.startswith(b"good"):
            return Decision(Verdict.REJECT, reason="bad")
        digest = hashlib.sha256(data).hexdigest()
        return Decision(Verdict.ACCEPT, Announcement("00" * 32, 1, (digest,), 0))

    def on_accept(self, decision: Decision, sender: str | None, at_ms: int) -> None:
        assert decision.announcement is not None
        self.accepted.append(bytes.fromhex(decision.announcement.digests[0]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Bounded poll of a condition (never a bare sleep as synchronization)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def publish_until(peer: Peer, data: bytes, got: Callable[[], bool], timeout: float) -> None:
    """Publish (again) until delivered: the mesh forms a moment after the links come up."""
    deadline = time.monotonic() + timeout
    while not got():
        if time.monotonic() > deadline:
            raise AssertionError(f"{data!r} never delivered")
        await peer.host.publish(data)
        await until(lambda: got() or time.monotonic() > deadline, 1.0, "delivery")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if not t.name.startswith("asyncio_")}


@pytest.mark.serial  # a timing bound: run alone
def test_peers_find_each_others_urls_gossip_and_stop_cleanly(tmp_path: Path) -> None:
    async def scenario() -> None:
        before = _threads()
        boot = Peer(tmp_path, "boot")
        await boot.host.start()
        peers = [Peer(tmp_path, f"p{i}", bootstrap=(boot.host.addr,)) for i in range(3)]
        for p in peers:
            await p.host.start()
        everyone = {boot.http_url, *(p.http_url for p in peers)}
        await until(
            lambda: all(set(p.urls) == everyone - {p.http_url} for p in peers),
            30,
            "every peer to learn every other data-plane URL",
        )
        for p in peers:  # the record of the peer named by --bootstrap is told apart
            assert p.by_bootstrap == {u: u == boot.http_url for u in everyone - {p.http_url}}
        await publish_until(
            peers[0],
            b"good 1",
            lambda: all(_digest(b"good 1") in p.accepted for p in [boot, *peers[1:]]),
            30,
        )
        t0 = time.perf_counter()
        for _ in range(200):
            await boot.host.call(trio.sleep, 0)  # a round trip into the Trio thread and back
        per_call_us = (time.perf_counter() - t0) / 200 * 1e6
        print(f"bridge call: {per_call_us:.0f} us")
        assert per_call_us < 5000
        ports = [int(multiaddr.Multiaddr(p.host.addr).value_for_protocol("tcp")) for p in peers]
        for p in [boot, *peers]:
            await p.host.stop()
        assert _threads() == before  # the Trio threads and py-libp2p's sweeper threads are gone
        for port in ports:
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0  # listener closed

    asyncio.run(scenario())


def test_a_bootstrap_peer_that_comes_up_late_is_reached_within_seconds(tmp_path: Path) -> None:
    """The node dials its bootstrap address before anyone listens there (a bootstrap node
    restarting, a network not up yet). py-libp2p then refuses to dial that peer for 60 s; the
    node must reach it at its next tries, a second apart."""

    async def scenario() -> None:
        port = _free_port()
        key = load_or_create_identity(tmp_path / "boot.key")
        boot_id = str(ID.from_pubkey(key.public_key))
        a = Peer(tmp_path, "a", bootstrap=(f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}",))
        await a.host.start()
        await until(lambda: a.host.status()["lookups"] >= 1, 10, "A's first (failed) round")
        boot = Peer(tmp_path, "boot", listen=f"/ip4/127.0.0.1/tcp/{port}")
        await boot.host.start()
        await until(lambda: boot_id in a.host.connected_ids, 10, "A to reach its bootstrap")
        for p in (a, boot):
            await p.host.stop()

    asyncio.run(scenario())


def test_identity_key_persists_so_a_restart_keeps_the_peer_id(tmp_path: Path) -> None:
    async def scenario() -> None:
        first = Peer(tmp_path, "a")
        await first.host.start()
        await first.host.stop()
        again = Peer(tmp_path, "a")
        await again.host.start()
        await again.host.stop()
        other = Peer(tmp_path, "b")
        assert first.host.peer_id == again.host.peer_id != other.host.peer_id
        assert again.host.addr is not None and again.host.addr.endswith(
            f"/p2p/{first.host.peer_id}"
        )
        assert stat.S_IMODE((tmp_path / "a.key").stat().st_mode) == 0o600

    asyncio.run(scenario())


def test_rejected_message_is_not_forwarded_and_its_sender_is_blacklisted(tmp_path: Path) -> None:
    """E -- H -- W: leaves E and W link only to H. What H rejects never reaches W."""

    async def scenario() -> None:
        hub = Peer(tmp_path, "hub", max_rejects=2)
        await hub.host.start()
        evil, witness = (
            Peer(tmp_path, n, dht=False, bootstrap=(hub.host.addr,)) for n in ("evil", "witness")
        )
        await evil.host.start()
        await witness.host.start()
        try:
            await publish_until(evil, b"good 1", lambda: _digest(b"good 1") in witness.accepted, 30)
            await evil.host.publish(b"forged 1")
            await until(lambda: hub.host.status()["rejected"] == 1, 10, "the hub to reject")
            await publish_until(evil, b"good 2", lambda: _digest(b"good 2") in witness.accepted, 10)
            assert not [m for m in witness.seen if not m.startswith(b"good")]  # never forwarded
            assert hub.host.status()["blacklisted"] == 0  # one strike is not enough
            await evil.host.publish(b"forged 2")
            await until(lambda: hub.host.status()["blacklisted"] == 1, 10, "the blacklisting")
            assert not [m for m in witness.seen if not m.startswith(b"good")]
            assert witness.host.status()["rejected"] == 0
        finally:
            for p in (evil, witness, hub):
                await p.host.stop()

    asyncio.run(scenario())
