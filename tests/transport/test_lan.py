"""LAN shortcuts (``transport.lan``): when a ``p2p://`` peer is reached over plain HTTP, and
what a peer lying about itself gets. Real aiohttp servers on loopback play the peer's HTTP
side; the libp2p side (a stream's answer, the connection's address) is given, as the end to
end test in tests/transport/test_nat_serving.py runs it for real."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web

from p2p_sync.errors import PeerError, PeerUnreachableError
from p2p_sync.transport import lan
from p2p_sync.transport.http import DataClient
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.streams import RoutedClient

PEER = "12D3KooWK5vggqznNioT6L4cMa5njSEfvegwGMBQHBo7Fu6u2B42"
OTHER = "12D3KooWLpxUyNMxRgZMGBcffFypCPvoCbBBcc6txYfwWKXeHvmZ"


@pytest.mark.parametrize(
    ("address", "port", "url"),
    [
        ("192.168.1.7", 8000, "http://192.168.1.7:8000"),
        ("fd00::7", 8000, "http://[fd00::7]:8000"),
        ("0.0.0.0", 8000, None),  # nowhere to dial
        ("224.0.0.1", 8000, None),
        ("example.org", 8000, None),  # an address, not a name
        ("10.0.0.1", 0, None),
        ("10.0.0.1", 70000, None),
        ("10.0.0.1", "8000", None),
        ("10.0.0.1", True, None),
        ("10.0.0.1", None, None),
    ],
)
def test_a_shortcut_is_an_ip_address_and_a_port_number(address, port, url) -> None:
    assert lan.shortcut_url(address, port) == url


def test_p2p_urls_split_into_the_peer_and_the_rest() -> None:
    assert lan.split_base(f"p2p://{PEER}/have/ab?known=3") == (f"p2p://{PEER}", "/have/ab?known=3")
    assert lan.split_base(f"p2p://{PEER}") == (f"p2p://{PEER}", "")


class Streams:
    """The libp2p side of a probe: what ``GET /whoami`` over a stream answers, counted."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.asked, self.limits = answer, [], HttpLimits()
        self.self_url = None

    async def get_json(self, url: str) -> Any:
        self.asked.append(url)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def get_bytes(self, url: str, limit: int | None = None) -> bytes:
        self.asked.append(url)
        return b"over streams"

    async def close(self) -> None:
        pass


async def _serving(doc: Any, delay: float = 0.0) -> tuple[web.AppRunner, int]:
    """A real HTTP server answering ``/whoami`` with ``doc`` (raw bytes as they are)."""

    async def whoami(_: web.Request) -> web.Response:
        await asyncio.sleep(delay)  # a peer that never answers in time
        body = doc if isinstance(doc, bytes) else None
        return web.Response(body=body) if body is not None else web.json_response(doc)

    app = web.Application()
    app.router.add_get("/whoami", whoami)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def _probe(
    answer: Any, address: str | None = "127.0.0.1", delay: float = 0.0, held: tuple = ()
) -> dict:
    runner, port = await _serving(answer, delay)
    http, streams = DataClient(None), Streams({"peer": PEER, "port": port})

    async def where(peer: str) -> str | None:
        assert peer == PEER
        return address

    shortcuts = lan.LanShortcuts(http, streams, where)
    shortcuts.routes.update((f"p2p://{p}", "http://10.0.0.1:1") for p in held)
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        shortcuts.consider(f"p2p://{PEER}/have/ab")
        await asyncio.wait_for(asyncio.gather(*shortcuts._probes.values()), 5)
        took = loop.time() - t0
        shortcuts.consider(f"p2p://{PEER}/chunk/cd")  # failed just now: not again
        again = len(shortcuts._probes)
        return {"routes": shortcuts.routes, "asked": streams.asked, "again": again} | {
            "port": port,
            "took": took,
        }
    finally:
        await shortcuts.close()
        await http.close()
        await runner.cleanup()


def test_a_shortcut_holds_when_the_address_answers_as_the_peer() -> None:
    out = asyncio.run(_probe({"peer": PEER, "port": 1}))
    assert out["routes"] == {f"p2p://{PEER}": f"http://127.0.0.1:{out['port']}"}
    assert out["asked"] == [f"p2p://{PEER}/whoami"]


def test_shortcuts_are_bounded_the_oldest_goes_first(monkeypatch) -> None:
    monkeypatch.setattr(lan, "MAX_ROUTES", 2)
    out = asyncio.run(_probe({"peer": PEER, "port": 1}, held=("Q" * 46, "R" * 46)))
    assert list(out["routes"]) == [f"p2p://{'R' * 46}", f"p2p://{PEER}"]


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"peer": OTHER, "port": 1}, "another node there (a relay's address, a reused port)"),
        ([PEER], "not an object"),
        (b"\xff not json", "not JSON"),
    ],
)
def test_no_shortcut_where_the_address_does_not_answer_as_the_peer(answer, why) -> None:
    out = asyncio.run(_probe(answer))
    assert out["routes"] == {}, why
    assert out["again"] == 0  # asked again only after RETRY_S


def test_no_shortcut_without_a_direct_connection() -> None:
    """Only a relayed connection (or none) after the stream request: nothing to dial."""
    out = asyncio.run(_probe({"peer": PEER, "port": 1}, address=None))
    assert out["routes"] == {} and out["asked"] == [f"p2p://{PEER}/whoami"]
    assert out["again"] == 0


async def _first_request_connects() -> dict:
    """No connection to the peer when the probe starts (the node's first request to it is
    what dials it, on a loaded machine): the stream request comes first and connects."""
    runner, port = await _serving({"peer": PEER, "port": 1})
    http, streams = DataClient(None), Streams({"peer": PEER, "port": port})

    async def where(_: str) -> str | None:
        return "127.0.0.1" if streams.asked else None  # up once a stream went out

    shortcuts = lan.LanShortcuts(http, streams, where)
    try:
        shortcuts.consider(f"p2p://{PEER}/have/ab")
        await asyncio.wait_for(asyncio.gather(*shortcuts._probes.values()), 5)
        return {"routes": shortcuts.routes, "port": port}
    finally:
        await shortcuts.close()
        await http.close()
        await runner.cleanup()


def test_the_probe_asks_over_streams_before_it_reads_the_connection() -> None:
    out = asyncio.run(_first_request_connects())
    assert out["routes"] == {f"p2p://{PEER}": f"http://127.0.0.1:{out['port']}"}


def test_an_address_that_never_answers_costs_one_probe_timeout(monkeypatch) -> None:
    monkeypatch.setattr(lan, "PROBE_TIMEOUT_S", 0.2)
    out = asyncio.run(_probe({"peer": PEER, "port": 1}, delay=1.0))
    assert out["routes"] == {} and 0.2 <= out["took"] < 1.0 and out["again"] == 0


async def _dropped() -> dict:
    with socket.socket() as s:  # a port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    http, streams = DataClient(None), Streams(PeerError("unused"))
    shortcuts = lan.LanShortcuts(http, streams, lambda _p: asyncio.sleep(0, None))
    shortcuts.routes[f"p2p://{PEER}"] = f"http://127.0.0.1:{dead}"
    client = RoutedClient(http, streams, None, shortcuts)  # type: ignore[arg-type]
    url = f"p2p://{PEER}/chunk/{'ab' * 32}"
    try:
        with pytest.raises(PeerUnreachableError):
            await client.get_bytes(url)
        after = dict(shortcuts.routes)
        data = await client.get_bytes(url)  # over streams now, and no new probe for a while
        return {"after": after, "data": data, "probes": len(shortcuts._probes)}
    finally:
        await client.close()


def test_a_shortcut_that_stops_connecting_is_dropped_for_streams() -> None:
    out = asyncio.run(_dropped())
    assert out["after"] == {} and out["data"] == b"over streams" and out["probes"] == 0


async def _counted() -> int:
    """A manifest and a chunk fetched over a shortcut: only the chunk is counted, as the
    serving side counts only chunk bytes uploaded."""

    async def manifest(_: web.Request) -> web.Response:
        return web.Response(body=b"m" * 300)

    async def chunk(_: web.Request) -> web.Response:
        return web.Response(body=b"c" * 1000)

    app = web.Application()
    app.router.add_get("/manifest/{d}", manifest)
    app.router.add_get("/chunk/{d}", chunk)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    http, streams = DataClient(None), Streams(PeerError("unused"))
    shortcuts = lan.LanShortcuts(http, streams, lambda _p: asyncio.sleep(0, None))
    shortcuts.routes[f"p2p://{PEER}"] = f"http://127.0.0.1:{port}"
    client = RoutedClient(http, streams, None, shortcuts)  # type: ignore[arg-type]
    try:
        assert await client.get_bytes(f"p2p://{PEER}/manifest/{'ab' * 32}") == b"m" * 300
        assert await client.get_bytes(f"p2p://{PEER}/chunk/{'cd' * 32}") == b"c" * 1000
        return shortcuts.bytes_downloaded
    finally:
        await client.close()
        await runner.cleanup()


def test_a_shortcut_counts_the_chunk_bytes_it_carried() -> None:
    assert asyncio.run(_counted()) == 1000


async def _not_asked(monkeypatch) -> tuple[dict, int, int]:
    """The stream request fails (libp2p knows no address for the peer yet): no verdict, so
    a request within ``ASK_AGAIN_S`` starts no probe, one after it does."""
    http, streams = DataClient(None), Streams(PeerError("No known addresses to peer"))
    clock = [1000.0]
    monkeypatch.setattr(lan.time, "monotonic", lambda: clock[0])
    shortcuts = lan.LanShortcuts(http, streams, lambda _p: asyncio.sleep(0, "127.0.0.1"))
    try:
        shortcuts.consider(f"p2p://{PEER}/have/ab")
        await asyncio.gather(*shortcuts._probes.values())
        clock[0] += lan.ASK_AGAIN_S - 0.1
        shortcuts.consider(f"p2p://{PEER}/have/ab")
        soon = len(shortcuts._probes)
        await asyncio.gather(*shortcuts._probes.values())
        clock[0] += 0.2
        shortcuts.consider(f"p2p://{PEER}/have/ab")
        later = len(shortcuts._probes)
        await asyncio.gather(*shortcuts._probes.values())
        return shortcuts.routes, soon, later
    finally:
        await shortcuts.close()
        await http.close()


def test_a_probe_that_could_not_ask_the_peer_asks_again_soon(monkeypatch) -> None:
    routes, soon, later = asyncio.run(_not_asked(monkeypatch))
    assert routes == {} and (soon, later) == (0, 1)
