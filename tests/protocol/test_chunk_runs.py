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

from p2p_sync.errors import PeerError
from p2p_sync.protocol.schedule_events import ChunkVerified, PeerHad, RequestChunk
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.runtime.node import Node
from p2p_sync.transport.http import DataClient
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import MAX_RUN, chunks_url
from p2p_sync.trust.manifest import Manifest
from tests.helpers import node_holding

CHUNK = 16 * 1024
LIMITS = HttpLimits(request_timeout_s=2.0, connect_timeout_s=2.0)

# ---------------------------------------------------------------- the scheduler


def _requests(actions: list) -> list[int]:
    return [a.index for a in actions if isinstance(a, RequestChunk)]


def _measured(config: SwarmConfig, n: int = 400) -> tuple[Scheduler, list[list[int]]]:
    """A scheduler whose one source delivered its first two chunks 1 ms apart (16 MB/s, a
    fast, near source); what it asked of it after each."""
    s = Scheduler(n, config, (), CHUNK)
    first = _requests(s.handle(PeerHad("p", frozenset(range(n)), rtt_s=0.001), 0.0))
    assert len(first) == config.initial_requests_per_peer  # one chunk a request until measured
    steps = [s.handle(ChunkVerified("p", first[i], CHUNK), 0.001 * (i + 1)) for i in (0, 1)]
    return s, [_requests(step) for step in steps]


def test_a_fast_source_is_asked_for_runs_of_what_it_delivers_in_request_s() -> None:
    s, asked = _measured(SwarmConfig(request_s=0.005))
    run = s._depth_run("p")[1]
    assert run == 5  # 16 MB/s x 5 ms = 80 KB: five 16 KiB chunks a request
    assert max(map(len, asked)) >= run  # the pipe refilled in one step: one request
    # one more chunk back: room for one, not for a run, so nothing is asked yet
    inflight = sorted(s.peer_inflight["p"])
    assert _requests(s.handle(ChunkVerified("p", inflight[0], CHUNK), 0.003)) == []


def test_a_run_stays_within_request_bytes_and_the_per_peer_cap() -> None:
    s, _ = _measured(SwarmConfig(request_s=1.0, request_bytes=3 * CHUNK))
    assert s._depth_run("p")[1] == 3
    s, _ = _measured(SwarmConfig(request_s=1.0, max_requests_per_peer=6))
    assert len(s.peer_inflight["p"]) <= 6


def test_one_chunk_a_request_without_a_chunk_size_or_with_request_bytes_zero() -> None:
    for config, size in ((SwarmConfig(request_s=1.0), 0), (SwarmConfig(request_bytes=0), CHUNK)):
        s = Scheduler(50, config, (), size)
        first = _requests(s.handle(PeerHad("p", frozenset(range(50)), rtt_s=0.001), 0.0))
        s.handle(ChunkVerified("p", first[0], CHUNK), 0.001)
        s.handle(ChunkVerified("p", first[1], CHUNK), 0.002)
        assert s._depth_run("p")[1] == 1


def test_a_slow_source_is_asked_one_chunk_at_a_time() -> None:
    """1 MB/s (a share of a home uplink): a 16 KiB chunk takes 16 ms, over ``request_s``."""
    s = Scheduler(50, SwarmConfig(), (), CHUNK)
    first = _requests(s.handle(PeerHad("p", frozenset(range(50)), rtt_s=0.04), 0.0))
    s.handle(ChunkVerified("p", first[0], CHUNK), 0.06)
    s.handle(ChunkVerified("p", first[1], CHUNK), 0.076)
    assert s._depth_run("p")[1] == 1


# ---------------------------------------------------------------- the router, over HTTP


def _node(tmp_path: Path, chunks: int = 6) -> tuple[Node, Manifest, bytes]:
    payload = bytes((i * 7 + i // 251) % 256 for i in range(chunks * CHUNK - 100))
    return (*node_holding(tmp_path, payload, CHUNK, LIMITS), payload)


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
