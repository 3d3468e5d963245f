"""Runs of chunks: several chunks in one request (``GET /chunks``), each usable on arrival.

A 64 KiB chunk costs ~0.7 ms of CPU per request at both ends over HTTP; a patch of 500 such
chunks fetched by two rollouts on one 2-core machine spent most of its fetch on that. A run
pays it once, while each chunk is still verified and relayed as soon as its bytes are in.
Here: the scheduler asks in runs, the router serves a run up to the first chunk it lacks, the
HTTP client hands each chunk on before the next has come, and a short or overlong reply is
told apart from a corrupt one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from node.config import NodeConfig
from node.runtime import Node
from p2p_sync.errors import PeerError
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import Manifest, SwarmPolicy, sign
from p2p_sync.peers import PeerLimits
from p2p_sync.store import Store
from p2p_sync.swarm import ChunkVerified, PeerHad, RequestChunk, Scheduler, SwarmConfig
from p2p_sync.transport.dataplane import MAX_RUN, HttpLimits, chunks_url
from p2p_sync.transport.http import DataClient
from tests.helpers import snapshot_manifest

CHUNK = 16 * 1024
LIMITS = HttpLimits(request_timeout_s=2.0, connect_timeout_s=2.0)

# ---------------------------------------------------------------- the scheduler


def _requests(actions: list) -> list[int]:
    return [a.index for a in actions if isinstance(a, RequestChunk)]


def test_requests_leave_in_runs_of_request_bytes() -> None:
    config = SwarmConfig(request_bytes=4 * CHUNK, initial_requests_per_peer=2)
    s = Scheduler(100, config, (), CHUNK)
    assert s.run == 4
    first = _requests(s.handle(PeerHad("p", frozenset(range(100))), 0.0))
    assert len(first) == 5  # the initial depth, plus the rest of one run
    # one chunk back: room for one, not for a run, so nothing is asked yet
    assert _requests(s.handle(ChunkVerified("p", first[0], CHUNK), 0.01)) == []
    got = [
        s.handle(ChunkVerified("p", i, CHUNK), 0.01 + 0.001 * n) for n, i in enumerate(first[1:4])
    ]
    asked = [_requests(g) for g in got]
    assert [len(a) for a in asked if a] == [len(s.peer_inflight["p"]) - 1]  # one run at once
    assert sum(map(len, asked)) >= 4


def test_one_chunk_a_request_without_a_chunk_size_or_with_request_bytes_zero() -> None:
    for s in (Scheduler(10, SwarmConfig()), Scheduler(10, SwarmConfig(request_bytes=0), (), CHUNK)):
        assert s.run == 1
        first = _requests(s.handle(PeerHad("p", frozenset(range(10))), 0.0))
        assert len(first) == SwarmConfig().initial_requests_per_peer
        assert len(_requests(s.handle(ChunkVerified("p", first[0], CHUNK), 0.1))) == 1


def test_a_run_never_exceeds_the_per_peer_cap() -> None:
    config = SwarmConfig(request_bytes=64 * CHUNK, max_requests_per_peer=6)
    s = Scheduler(200, config, (), CHUNK)
    assert len(_requests(s.handle(PeerHad("p", frozenset(range(200))), 0.0))) == 6


# ---------------------------------------------------------------- the router, over HTTP


def _node(tmp_path: Path, chunks: int = 6) -> tuple[Node, Manifest, bytes]:
    key = SigningKey.generate()
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path,
        trust=(key.public.text(),),
        directory=PeerLimits(poll_interval_s=60),
        http=LIMITS,
    )
    node = Node(cfg, SwarmPolicy("t", (key.public,)), Store.open(tmp_path))
    payload = bytes((i * 7 + i // 251) % 256 for i in range(chunks * CHUNK - 100))
    m = snapshot_manifest(payload, chunk_size=CHUNK)
    node.store.put_payload(m, payload)
    node.store.put_manifest(m, sign(m, [key]))
    return node, m, payload


async def _parts(url: str, sizes: list[int]) -> list[bytes] | PeerError:
    client = DataClient(None, LIMITS)
    try:
        return [part async for part in client.get_parts(url, sizes)]
    except PeerError as exc:
        return exc
    finally:
        await client.close()


def test_a_run_is_served_back_to_back_up_to_the_first_chunk_not_held(tmp_path: Path) -> None:
    node, m, payload = _node(tmp_path)
    absent = "ab" * 32

    async def go() -> dict[str, object]:
        base = await node.start()
        try:
            sizes = [m.chunk_length(i) for i in range(6)]
            out = {
                "all": await _parts(base + chunks_url(list(m.chunks)), sizes),
                "cut": await _parts(
                    base + chunks_url([m.chunks[0], absent, m.chunks[2]]), sizes[:3]
                ),
                "first": await _parts(base + chunks_url([absent, m.chunks[1]]), sizes[:2]),
                "uploaded": node.metrics.bytes_uploaded,
            }
            for bad in ("x" * 64, m.chunks[0][:63], m.chunks[0] * (MAX_RUN + 1)):
                out[bad[:8] + str(len(bad))] = await _parts(base + "/chunks/" + bad, [CHUNK])
            return out
        finally:
            await node.stop()

    out = asyncio.run(go())
    assert out["all"] == [payload[i * CHUNK : (i + 1) * CHUNK] for i in range(6)]
    assert out["cut"] == [payload[:CHUNK]]  # it stops before the chunk it lacks
    assert out["first"] == []  # it lacks the first: a 404, no parts
    assert out["uploaded"] == len(payload) + CHUNK  # what it served, counted once sent
    bad = [v for k, v in out.items() if k not in ("all", "cut", "first", "uploaded")]
    assert len(bad) == 3 and all(isinstance(v, PeerError) and "400" in str(v) for v in bad)


# ---------------------------------------------------------------- the client


async def _serve_raw(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/chunks/{shas}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/chunks/x"


def test_each_chunk_of_a_run_is_handed_on_before_the_next_is_sent() -> None:
    """The server sends the second chunk only once the client has handed on the first: a
    client that waited for the whole reply would never see either (bounded by a timeout)."""
    first_seen = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 2 * CHUNK
        await response.prepare(request)
        await response.write(b"a" * CHUNK)
        await first_seen.wait()
        await response.write(b"b" * CHUNK)
        return response

    async def go() -> list[bytes]:
        runner, url = await _serve_raw(handler)
        client = DataClient(None, LIMITS)
        got: list[bytes] = []
        try:
            async with asyncio.timeout(5):
                async for part in client.get_parts(url, [CHUNK, CHUNK]):
                    got.append(part)
                    first_seen.set()
        finally:
            await client.close()
            await runner.cleanup()
        return got

    assert asyncio.run(go()) == [b"a" * CHUNK, b"b" * CHUNK]


@pytest.mark.parametrize(
    ("body", "parts", "error"),
    [
        (b"a" * CHUNK + b"b" * 10, 1, "ends within a chunk"),  # cut inside the second
        (b"a" * (2 * CHUNK + 1), 2, "over the chunks' length"),  # one byte too many
        (b"a" * CHUNK, 1, None),  # it stopped before the second: it lacks it
    ],
)
def test_a_reply_that_is_short_or_long_is_told_apart(
    body: bytes, parts: int, error: str | None
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body)

    async def go() -> tuple[list[bytes], PeerError | None]:
        runner, url = await _serve_raw(handler)
        client = DataClient(None, LIMITS)
        got: list[bytes] = []
        try:
            async for part in client.get_parts(url, [CHUNK, CHUNK]):
                got.append(part)
        except PeerError as exc:
            return got, exc
        finally:
            await client.close()
            await runner.cleanup()
        return got, None

    got, exc = asyncio.run(go())
    assert len(got) == parts and all(len(p) == CHUNK for p in got)  # the parts before the fault
    assert (exc is None) if error is None else (exc is not None and error in str(exc))
