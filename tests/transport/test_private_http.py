"""A private swarm's data plane under attack: a real aiohttp server on loopback over real TLS
(OpenSSL via ``ssl``), real keys and admissions. Each attacker gets a refusal and at most a
bare health answer; the member beside them is served as before (table-driven)."""

from __future__ import annotations

import asyncio
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_sync.errors import PeerError, RevokedMemberError
from p2p_sync.transport.http import DataClient, DataServer
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.tls import SwarmTls
from p2p_sync.trust import admissions
from p2p_sync.trust.manifest import Manifest
from tests.helpers import node_holding
from tests.privateswarm import Identity, Swarm

LIMITS = HttpLimits(request_timeout_s=5.0)
PAYLOAD = bytes(range(256)) * 40  # 10,240 bytes in 3 chunks
HEALTH = {"ok": True, "private": True}
DAY = 86400.0


@dataclass
class Served:
    """A private node's data plane on loopback, and what it must not give away."""

    swarm: Swarm
    server: DataServer
    tls: SwarmTls
    port: int
    manifest: Manifest
    tmp: Path

    def paths(self) -> list[str]:
        m = self.manifest
        return [
            f"/chunk/{m.chunks[0]}",
            f"/chunks/{''.join(m.chunks)}",
            f"/manifest/{m.digest}",
            f"/have/{m.digest}",
            "/manifests",
            "/peers",
            "/metrics",
            "/whoami",
        ]


@asynccontextmanager
async def _serving(tmp_path: Path) -> AsyncIterator[Served]:
    swarm = Swarm()
    node, manifest = node_holding(tmp_path / "node", PAYLOAD, 4096, LIMITS)
    own = swarm.admit()
    tls = SwarmTls.load(swarm.files(tmp_path / "server", own), own.key, swarm.now)
    tls.refresh_s = 0.0  # every request looks at the revocation list file
    server = DataServer(node.view, LIMITS, tls)
    port = await server.start("127.0.0.1", 0)
    try:
        yield Served(swarm, server, tls, port, manifest, tmp_path)
    finally:
        await server.stop()


def _key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def client_context(ca: bytes | None, who: Identity | None) -> ssl.SSLContext:
    """A TLS client trusting ``ca`` (None: any server, as an attacker would), presenting
    ``who``'s admission with its key (None: no certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    if ca is None:
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=ca.decode())
    if who is not None:
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp) / "c.pem", Path(tmp) / "k.pem"
            cert.write_bytes(who.admission)
            key.write_bytes(_key_pem(who.key))
            ctx.load_cert_chain(str(cert), str(key))
    return ctx


async def _probe(served: Served, ctx: ssl.SSLContext | None) -> dict[str, Any]:
    """Each route's answer to a client over ``ctx`` (None: plain HTTP): (status, body), or
    "refused" where no answer came (the TLS handshake failed)."""
    scheme = "http" if ctx is None else "https"
    connector = aiohttp.TCPConnector(ssl=ctx if ctx is not None else False)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector) as session:
        for path in ["/status", *served.paths()]:
            url = f"{scheme}://127.0.0.1:{served.port}{path}"
            try:
                async with asyncio.timeout(10):
                    async with session.get(url) as resp:
                        out[path] = (resp.status, await resp.read())
            except (aiohttp.ClientError, ssl.SSLError, OSError):
                out[path] = "refused"
    return out


def _learned_nothing(served: Served, answers: dict[str, Any]) -> None:
    """A bare health answer at most; no route else answers, nothing of the weights shows."""
    status = answers.pop("/status")
    assert status == "refused" or (status[0] == 200 and _json(status[1]) == HEALTH), status
    for path, answer in answers.items():
        assert answer == "refused" or answer[0] == 403, (path, answer)
        if answer != "refused":
            assert served.manifest.digest.encode() not in answer[1]
            assert PAYLOAD[:64] not in answer[1]


def _json(body: bytes) -> Any:
    import json

    return json.loads(body)


def _replayed(served: Served) -> ssl.SSLContext:
    """A member's admission copied by another identity: OpenSSL will not present a
    certificate without its key, so the copier connects with none."""
    member = served.swarm.admit()
    with pytest.raises(ssl.SSLError):
        client_context(None, Identity(Ed25519PrivateKey.generate(), member.admission))
    return client_context(None, None)


def _revoked(served: Served) -> ssl.SSLContext:
    member = served.swarm.admit()
    served.swarm.revoke(member)
    served.tls.files.revocations.write_bytes(served.swarm.crl)
    return client_context(served.swarm.ca, member)


def _expired(served: Served) -> ssl.SSLContext:
    member = served.swarm.admit(days=1.0, at=served.swarm.now - 3 * DAY)
    return client_context(None, member)


def _other_swarm(served: Served) -> ssl.SSLContext:
    """A member of another private swarm (its own CA), that ignores whom it talks to."""
    return client_context(None, Swarm(swarm_id="cd" * 32).admit())


def _same_name_other_admin(served: Served) -> ssl.SSLContext:
    """An admission from a CA that copies this swarm's name under another key."""
    return client_context(None, Swarm(swarm_id=served.swarm.swarm_id).admit())


ATTACKS: list[tuple[str, Callable[[Served], ssl.SSLContext | None]]] = [
    ("a non-member with the URL, over TLS", lambda s: client_context(None, None)),
    ("a non-member with the URL, in clear text", lambda s: None),
    ("an expired admission", _expired),
    ("a revoked member", _revoked),
    ("a member of another private swarm", _other_swarm),
    ("an admission from an impostor CA of the same name", _same_name_other_admin),
    ("a member's admission replayed by another identity", _replayed),
]


async def _attack(tmp_path: Path, make: Callable[[Served], ssl.SSLContext | None]) -> None:
    async with _serving(tmp_path) as served:
        member = served.swarm.admit()
        answers = await _probe(served, make(served))
        _learned_nothing(served, answers)
        ours = await _probe(served, client_context(served.swarm.ca, member))
        assert ours[f"/chunk/{served.manifest.chunks[0]}"] == (200, PAYLOAD[:4096])
        assert ours["/status"][0] == 200 and "version" in _json(ours["/status"][1])
        assert [ours[p][0] for p in ("/manifests", "/peers")] == [200, 200], ours


@pytest.mark.parametrize("make", [a[1] for a in ATTACKS], ids=[a[0] for a in ATTACKS])
def test_each_attacker_learns_nothing_but_health_and_members_are_served(
    tmp_path: Path, make: Callable[[Served], ssl.SSLContext | None]
) -> None:
    asyncio.run(_attack(tmp_path, make))


async def _revoked_while_connected(tmp_path: Path) -> tuple[int, int, int]:
    """(status before, status after the revocation, connections the client opened)."""
    async with _serving(tmp_path) as served:
        member = served.swarm.admit()
        opened: list[object] = []

        async def counted(_client: object, _trace: object, params: object) -> None:
            opened.append(params)

        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(counted)
        connector = aiohttp.TCPConnector(ssl=client_context(served.swarm.ca, member), limit=1)
        url = f"https://127.0.0.1:{served.port}/manifests"
        async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
            async with session.get(url) as resp:
                before = resp.status
            served.swarm.revoke(member)
            served.tls.files.revocations.write_bytes(served.swarm.crl)
            async with session.get(url) as resp:
                after = resp.status
        return before, after, len(opened)


def test_a_member_revoked_while_connected_is_refused_from_its_next_request(
    tmp_path: Path,
) -> None:
    before, after, connections = asyncio.run(_revoked_while_connected(tmp_path))
    assert (before, after) == (200, 403)
    assert connections == 1  # the keep-alive connection opened before the revocation


async def _data_client(tmp_path: Path) -> tuple[bytes, str]:
    """The node's own client: a member's ``http://`` peer URL goes over TLS pinned to the
    swarm CA; pointed at another swarm's node, it refuses that server."""
    async with _serving(tmp_path / "a") as served:
        me = served.swarm.admit()
        tls = SwarmTls.load(served.swarm.files(tmp_path / "me", me), me.key, served.swarm.now)
        client = DataClient(None, LIMITS, tls)
        try:
            got = await client.get_bytes(
                f"http://127.0.0.1:{served.port}/chunk/{served.manifest.chunks[0]}"
            )
            async with _serving(tmp_path / "b") as stranger:
                try:
                    await client.get_json(f"http://127.0.0.1:{stranger.port}/status")
                    refused = "served"
                except PeerError as exc:
                    refused = str(exc)
        finally:
            await client.close()
        return got, refused


def test_a_members_client_speaks_tls_to_its_swarm_and_refuses_another_swarms_server(
    tmp_path: Path,
) -> None:
    got, refused = asyncio.run(_data_client(tmp_path))
    assert got == PAYLOAD[:4096]
    assert refused != "served"


async def _forged_list_after_revocation(tmp_path: Path) -> list[int]:
    """A revoked member, then the list file replaced by an older one and by a forged one:
    the node keeps the newest list it verified, so the member stays refused."""
    async with _serving(tmp_path) as served:
        member = served.swarm.admit()
        ctx = client_context(served.swarm.ca, member)
        older = served.swarm.crl
        statuses = [(await _probe(served, ctx))["/manifests"][0]]  # "r": "refused"
        served.swarm.revoke(member)
        served.tls.files.revocations.write_bytes(served.swarm.crl)
        statuses.append((await _probe(served, ctx))["/manifests"][0])
        forged = Swarm(swarm_id=served.swarm.swarm_id)
        for replacement in (older, forged.crl, b"not a list"):
            served.tls.files.revocations.write_bytes(replacement)
            statuses.append((await _probe(served, ctx))["/manifests"][0])
        return statuses


def test_an_older_or_forged_revocation_list_file_does_not_readmit_a_revoked_member(
    tmp_path: Path,
) -> None:
    first, *after = asyncio.run(_forged_list_after_revocation(tmp_path))
    assert first == 200
    # refused: by the gate, then (the list adopted by the TLS context too) at the handshake
    assert len(after) == 4 and all(s in (403, "r") for s in after), after
    assert after[-1] == "r"


async def _revoked_server(tmp_path: Path) -> tuple[str, str, int]:
    """A member's client served once (its connection then kept alive), then its list file
    names the server's admission as revoked: the next request takes a new pool, whose
    handshake fails, instead of the connection it holds."""
    async with _serving(tmp_path) as served:
        me = served.swarm.admit()
        files = served.swarm.files(tmp_path / "me", me)
        tls = SwarmTls.load(files, me.key, served.swarm.now)
        tls.refresh_s = 0.0
        client = DataClient(None, LIMITS, tls)
        url = f"http://127.0.0.1:{served.port}/manifests"
        try:
            before = await _outcome(client, url)
            server_admission = served.tls.files.admission.read_bytes()
            crl = admissions.revoke(
                served.swarm.admin, served.swarm.ca, served.swarm.crl, server_admission, time.time()
            )
            files.revocations.write_bytes(crl)
            return before, await _outcome(client, url), client.sessions.renewed
        finally:
            await client.close()


async def _outcome(client: DataClient, url: str) -> str:
    try:
        await client.get_json(url)
        return "served"
    except PeerError as exc:
        return str(exc)


def test_a_members_client_drops_its_connection_to_a_server_revoked_meanwhile(
    tmp_path: Path,
) -> None:
    before, after, renewed = asyncio.run(_revoked_server(tmp_path))
    assert before == "served"
    assert after != "served" and renewed == 1


def test_a_relayed_revocation_list_is_adopted_only_when_newer_and_signed_by_the_admin(
    tmp_path: Path,
) -> None:
    swarm = Swarm()
    me, other = swarm.admit(), swarm.admit()
    tls = SwarmTls.load(swarm.files(tmp_path / "me", me), me.key, swarm.now)
    held = swarm.crl
    forger = Swarm()  # the same swarm id under another admin key
    forged = forger.revoke(forger.admit())
    newer = swarm.revoke(other)
    assert not tls.adopt(forged, swarm.now) and not tls.adopt(held, swarm.now)
    assert tls.membership.check(other.admission, swarm.now).serial  # still a member
    assert tls.adopt(newer, swarm.now) and tls.adopted == 1
    assert tls.files.revocations.read_bytes() == newer  # a restart keeps it
    assert not tls.adopt(held, swarm.now)  # a lagging peer's older list changes nothing
    with pytest.raises(RevokedMemberError):
        tls.membership.check(other.admission, swarm.now)


async def _behind_silent_clients(tmp_path: Path) -> int:
    """Three clients open TCP connections and never send a ClientHello (each would hold a
    handshake for ``header_timeout_s``, 10 s); a member then asks, giving up after 3 s."""
    async with _serving(tmp_path) as served:
        silent = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(3)]
        member = served.swarm.admit()
        connector = aiohttp.TCPConnector(ssl=client_context(served.swarm.ca, member))
        timeout = aiohttp.ClientTimeout(total=3.0)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                async with session.get(f"https://127.0.0.1:{served.port}/manifests") as resp:
                    return resp.status
        finally:
            for _, writer in silent:
                writer.close()


def test_clients_that_never_start_their_handshake_do_not_hold_a_members_back(
    tmp_path: Path,
) -> None:
    assert asyncio.run(_behind_silent_clients(tmp_path)) == 200
