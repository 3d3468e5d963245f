"""Hostile JSON (nesting bombs, integers of thousands of digits) from a peer or a file: each
parser raises its own P2PSyncError, each route answers a 4xx, each client a PeerError. Never a
RecursionError, int()'s bare ValueError, an HTTP 500 or a traceback in the log."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import aiohttp
import aiohttp.web
import pytest
import zstandard

from p2p_sync.errors import (
    MalformedAnnouncementError,
    MalformedManifestError,
    P2PSyncError,
    PeerError,
    StoreError,
    WeightsFileError,
)
from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.node import Node
from p2p_sync.store import Store
from p2p_sync.transport import frames, reverse
from p2p_sync.transport.announcement import ANNOUNCE_MAGIC, ANNOUNCE_TYPE
from p2p_sync.transport.http import DataClient, DataServer
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.trust import announce, manifest
from p2p_sync.trust.announce import Announcement, Verdict, judge
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.weights.weights_io import load_weights

KEY = SigningKey.generate()
POLICY = SwarmPolicy("hostile-json", (KEY.public,))
NOW_MS = 1_800_000_000_000
HEX = "ab" * 32
DEEP = b"[" * 50_000 + b"]" * 50_000  # 100 KB, under every body limit
DEEP_OBJECT = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
BIG = b"9" * 5_000  # int() refuses more than 4,300 digits
HOSTILE = {
    "nested arrays": DEEP,
    "nested objects": DEEP_OBJECT,
    "nested in the envelope": b'{"signed": ' + DEEP + b', "signatures": [], "manifests": []}',
    "huge integer": b'{"signed": ' + BIG + b', "signatures": [], "manifests": []}',
    "huge negative integer": b"[-" + BIG + b"]",
}


@pytest.mark.parametrize("doc", HOSTILE.values(), ids=HOSTILE.keys())
def test_manifests_and_announcements_refuse_hostile_json_with_their_own_error(doc) -> None:
    with pytest.raises(MalformedManifestError):
        manifest.verify(doc, POLICY, NOW_MS / 1000, None)
    with pytest.raises(MalformedAnnouncementError):
        announce.parse(doc)
    decision = judge(doc, POLICY, NOW_MS, lambda d: False)
    assert decision.verdict is Verdict.REJECT and decision.error is MalformedAnnouncementError


def test_a_signed_announcement_with_a_hostile_inline_manifest_is_rejected() -> None:
    """The inline manifests sit outside the signature: anyone on the mesh can put a bomb there."""
    news = Announcement(POLICY.swarm_id, 1, (HEX,), NOW_MS)
    for inline in (b"[" * 5_000 + b"]" * 5_000, b'{"signed": ' + BIG + b"}"):
        decision = judge(announce.encode(news, [KEY], [inline]), POLICY, NOW_MS, lambda d: False)
        assert decision.verdict is Verdict.REJECT and decision.error is MalformedManifestError


@pytest.mark.parametrize("doc", [DEEP, b'{"id": ' + BIG + b"}"], ids=["nested", "huge integer"])
def test_libp2p_and_reverse_channel_headers_refuse_hostile_json_as_malformed(doc) -> None:
    """Their callers drop a stream or close a channel on ValueError: these raise one that is
    also the project's own error."""
    calls = (
        lambda: frames.parse_request_header(doc, 1024),
        lambda: frames.parse_reply_header(doc),
        lambda: reverse.split_message(len(doc).to_bytes(4, "big") + doc, 1 << 20),
    )
    for call in calls:
        with pytest.raises(ValueError) as exc:
            call()
        assert isinstance(exc.value, P2PSyncError), repr(exc.value)


def test_files_with_hostile_json_are_refused_as_unreadable(tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(len(DEEP).to_bytes(8, "little") + DEEP)
    with pytest.raises(WeightsFileError, match="not a readable safetensors"):
        load_weights(weights)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "format.json").write_bytes(DEEP)
    with pytest.raises(StoreError, match="unreadable"):
        Store.open(tmp_path / "store")


# ---------------------------------------------------------------- over HTTP


def _framed(head: bytes, packed: bytes = b"") -> bytes:
    sizes = len(head).to_bytes(4, "big"), len(packed).to_bytes(4, "big")
    return ANNOUNCE_MAGIC + sizes[0] + head + sizes[1] + packed


BODIES = {  # name -> (route, body, content type)
    "announce nested": ("/announce", DEEP, "application/json"),
    "announce nested objects": ("/announce", DEEP_OBJECT, "application/json"),
    "announce huge integer": (
        "/announce",
        b'{"url": null, "digests": [], "n": ' + BIG + b"}",
        "application/json",
    ),
    "dialback nested": ("/dialback", DEEP, "application/json"),
    "dialback huge integer": ("/dialback", b'{"url": ' + BIG + b"}", "application/json"),
    "framed announcement, nested JSON": ("/announce", _framed(DEEP), ANNOUNCE_TYPE),
    "framed announcement, nested packed manifests": (
        "/announce",
        _framed(
            b'{"url": null, "digests": ["' + HEX.encode() + b'"]}',
            zstandard.ZstdCompressor().compress(DEEP),
        ),
        ANNOUNCE_TYPE,
    ),
}


async def _post_hostile_bodies(tmp_path: Path) -> dict[str, int]:
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path,
        trust=("x",),
        p2p=False,
        directory=PeerLimits(poll_interval_s=60),
    )
    node = Node(cfg, POLICY, Store.open(tmp_path))
    server = DataServer(node.view, cfg.http)  # the node's own data plane, on loopback
    url = f"http://127.0.0.1:{await server.start('127.0.0.1', 0)}"
    out: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession() as s:
            for name, (route, body, ctype) in BODIES.items():
                headers = {"Content-Type": ctype}
                async with s.post(url + route, data=body, headers=headers) as resp:
                    await resp.read()
                    out[name] = resp.status
            async with s.get(f"{url}/peers") as resp:
                out["peers after"] = resp.status
    finally:
        await server.stop()
    return out


def test_every_route_answers_hostile_json_with_a_4xx_and_logs_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    codes = asyncio.run(_post_hostile_bodies(tmp_path))
    assert codes.pop("peers after") == 200
    assert codes == {name: 422 for name in BODIES}, codes  # past the bounds: unprocessable
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def _ask_a_hostile_peer() -> dict[str, str]:
    async def deep(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=DEEP, content_type="application/json")

    async def big(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=b'{"peers": [' + BIG + b"]}")

    async def feed(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"have": [0], "from": 0}\n' + DEEP + b"\n")
        await response.write_eof()
        return response

    app = aiohttp.web.Application()
    app.add_routes(
        [
            aiohttp.web.get("/peers", deep),
            aiohttp.web.get("/manifests", big),
            aiohttp.web.get("/have/{d}", feed),
            aiohttp.web.post("/dialback", deep),
        ]
    )
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    peer = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    client = DataClient(None, dataclasses.replace(HttpLimits(), request_timeout_s=5.0))
    calls = {
        "peers": lambda: client.get_json(f"{peer}/peers"),
        "manifests": lambda: client.get_json(f"{peer}/manifests"),
        "dialback": lambda: client.post_json(f"{peer}/dialback", {"url": peer, "nonce": "a" * 32}),
    }
    out: dict[str, str] = {}
    try:
        for name, call in calls.items():
            try:
                await call()
                out[name] = "answered"
            except PeerError as exc:
                out[name] = f"PeerError: {exc}"
        lines = []
        try:
            async for doc in client.get_feed(f"{peer}/have/{HEX}?feed=1"):
                lines.append(doc)
        except PeerError as exc:
            out["feed"] = f"PeerError after {len(lines)} line(s): {exc}"
    finally:
        await client.close()
        await runner.cleanup()
    return out


def test_a_peer_answering_hostile_json_is_a_peer_error() -> None:
    out = asyncio.run(_ask_a_hostile_peer())
    assert out["peers"].startswith("PeerError") and "nested" in out["peers"], out
    assert out["manifests"].startswith("PeerError") and "digits" in out["manifests"], out
    assert out["dialback"].startswith("PeerError"), out
    assert out["feed"].startswith("PeerError after 1 line(s)"), out
