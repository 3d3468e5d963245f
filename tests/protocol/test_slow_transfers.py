"""Chunks on slow links: a transfer that keeps moving is never cut, one that stops is.

A 4 MiB chunk shared 16 ways on a 10 Mbit/s home uplink takes ~54 s. The data plane used to
give a whole chunk ``request_timeout_s`` (10 s) on both ends, so every such transfer died near
its end and was asked again elsewhere. Now both ends time each piece instead: real aiohttp on
loopback, and the libp2p stream transport's framing over trio streams, with
``request_timeout_s`` shrunk to a fraction of a second.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from aiohttp import web

from p2p_sync.errors import PeerError
from p2p_sync.runtime.node import Node
from p2p_sync.transport.http import DataClient
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import PIECE, Reply
from p2p_sync.transport.streams import read_exactly, write_reply
from tests.helpers import node_holding

LIMITS = HttpLimits(request_timeout_s=0.3, connect_timeout_s=2.0)
# The server side: a socket is writable again only once a third or so of its send buffer has
# drained (loopback grows it to ~4 MB), so a piece may wait that long for a steady reader.
SERVER_LIMITS = HttpLimits(request_timeout_s=1.0, connect_timeout_s=2.0)
BIG = 16 * 2**20  # several times what loopback's socket buffers hold: the reader sets the pace


def _node(tmp_path: Path) -> tuple[Node, str]:
    """A node holding one signed snapshot of a single ``BIG`` chunk; its chunk's hash."""
    node, m = node_holding(tmp_path, bytes(range(256)) * (BIG // 256), BIG, SERVER_LIMITS)
    return node, m.chunks[0]


def _read(port: int, sha: str, pace_s: float, stop_after: int | None) -> int:
    """GET the chunk over a raw socket with a small receive buffer, 256 KiB every ``pace_s``;
    with ``stop_after``, stop reading that many bytes in for 2.5 s, then read what is left.
    Returns the bytes received until the server closed the connection."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET /chunk/{sha} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        got, paused = 0, False
        while True:
            try:
                data = s.recv(256 * 1024)
            except ConnectionResetError:
                return got
            if not data:
                return got
            got += len(data)
            if stop_after is not None and got >= stop_after and not paused:
                time.sleep(2.5)
                paused = True
            time.sleep(pace_s)


async def _serve_to_reader(tmp_path: Path, pace_s: float, stop_after: int | None) -> int:
    node, sha = _node(tmp_path)
    url = await node.start()
    try:
        port = int(url.rsplit(":", 1)[1])
        return await asyncio.to_thread(_read, port, sha, pace_s, stop_after)
    finally:
        await node.stop()


def test_a_slow_reader_that_keeps_reading_gets_the_whole_chunk(tmp_path: Path) -> None:
    started = time.monotonic()
    got = asyncio.run(_serve_to_reader(tmp_path, 0.02, None))
    assert got > BIG  # the headers, then every byte of the body
    assert time.monotonic() - started > 2 * SERVER_LIMITS.request_timeout_s  # it took a while


def test_a_reader_that_stops_is_cut_off(tmp_path: Path) -> None:
    got = asyncio.run(_serve_to_reader(tmp_path, 0.0, 2**20))
    assert got < BIG  # the server gave up while it paused: the body never came whole


async def _trickle(
    pieces: int, gap_s: float, silent_after: int | None, path: str = "/chunk/x"
) -> tuple[bytes | Exception, float]:
    """Fetch a body an aiohttp server writes in ``pieces`` of 32 KiB, ``gap_s`` apart (going
    silent for 2 s after ``silent_after`` pieces), through the data plane's client: what it
    got (or its error), and how long that took."""
    piece = b"p" * 32 * 1024

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = pieces * len(piece)
        await response.prepare(request)
        try:
            for n in range(pieces):
                if n == silent_after:
                    await asyncio.sleep(2)
                await response.write(piece)
                await asyncio.sleep(gap_s)
        except ConnectionError:  # the client gave up
            pass
        return response

    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = DataClient(None, LIMITS)
    started = time.monotonic()
    outcome: bytes | Exception
    try:
        outcome = await client.get_bytes(f"http://127.0.0.1:{port}{path}")
    except PeerError as exc:
        outcome = exc
    finally:
        took = time.monotonic() - started
        await client.close()
        await runner.cleanup()
    return outcome, took


def test_the_client_waits_for_a_chunk_whose_bytes_keep_coming() -> None:
    body, took = asyncio.run(_trickle(10, 0.1, None))
    assert body == b"p" * 32 * 1024 * 10
    assert took > 3 * LIMITS.request_timeout_s  # ~1 s: the old whole-request limit cut it


@pytest.mark.serial  # a timing bound: run alone
def test_the_client_gives_up_on_a_chunk_that_stops_coming() -> None:
    outcome, took = asyncio.run(_trickle(10, 0.0, 3))
    assert isinstance(outcome, PeerError)
    assert took == pytest.approx(2 * LIMITS.request_timeout_s, abs=0.4)  # not the 2 s of silence


@pytest.mark.serial  # a timing bound: run alone
def test_a_trickled_manifest_still_gets_the_whole_request_limit() -> None:
    """Nothing but the client's clock stops a peer that trickles a manifest: only chunks,
    which the scheduler's own timeout bounds, are timed by progress."""
    outcome, took = asyncio.run(_trickle(10, 0.1, None, "/manifest/x"))
    assert isinstance(outcome, PeerError)
    assert took == pytest.approx(LIMITS.request_timeout_s, abs=0.2)


# ---------------------------------------------------------------- over libp2p streams


class _TrioStream:
    """A trio lockstep stream (a write returns once the other end has read it) with the
    three calls the stream transport makes of a libp2p stream."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.was_reset = stream, False

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def read(self, n: int) -> bytes:
        return await self.stream.receive_some(n)

    async def reset(self) -> None:
        self.was_reset = True
        await self.stream.aclose()


async def _reply_to_reader(stop_after: int | None) -> tuple[bool, int, bool]:
    """``write_reply`` of a 2 MiB chunk to a reader taking 64 KiB every 10 ms (stopping once
    ``stop_after`` bytes are in); (sent, bytes read, stream reset)."""
    a, b = trio.testing.lockstep_stream_pair()
    writer, reader = _TrioStream(a), _TrioStream(b)
    reply = Reply(200, b"c" * 2 * 2**20, "application/octet-stream", upload=True)
    got, sent = 0, False

    async def read_slowly() -> None:
        nonlocal got
        while stop_after is None or got < stop_after:
            data = await reader.read(64 * 1024)
            if not data:
                return
            got += len(data)
            await trio.sleep(0.01)

    async def write() -> None:
        nonlocal sent
        sent = await write_reply(writer, reply, 0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_slowly)
        with trio.fail_after(10):
            await write()
        nursery.cancel_scope.cancel()
    return sent, got, writer.was_reset


def test_a_slow_reader_gets_a_whole_reply_over_a_stream() -> None:
    start = time.monotonic()
    sent, got, was_reset = trio.run(_reply_to_reader, None)
    assert sent and not was_reset
    assert got > 2 * 2**20  # the reply header, then the whole body
    assert time.monotonic() - start > 2 * 0.1  # longer than one piece's timeout


def test_a_reader_that_stops_has_its_stream_reset() -> None:
    sent, got, was_reset = trio.run(_reply_to_reader, 2**20)
    assert not sent and was_reset
    assert got < 2 * 2**20


def test_a_streamed_chunk_body_reports_progress_before_every_piece() -> None:
    async def read_body() -> tuple[bytes, int]:
        a, b = trio.testing.lockstep_stream_pair()
        calls = 0

        def moving() -> None:
            nonlocal calls
            calls += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.send_all, b"x" * (PIECE * 3 + 5))
            body = await read_exactly(_TrioStream(b), PIECE * 3 + 5, moving)
        return body, calls

    body, calls = trio.run(read_body)
    assert body == b"x" * (PIECE * 3 + 5)
    assert calls >= 4  # at least one call per piece: the caller's deadline moves with them
