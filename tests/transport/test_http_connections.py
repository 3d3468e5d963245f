"""The data plane's server under connection floods: it holds a bounded number of connections
(in all and per address), cuts slow request headers and idle keep-alive connections, and logs
what a flood repeats one line at a time.

A node at the usual 1,024-descriptor limit used to keep every connection it accepted: 1,100
idle ones left ``/status`` unanswered and "Too many open files" filled its log. Here a real
server (the node's own data plane and view) on loopback, with small limits from its
``HttpLimits``; the flooding clients are raw sockets, each from its own loopback address
(127.0.0.x), and the gate and the log limiter are also checked alone (sans-I/O).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p_sync.protocol.ratelimit import RepeatedLine
from p2p_sync.transport.connections import ConnectionGate, address_key, connection_cap
from p2p_sync.transport.http import DataServer
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.trust.manifest import Manifest
from tests.helpers import node_holding

DEADLINE_S = 5.0  # every wait below ends by then (it normally takes a fraction of it)
STATUS = b"GET /status HTTP/1.1\r\nHost: t\r\n\r\n"
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


# ---------------------------------------------------------------- sans-I/O


def test_the_gate_bounds_connections_in_all_and_per_address() -> None:
    gate = ConnectionGate(total=3, per_address=2)
    assert gate.admit("a") is None and gate.admit("a") is None
    assert "max_connections_per_address" in (gate.admit("a") or "")
    assert gate.admit("b") is None
    assert "max_connections" in (gate.admit("c") or "")  # full: a new address waits too
    gate.release("a")
    assert gate.admit("c") is None  # a place freed is taken
    assert (gate.held, gate.refused, gate.from_address("a")) == (3, 2, 1)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=60))
def test_the_gate_never_holds_more_than_its_caps(ops: list[tuple[bool, int]]) -> None:
    gate, held = ConnectionGate(total=5, per_address=2), []
    for opens, address in ops:
        key = f"10.0.0.{address}"
        if opens:
            if gate.admit(key) is None:
                held.append(key)
        elif key in held:
            held.remove(key)
            gate.release(key)
        assert gate.held == len(held) <= 5
        assert all(gate.from_address(k) == held.count(k) <= 2 for k in set(held))


def test_an_address_is_an_ipv4_address_or_an_ipv6_slash_64() -> None:
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9")
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("fe80::1%eth0") == "fe80::/64"


def test_the_cap_leaves_half_the_descriptors_to_the_rest_of_the_node() -> None:
    limits = HttpLimits(max_connections=4096)
    assert connection_cap(limits, share=512) == 512  # ulimit -n 1024
    assert connection_cap(limits, share=32768) == 4096
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(limits) <= max(1, soft // 2)


def test_a_repeated_line_is_logged_once_per_interval_with_its_count() -> None:
    line = RepeatedLine(every_s=60.0)
    assert line.hit(0.0) == 1  # the first at once
    assert [line.hit(t) for t in (1.0, 2.0, 59.0)] == [0, 0, 0]
    assert line.hit(60.0) == 4  # it stands for the three held back too
    assert line.hit(61.0) == 0 and line.held == 1


# ---------------------------------------------------------------- loopback


@asynccontextmanager
async def _serving(
    tmp_path: Path, limits: HttpLimits
) -> AsyncIterator[tuple[DataServer, int, Manifest]]:
    """The data plane of a node holding a small snapshot, on loopback: server, port, manifest."""
    node, manifest = node_holding(tmp_path, b"z" * 1000, 1000, limits)
    server = DataServer(node.view, limits)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port, manifest
    finally:
        await server.stop()


async def _until(condition: Callable[[], bool], deadline_s: float = DEADLINE_S) -> bool:
    """Whether ``condition`` holds within ``deadline_s`` (checked every 10 ms)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.01)
    return True


async def _connect(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def _closed_after(reader: asyncio.StreamReader, since: float) -> float:
    """Seconds from ``since`` until the server closes the connection (inf: not by the
    deadline)."""
    try:
        await asyncio.wait_for(_until_closed(reader), DEADLINE_S)
    except TimeoutError:
        return float("inf")
    return time.monotonic() - since


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One whole response with a Content-Length (its status line and headers, then body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), DEADLINE_S)


async def _status(port: int, source: str) -> int:
    """``GET /status`` from ``source`` on a connection of its own: the HTTP status."""
    connector = aiohttp.TCPConnector(local_addr=(source, 0), force_close=True)
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(f"http://127.0.0.1:{port}/status") as response:
            await response.read()
            return response.status


async def _flood(tmp_path: Path) -> None:
    limits = HttpLimits(
        max_connections=8, max_connections_per_address=4, header_timeout_s=30, idle_timeout_s=30
    )
    async with _serving(tmp_path, limits) as (server, port, _):
        flood = [await _connect(port, "127.0.0.1") for _ in range(12)]
        ends = [asyncio.create_task(_until_closed(r)) for r, _ in flood]
        try:  # 8 of 12 idle connections from one address are closed at once, with a 503
            assert await _until(lambda: sum(t.done() for t in ends) == 8)
            assert all(t.result() in (b"", BUSY) for t in ends if t.done())  # b"": a reset
            assert server.gate.held == 4  # max_connections_per_address
            assert await _status(port, "127.0.0.2") == 200  # another address is served
            await _until(lambda: server.gate.held == 4)  # that connection closed
            others = [await _connect(port, "127.0.0.3") for _ in range(4)]
            assert await _until(lambda: server.gate.held == 8)
            assert await _status(port, "127.0.0.4") == 503  # max_connections: "busy"
            for _, writer in flood:
                writer.close()
            assert await _until(lambda: server.gate.held == 4)
            assert await _status(port, "127.0.0.4") == 200  # places freed are taken
            for _, writer in others:
                writer.close()
            assert server.gate.refused == 9
        finally:
            for task in ends:
                task.cancel()


def test_connections_over_the_caps_are_refused_and_the_node_still_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    asyncio.run(_flood(tmp_path))
    lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(lines) == 1  # nine refusals, one line (one a minute at most)
    assert "127.0.0.1" in lines[0].getMessage() and not lines[0].exc_info


async def _slow_headers(tmp_path: Path) -> dict[str, float]:
    limits = HttpLimits(header_timeout_s=0.3, idle_timeout_s=30)
    async with _serving(tmp_path, limits) as (_, port, _):

        async def silent() -> float:  # opens, sends nothing
            reader, _ = await _connect(port, "127.0.0.1")
            return await _closed_after(reader, time.monotonic())

        async def half_a_line() -> float:
            reader, writer = await _connect(port, "127.0.0.2")
            writer.write(b"GET /sta")
            return await _closed_after(reader, time.monotonic())

        async def trickle() -> float:  # a byte every 50 ms: each byte is no new lease of time
            reader, writer = await _connect(port, "127.0.0.3")
            writer.write(b"GET /status HTTP/1.1\r\nX-Slow: ")
            started, closed = time.monotonic(), asyncio.create_task(_until_closed(reader))
            for _ in range(int(DEADLINE_S / 0.05)):
                if closed.done():
                    return time.monotonic() - started
                writer.write(b"a")
                await asyncio.sleep(0.05)  # the client's pace, not synchronization
            closed.cancel()
            return float("inf")

        async def slow_second_request() -> float:  # on a keep-alive connection
            reader, writer = await _connect(port, "127.0.0.4")
            writer.write(STATUS)
            await _response(reader)
            writer.write(b"GET /status HTTP/1.1\r\nHost")
            return await _closed_after(reader, time.monotonic())

        names = ("silent", "half_a_line", "trickle", "slow_second_request")
        calls = (silent(), half_a_line(), trickle(), slow_second_request())
        return dict(zip(names, await asyncio.gather(*calls), strict=True))


def test_a_request_header_not_whole_in_time_loses_its_connection(tmp_path: Path) -> None:
    took = asyncio.run(_slow_headers(tmp_path))
    for case, seconds in took.items():  # header_timeout_s = 0.3, idle_timeout_s = 30
        assert 0.25 < seconds < DEADLINE_S, (case, seconds)


async def _idle(tmp_path: Path) -> None:
    limits = HttpLimits(header_timeout_s=30, idle_timeout_s=0.3, have_wait_s=0.8)
    async with _serving(tmp_path, limits) as (_, port, manifest):
        reader, writer = await _connect(port, "127.0.0.1")
        writer.write(STATUS)
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
        assert 0.25 < await _closed_after(reader, time.monotonic()) < DEADLINE_S

        reader, writer = await _connect(port, "127.0.0.2")  # a long poll outlasts idle_timeout_s
        writer.write(f"GET /have/{manifest.digest} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        log = json.loads((await _response(reader)).split(b"\r\n\r\n", 1)[1])["log"]
        asked = time.monotonic()
        poll = f"GET /have/{manifest.digest}?known=1&log={log} HTTP/1.1\r\nHost: t\r\n\r\n"
        writer.write(poll.encode())
        assert (await _response(reader)).startswith(b"HTTP/1.1 200")
        assert time.monotonic() - asked > 0.7  # held have_wait_s, never cut as idle
        assert 0.25 < await _closed_after(reader, time.monotonic()) < DEADLINE_S  # idle then


def test_an_idle_keep_alive_connection_is_closed_and_a_long_poll_is_not(tmp_path: Path) -> None:
    asyncio.run(_idle(tmp_path))


async def _out_of_descriptors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with _serving(tmp_path, HttpLimits()) as (server, port, _):
        clients = [socket.socket() for _ in range(4)]  # their descriptors, before the limit
        for client in clients:
            client.setblocking(False)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
        os.close(lowest)
        loop = asyncio.get_running_loop()
        try:  # from here on no descriptor can be opened: every accept fails with EMFILE
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
            for client in clients:
                await loop.sock_connect(client, ("127.0.0.1", port))
            assert await _until(lambda: any(r.levelno >= logging.WARNING for r in caplog.records))
            assert await _until(lambda: server.accept_failures.held >= 2)  # and 2 more
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert await _until(lambda: server.gate.held == 4)  # served at its next try
        for client in clients:
            client.close()


def test_accepts_failing_for_want_of_descriptors_are_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    asyncio.run(_out_of_descriptors(tmp_path, caplog))
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # 3 or more failures, one line
    assert "accepting a connection failed (Too many open files" in lines[0].getMessage()
    assert "ulimit -n" in lines[0].getMessage() and not lines[0].exc_info  # no traceback
