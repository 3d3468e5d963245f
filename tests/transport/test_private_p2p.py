"""A private swarm's libp2p hosts on loopback, attacked: a non-member that dials a member gets
no identify record, no Kademlia answer, no gossip and no relay slot, and is disconnected and
kept out; an impostor (another identity's admission) and an expired member are refused; a
member revoked while connected is disconnected; a member uses no non-member relay. Members
meanwhile find each other and gossip as in an open swarm (``transport.p2p_gate``)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.identity.identify.identify import ID as IDENTIFY
from libp2p.kad_dht.common import PROTOCOL_ID as KAD
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
from libp2p.utils.varint import encode_varint_prefixed

from p2p_sync.transport.p2p_gate import MemberCredentials
from p2p_sync.transport.tls import SwarmTls, identity_key
from p2p_sync.trust import admissions
from p2p_sync.trust.membership import Membership, MembershipLimits
from tests.privateswarm import Identity, Swarm, raw_public
from tests.transport.test_p2p_transport import Peer, publish_until, until

LIMITS = MembershipLimits(admission_timeout_s=1.0)  # a stranger is cut off within a second
DEADLINE_S = 20.0


def _admission(swarm: Swarm, root: Path, name: str, at: float | None = None) -> Identity:
    """The identity key a host named ``name`` will load, and an admission for it."""
    key = identity_key(root / f"{name}.key")  # created where ``Peer`` looks for it
    when = swarm.now if at is None else at
    return Identity(key, admissions.admit(swarm.admin, swarm.ca, raw_public(key), when, 1.0))


def _member(swarm: Swarm, root: Path, name: str, **settings: Any) -> tuple[Peer, SwarmTls]:
    """A member host whose credentials come from its files (the revocation list re-read
    when it changes, as a node's)."""
    identity = _admission(swarm, root, name)
    tls = SwarmTls.load(
        swarm.files(root / f"{name}-files", identity), identity.key, time.time(), LIMITS
    )
    credentials = MemberCredentials(tls.membership, tls.admission, tls.refresh)
    return Peer(root, name, member=credentials, **settings), tls


def _showing(swarm: Swarm, root: Path, name: str, admission: bytes, **settings: Any) -> Peer:
    """A host that shows ``admission`` as its own (whatever identity it binds)."""
    membership = Membership(swarm.ca, swarm.crl, time.time(), LIMITS)
    return Peer(root, name, member=MemberCredentials(membership, admission), **settings)


def _membership(peer: Peer) -> dict[str, Any]:
    return peer.host.status()["membership"]


def _refused(peer: Peer, reason: str) -> bool:
    return _membership(peer)["refused_by"].get(reason, 0) >= 1


async def _probe(host: Any, target: str) -> dict[str, bytes]:
    """Trio side: dial ``target``, then at once ask it for its identify record, a Kademlia
    FIND_NODE answer and a relay reservation, all together; what each stream returned."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(target))
    await host.connect(info)
    find = Message(type=Message.MessageType.FIND_NODE, key=host.get_id().to_bytes())
    reserve = b"\x08\x00"  # a HopMessage of type RESERVE
    asks = {IDENTIFY: b"", KAD: encode_varint_prefixed(find.SerializeToString())}
    asks[HOP] = encode_varint_prefixed(reserve)
    got: dict[str, bytes] = {}

    async def ask(protocol: str) -> None:
        got[protocol] = b""
        with trio.move_on_after(5.0):
            try:
                stream = await host.new_stream(info.peer_id, [protocol])
                if asks[protocol]:
                    await stream.write(asks[protocol])
                got[protocol] = await stream.read(4096)
            except Exception:  # reset: nothing came
                pass

    async with trio.open_nursery() as nursery:
        for protocol in asks:
            nursery.start_soon(ask, protocol)
    return got


async def _stop(*peers: Peer) -> None:
    for p in peers:
        await p.host.stop()


def test_a_non_member_gets_no_record_dht_answer_or_relay_slot_and_is_kept_out(
    tmp_path: Path,
) -> None:
    """The same questions from a member (the control) are answered."""
    swarm = Swarm()

    async def scenario() -> None:
        m, _ = _member(swarm, tmp_path, "m")
        b, _ = _member(swarm, tmp_path, "b")
        stranger = Peer(tmp_path, "stranger")  # an open swarm's host: shows no admission
        await m.host.start()
        for p in (b, stranger):
            await p.host.start()
        try:
            answered = await b.host.with_host(_probe, m.host.addr)
            t0 = time.monotonic()
            refused = await stranger.host.with_host(_probe, m.host.addr)
            print(f"stranger's streams ended after {time.monotonic() - t0:.2f} s")
            await until(lambda: _refused(m, "NotAMemberError"), DEADLINE_S, "the refusal")
            again = await stranger.host.with_host(_probe_quietly, m.host.addr)
            status = m.host.status()
        finally:
            await _stop(stranger, b, m)
        assert all(answered.values()), answered  # a member is answered on each
        assert refused == {IDENTIFY: b"", KAD: b"", HOP: b""}
        assert again == "refused"  # kept out: the next connection does not come up
        assert status["membership"]["members"] == 1 and status["membership"]["admitted"] >= 1

    asyncio.run(scenario())


async def _probe_quietly(host: Any, target: str) -> str:
    """Trio side: whether a new connection to ``target`` comes up (``refused`` if not)."""
    info = info_from_p2p_addr(multiaddr.Multiaddr(target))
    host.get_network().unblock_peer(info.peer_id)
    try:
        with trio.fail_after(5.0):
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [IDENTIFY])
            return "answered" if await stream.read(4096) else "refused"
    except Exception:
        return "refused"


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_members_gossip_while_a_bootstrapping_non_member_hears_nothing(tmp_path: Path) -> None:
    swarm = Swarm()

    async def scenario() -> None:
        m, _ = _member(swarm, tmp_path, "m")
        await m.host.start()
        b, _ = _member(swarm, tmp_path, "b", bootstrap=(m.host.addr,))
        stranger = Peer(tmp_path, "stranger", bootstrap=(m.host.addr,))
        for p in (b, stranger):
            await p.host.start()
        try:
            await until(lambda: b.urls == [m.http_url], DEADLINE_S, "b to learn m's URL")
            await until(lambda: _refused(m, "NotAMemberError"), DEADLINE_S, "the refusal")
            await publish_until(m, b"good 1", lambda: _digest(b"good 1") in b.accepted, 20)
            await publish_until(b, b"good 2", lambda: _digest(b"good 2") in m.accepted, 20)
            await until(lambda: m.host.peer_id not in stranger.host.connected_ids, 5, "cut")
        finally:
            await _stop(stranger, b, m)
        assert stranger.seen == [] and stranger.urls == []  # no gossip, no record
        assert m.urls == [b.http_url]  # the stranger's URL is not taken either

    asyncio.run(scenario())


def test_an_impostor_and_an_expired_member_are_refused(tmp_path: Path) -> None:
    """One host shows a member's admission copied (its own identity is another); one shows
    its own admission, expired a day ago."""
    swarm = Swarm()

    async def scenario() -> dict[str, Any]:
        m, _ = _member(swarm, tmp_path, "m")
        await m.host.start()
        victim = _admission(swarm, tmp_path, "victim")  # a member's, never running
        impostor = _showing(swarm, tmp_path, "impostor", victim.admission, bootstrap=(m.host.addr,))
        stale = _admission(swarm, tmp_path, "expired", at=swarm.now - 2 * 86400)
        expired = _showing(swarm, tmp_path, "expired", stale.admission, bootstrap=(m.host.addr,))
        for p in (impostor, expired):
            await p.host.start()
        try:
            for reason in ("ImpostorError", "ExpiredAdmissionError"):
                await until(lambda r=reason: _refused(m, r), DEADLINE_S, reason)
            return {"status": m.host.status(), "urls": impostor.urls + expired.urls}
        finally:
            await _stop(impostor, expired, m)

    out = asyncio.run(scenario())
    assert out["status"]["membership"]["members"] == 0  # neither got in
    assert out["urls"] == []  # no identify answer: m's record (with its URL) withheld


def test_a_member_revoked_while_connected_is_disconnected_and_kept_out(tmp_path: Path) -> None:
    swarm = Swarm()

    async def scenario() -> None:
        m, m_tls = _member(swarm, tmp_path, "m")
        await m.host.start()
        b, _ = _member(swarm, tmp_path, "b", bootstrap=(m.host.addr,))
        c, c_tls = _member(swarm, tmp_path, "c", bootstrap=(m.host.addr,))
        for p in (b, c):
            await p.host.start()
        try:
            await until(lambda: _membership(m)["members"] == 2, DEADLINE_S, "both admitted")
            await publish_until(m, b"good 1", lambda: _digest(b"good 1") in b.accepted, 20)
            member_b = Identity(identity_key(tmp_path / "b.key"), b"")
            member_b.admission = (tmp_path / "b-files" / "admission.pem").read_bytes()
            crl = swarm.revoke(member_b)  # the admin revokes b and hands the list out
            for tls in (m_tls, c_tls):
                tls.files.revocations.write_bytes(crl)
            for p in (m, c):
                await until(lambda p=p: _refused(p, "RevokedMemberError"), DEADLINE_S, "revoked")
                await until(lambda p=p: b.host.peer_id not in p.host.connected_ids, 5, "cut off")
            await publish_until(m, b"good 2", lambda: _digest(b"good 2") in c.accepted, 20)
            assert _digest(b"good 2") not in b.accepted  # b redials every second: refused
            assert _membership(m)["members"] == 1
        finally:
            await _stop(b, c, m)

    asyncio.run(scenario())


def test_relays_serve_members_only_and_members_use_member_relays_only(tmp_path: Path) -> None:
    """Behind NAT (told so), a member reserves a slot on its member relay, a non-member
    gets none there, and a member does not reserve on a non-member's relay."""
    swarm = Swarm()

    async def scenario() -> dict[str, Any]:
        relay, _ = _member(swarm, tmp_path, "relay")
        foreign = Peer(tmp_path, "foreign")  # a non-member offering relay service
        for p in (relay, foreign):
            await p.host.start()
        natted, _ = _member(swarm, tmp_path, "natted", bootstrap=(relay.host.addr,))
        stranger = Peer(tmp_path, "stranger", bootstrap=(relay.host.addr,))
        wary, _ = _member(swarm, tmp_path, "wary", bootstrap=(foreign.host.addr,))
        peers = (natted, stranger, wary)
        for p in peers:
            await p.host.start()
            p.host.advertise(None, behind_nat=True)
        try:
            await until(lambda: natted.host.status()["relay_reservations"] == 1, 20, "a slot")
            await until(lambda: _refused(relay, "NotAMemberError"), DEADLINE_S, "refusal")
            await until(lambda: _refused(wary, "NotAMemberError"), DEADLINE_S, "refusal")
            return {p.host.peer_id: p.host.status()["relay_reservations"] for p in peers}
        finally:
            await _stop(*peers, relay, foreign)

    out = asyncio.run(scenario())
    assert list(out.values()) == [1, 0, 0]
