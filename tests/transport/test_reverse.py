"""Reverse channels (``p2p_sync.transport.reverse``): a node behind NAT serves a public peer over
a WebSocket it opened. The handshake proves the peer id and refuses impersonation and channels
passed on; hostile bytes either way close the channel and touch nothing else. Real aiohttp
servers on loopback; the node-level run lives in tests/transport/test_nat_serving.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2p_sync.errors import ImpersonationError, PeerError
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.frames import encode_reply_header, encode_request
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import PIECE, Reply
from p2p_sync.transport.reverse import (
    PATH,
    REFUSED,
    ReverseClient,
    ReverseHub,
    ReverseLinks,
    is_own_url,
    prove,
    split_message,
    verify,
)

LIMITS = HttpLimits(request_timeout_s=2.0, connect_timeout_s=2.0)
DATA = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(DATA).hexdigest()


def _identity() -> tuple[Any, str]:
    pair = create_new_key_pair()
    return pair, str(ID.from_pubkey(pair.public_key))


# ---------------------------------------------------------------- the handshake (pure)


def test_a_genuine_proof_is_accepted() -> None:
    pair, peer = _identity()
    doc = prove(pair, peer, "http://10.0.0.1:8000", "ab" * 16)
    assert verify(doc, "ab" * 16, lambda u: u == "http://10.0.0.1:8000") == (peer, doc["url"])


def test_impersonation_and_passed_on_channels_are_refused() -> None:
    pair, peer = _identity()
    _, other = _identity()
    mine = "http://10.0.0.1:8000"
    genuine = prove(pair, peer, mine, "ab" * 16)
    cases = {
        "another's id": genuine | {"peer": other},
        "signed for another URL (passed on)": prove(pair, peer, "http://10.0.0.9:1", "ab" * 16),
        "an old challenge (replayed)": prove(pair, peer, mine, "cd" * 16),
        "bad signature hex": genuine | {"signature": "zz"},
        "garbage key": genuine | {"key": "00ff"},
        "a field missing": {k: v for k, v in genuine.items() if k != "key"},
        "not an object": [genuine],
    }
    for what, doc in cases.items():
        with pytest.raises(ImpersonationError):
            verify(doc, "ab" * 16, lambda u: u == mine)
            pytest.fail(f"accepted {what}")


def test_own_urls_are_the_advertised_one_and_the_socket_it_arrived_at() -> None:
    assert is_own_url("http://203.0.113.5:80", "http://203.0.113.5:80", ("10.0.0.1", 8000))
    assert is_own_url("http://10.0.0.1:8000", None, ("10.0.0.1", 8000))
    assert is_own_url("http://[::1]:8000", None, ("::1", 8000, 0, 0))
    assert not is_own_url("http://10.0.0.2:8000", "http://203.0.113.5:80", ("10.0.0.1", 8000))
    assert not is_own_url("http://10.0.0.1:8001", None, ("10.0.0.1", 8000))
    assert not is_own_url("http://example.org:8000", None, ("10.0.0.1", 8000))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_message_bytes_give_a_header_or_a_value_error(data: bytes) -> None:
    try:
        head, body = split_message(data, 64)
    except ValueError:
        return
    assert isinstance(head["id"], int) and data.endswith(body)


# ---------------------------------------------------------------- real channels on loopback


class _Chunks:
    """A node serving one chunk (what the data router needs of it here)."""

    def __init__(self) -> None:
        self.uploaded = 0

    def chunk(self, sha256: str, requester: str | None = None) -> bytes | None:
        return DATA if sha256 == SHA else None

    def count_upload(self, nbytes: int) -> None:
        self.uploaded += nbytes

    def upload_contact(self, requester: str, pending: bool) -> None:
        pass

    def requester(self, url: str, remote: str | None, upload: bool) -> None:
        pass


@asynccontextmanager
async def _server(handler: Callable[[web.Request], Any]) -> AsyncIterator[str]:
    app = web.Application()
    app.add_routes([web.get(PATH, handler)])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None and site._server.sockets
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.02)  # polling a condition, bounded by the timeout
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _public_and_nated(max_channels: int = 4) -> dict[str, Any]:
    learned: list[str] = []
    hub = ReverseHub(LIMITS, max_channels, lambda: None, learned.append)
    pair, peer = _identity()
    view = _Chunks()
    links = ReverseLinks(DataRouter(view, LIMITS), pair, peer, 8)  # type: ignore[arg-type]
    async with _server(hub.accept) as url:
        links.offer(url)
        await _until(lambda: peer in hub.channels, "the channel")
        client = ReverseClient(hub, "http://127.0.0.1:1")
        got = await client.get_bytes(f"p2p://{peer}/chunk/{SHA}")
        with pytest.raises(PeerError, match="HTTP 404"):
            await client.get_bytes(f"p2p://{peer}/chunk/{'0' * 64}")
        with pytest.raises(PeerError, match="no reverse channel"):
            await client.get_bytes(f"p2p://{_identity()[1]}/chunk/{SHA}")
        out = {"got": got, "learned": learned, "peer": peer, "view": view.uploaded}
        out |= {"links": links.status(), "has": hub.has(f"p2p://{peer}/chunk/x")}
        await links.close()
        await _until(lambda: not hub.channels, "the channel to close")
    return out


def test_a_public_peer_fetches_a_chunk_over_the_channel_a_nated_node_opened() -> None:
    out = asyncio.run(_public_and_nated())
    assert out["got"] == DATA and out["has"]
    assert out["learned"] == [f"p2p://{out['peer']}"]  # the public peer learns its name
    assert out["links"]["bytes_uploaded"] == len(DATA) == out["view"]
    assert out["links"]["answered"] == 2 and len(out["links"]["links"]) == 1


async def _handshake(url: str, proof: Callable[[str], Any]) -> tuple[int | None, str]:
    """Open a channel by hand, answering the challenge with ``proof(challenge)``."""
    async with aiohttp.ClientSession() as s, s.ws_connect(url + PATH) as ws:
        challenge = (await ws.receive_json())["challenge"]
        await ws.send_json(proof(challenge))
        msg = await ws.receive()
        return ws.close_code, msg.extra or ""  # a close message's reason


async def _hostile_handshakes() -> dict[str, Any]:
    hub = ReverseHub(LIMITS, 1, lambda: None, lambda url: None)
    pair, peer = _identity()
    _, other = _identity()
    async with _server(hub.accept) as url:
        forged = await _handshake(url, lambda c: prove(pair, peer, url, c) | {"peer": other})
        passed_on = await _handshake(url, lambda c: prove(pair, peer, "http://10.1.1.1:80", c))
        first = prove(pair, peer, url, "00" * 16)
        replayed = await _handshake(url, lambda c: first)
        refused = len(hub.channels)
        async with aiohttp.ClientSession() as s, s.ws_connect(url + PATH) as ws:
            await ws.send_json(prove(pair, peer, url, (await ws.receive_json())["challenge"]))
            ok = await ws.receive_json()
            held = sorted(hub.channels)
            async with s.get(url + PATH) as full:  # max_channels = 1: no room for another
                full_status = full.status
    return {k: v for k, v in locals().items() if k in _OUTCOMES}


_OUTCOMES = ("forged", "passed_on", "replayed", "refused", "ok", "held", "full_status", "peer")


def test_a_hub_refuses_forged_passed_on_and_replayed_proofs_and_keeps_its_bound() -> None:
    out = asyncio.run(_hostile_handshakes())
    for what in ("forged", "passed_on", "replayed"):
        code, reason = out[what]
        assert code == REFUSED, what
    assert "does not prove" in out["forged"][1] and "not this node's URL" in out["passed_on"][1]
    assert out["refused"] == 0
    assert out["ok"] == {"ok": True} and out["held"] == [out["peer"]]
    assert out["full_status"] == 503


async def _over_a_proven_end(
    limits: HttpLimits, answer: Callable[[Any], Awaitable[None]]
) -> tuple[bytes | str, float]:
    """A NATed end that proves itself, then runs ``answer(ws)`` on its WebSocket; what a
    public peer's chunk request over it ends in (the body, or the error), and when."""
    pair, peer = _identity()
    hub = ReverseHub(limits, 4, lambda: None, lambda url: None)
    async with _server(hub.accept) as url, aiohttp.ClientSession() as s:
        async with s.ws_connect(url + PATH) as ws:
            await ws.send_json(prove(pair, peer, url, (await ws.receive_json())["challenge"]))
            await ws.receive_json()
            task = asyncio.create_task(answer(ws))
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                got: bytes | str = await ReverseClient(hub, None).get_bytes(
                    f"p2p://{peer}/chunk/{SHA}"
                )
            except PeerError as exc:
                got = str(exc)
            finally:
                took = loop.time() - started
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    return got, took


async def _hostile_replies(reply: Callable[[int], bytes | None]) -> str:
    """Each request answered with ``reply(id)`` (None: never answered); what the public
    peer's request ends in."""

    async def answer(ws: Any) -> None:
        async for msg in ws:
            frame = reply(split_message(msg.data, 1 << 16)[0]["id"])
            if frame is not None:
                await ws.send_bytes(frame)

    got, _ = await _over_a_proven_end(LIMITS, answer)
    return "accepted" if isinstance(got, bytes) else got


def _reply(status: int, body: bytes, length: int | None = None, rid_shift: int = 0) -> Callable:
    from p2p_sync.transport.messages import Reply

    def make(rid: int) -> bytes:
        head = encode_reply_header(
            Reply(status, body, "application/octet-stream"), id=rid + rid_shift
        )
        if length is not None:
            raw = json.loads(head[4:]) | {"length": length}
            text = json.dumps(raw).encode()
            head = len(text).to_bytes(4, "big") + text
        return head + body

    return make


def test_hostile_replies_fail_the_request_and_nothing_else() -> None:
    cases = {
        "never answers": (lambda rid: None, "TimeoutError"),
        "a length that lies": (_reply(200, b"abc", length=2), "header says 2"),
        "an error status": (_reply(500, b""), "HTTP 500"),
        "a reply to another request": (_reply(200, b"x", rid_shift=7), "TimeoutError"),
        "garbage bytes": (lambda rid: b"\xff" * 9, "channel closed"),
        "a reply over the limit": (_reply(200, b"", length=1 << 40), "over limit"),
    }
    for what, (reply, expected) in cases.items():
        outcome = asyncio.run(_hostile_replies(reply))
        assert expected in outcome, f"{what}: {outcome}"


async def _hostile_requests() -> dict[str, Any]:
    """A public end that proves nothing wrong, then sends a malformed request: the NATed node
    drops that channel and opens a new one (its router untouched)."""
    accepted: list[int] = []

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_json({"challenge": "ab" * 16})
        await ws.receive_json()
        await ws.send_json({"ok": True})
        accepted.append(1)
        if len(accepted) == 1:
            await ws.send_bytes(b"\x00\x00\x00\x05{bad}")
        else:
            rid = 41
            await ws.send_bytes(encode_request("GET", f"/chunk/{SHA}", {}, None, b"", id=rid))
            head, body = split_message((await ws.receive()).data, 4096)
            while len(body) < head["length"]:  # the rest comes in pieces
                more, piece = split_message((await ws.receive()).data, 4096)
                assert more == {"id": rid, "at": len(body)} and 0 < len(piece) <= PIECE
                body += piece
            accepted.append(len(body) if head["id"] == rid else -1)
        await ws.receive()  # until the NATed end closes
        return ws

    pair, peer = _identity()
    view = _Chunks()
    links = ReverseLinks(DataRouter(view, LIMITS), pair, peer, 8)  # type: ignore[arg-type]
    links.RETRY_S = 0.05
    async with _server(handler) as url:
        links.offer(url)
        await _until(lambda: len(accepted) >= 3, "a second channel that serves")
        await links.close()
    return {"accepted": accepted, "uploaded": view.uploaded}


def test_a_malformed_request_closes_the_channel_and_the_node_opens_a_new_one() -> None:
    out = asyncio.run(_hostile_requests())
    assert out["accepted"][:3] == [1, 1, len(DATA)] and out["uploaded"] == len(DATA)


# ---------------------------------------------------------------- slow links


async def _trickled_reply(gap_s: float, silent_after: int | None) -> tuple[bytes | str, float]:
    """A NATed end that sends a 6-piece chunk reply one piece every ``gap_s`` (going silent
    after ``silent_after`` pieces) to a public peer whose ``request_timeout_s`` is 0.3 s;
    what the request ends in, and when."""
    body = bytes(range(256)) * (6 * PIECE // 256)

    async def answer(ws: Any) -> None:
        async for msg in ws:
            rid = split_message(msg.data, 1 << 16)[0]["id"]
            head = encode_reply_header(Reply(200, body, "application/octet-stream"), id=rid)
            await ws.send_bytes(head + body[:PIECE])
            for n, at in enumerate(range(PIECE, len(body), PIECE), 1):
                await asyncio.sleep(gap_s if n != silent_after else 5.0)
                more = json.dumps({"id": rid, "at": at}).encode()
                await ws.send_bytes(len(more).to_bytes(4, "big") + more + body[at : at + PIECE])

    got, took = await _over_a_proven_end(HttpLimits(request_timeout_s=0.3), answer)
    assert not isinstance(got, bytes) or got == body
    return got, took


def test_a_chunk_whose_pieces_keep_coming_over_a_channel_is_never_cut() -> None:
    got, took = asyncio.run(_trickled_reply(0.2, None))
    assert isinstance(got, bytes) and len(got) == 6 * PIECE
    assert took > 3 * 0.3  # ~1 s: a whole-reply limit of request_timeout_s cut it


@pytest.mark.serial  # a timing bound: run alone
def test_a_chunk_whose_pieces_stop_coming_over_a_channel_fails() -> None:
    got, took = asyncio.run(_trickled_reply(0.0, 2))
    assert isinstance(got, str) and "TimeoutError" in got
    assert took == pytest.approx(2 * 0.3, abs=0.3)  # read_patience_s, not the 5 s of silence
