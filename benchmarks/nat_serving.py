"""What serving chunks costs on each way a node can serve: HTTP (a public node), a reverse
channel (a WebSocket a node behind NAT opened: ``transport.reverse``) and libp2p streams
(``transport.streams``: what two NATed nodes use, through a relay or not).

Both ends run in this one process on loopback, so the figure is the CPU the pair spends per
byte (the link is not the limit): MiB/s and CPU seconds per GiB, ``--chunks`` chunks of
``--chunk-kb`` fetched ``--concurrency`` at a time, as a scheduler pipelines them.

    python benchmarks/nat_serving.py [--chunks 200] [--chunk-kb 1024] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiohttp import web  # noqa: E402

from p2p_sync.transport.dataplane import DataRouter  # noqa: E402
from p2p_sync.transport.http import DataClient, DataServer  # noqa: E402
from p2p_sync.transport.limits import HttpLimits  # noqa: E402
from p2p_sync.transport.reverse import (  # noqa: E402
    PATH,
    ReverseClient,
    ReverseHub,
    ReverseLinks,
)

LIMITS = HttpLimits(max_concurrent_uploads=64)
Fetch = Callable[[str], Awaitable[bytes]]


class _Chunks:
    """A node holding one chunk (all the data plane needs of it here)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.sha = data, hashlib.sha256(data).hexdigest()

    def chunk(self, sha256: str) -> bytes | None:
        return self.data if sha256 == self.sha else None

    def count_upload(self, nbytes: int) -> None:
        pass

    def upload_contact(self, requester: str, pending: bool) -> None:
        pass

    def requester(self, url: str, remote: str | None, upload: bool) -> None:
        pass


async def _measure(fetch: Fetch, base: str, view: _Chunks, n: int, conc: int) -> dict[str, float]:
    url = f"{base}/chunk/{view.sha}"
    await fetch(url)  # warm: connections and streams up
    queue = iter(range(n))

    async def worker() -> None:
        for _ in queue:
            assert len(await fetch(url)) == len(view.data)

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gib = n * len(view.data) / 2**30
    return {"MiB/s": gib * 1024 / wall, "CPU s/GiB": cpu / gib}


@asynccontextmanager
async def _http(view: _Chunks) -> AsyncIterator[tuple[Fetch, str]]:
    server = DataServer(view, LIMITS)  # type: ignore[arg-type]
    port = await server.start("127.0.0.1", 0)
    client = DataClient(None, LIMITS)
    try:
        yield client.get_bytes, f"http://127.0.0.1:{port}"
    finally:
        await client.close()
        await server.stop()


@asynccontextmanager
async def _reverse(view: _Chunks) -> AsyncIterator[tuple[Fetch, str]]:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    hub = ReverseHub(LIMITS, 4, lambda: None, lambda url: None)
    app = web.Application()
    app.add_routes([web.get(PATH, hub.accept)])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None and site._server.sockets
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    pair = create_new_key_pair()
    peer = str(ID.from_pubkey(pair.public_key))
    links = ReverseLinks(DataRouter(view, LIMITS), pair, peer, 1)  # type: ignore[arg-type]
    links.offer(url)
    async with asyncio.timeout(10):
        while peer not in hub.channels:
            await asyncio.sleep(0.01)  # the channel's handshake, bounded
    try:
        yield ReverseClient(hub, None).get_bytes, f"p2p://{peer}"
    finally:
        await links.close()
        await hub.close()
        await runner.cleanup()


@asynccontextmanager
async def _streams(view: _Chunks) -> AsyncIterator[tuple[Fetch, str]]:
    from p2p_sync.transport.p2p import P2PHost, P2PSettings
    from p2p_sync.transport.streams import StreamClient

    with tempfile.TemporaryDirectory() as tmp:
        server = _p2p_host(P2PHost, P2PSettings, Path(tmp), "a", ())
        await server.start()
        client = _p2p_host(P2PHost, P2PSettings, Path(tmp), "b", (server.addr,))
        await client.start()
        hosts = [server, client]
        server.serve_data(DataRouter(view, LIMITS))  # type: ignore[arg-type]
        try:
            yield StreamClient(client, None, LIMITS).get_bytes, f"p2p://{server.peer_id}"
        finally:
            for host in hosts:
                await host.stop()


def _p2p_host(
    host_cls: Any, settings_cls: Any, root: Path, name: str, bootstrap: tuple[str, ...]
) -> Any:
    settings = settings_cls(
        listen="/ip4/127.0.0.1/tcp/0",
        identity_path=root / f"{name}.key",
        topic="p2psync/bench/announce",
        bootstrap=bootstrap,
    )

    def refuse(data: bytes, known: Callable[[str], bool]) -> Any:
        raise AssertionError("no gossip in this benchmark")

    return host_cls(settings, refuse, lambda *a: None, lambda url: None)


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--chunk-kb", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args(argv)
    view = _Chunks(os.urandom(args.chunk_kb * 1024))
    print(
        f"{args.chunks} chunks of {args.chunk_kb} KiB, {args.concurrency} at a time, both ends "
        f"in one process on loopback ({os.cpu_count()} cores)"
    )
    print(f"{'transport':>16}  {'MiB/s':>8}  {'CPU s/GiB':>10}")
    for name, way in (("HTTP", _http), ("reverse channel", _reverse), ("libp2p streams", _streams)):
        async with way(view) as (fetch, base):
            n = args.chunks if name != "libp2p streams" else max(args.chunks // 8, 8)
            got = await _measure(fetch, base, view, n, args.concurrency)
        print(f"{name:>16}  {got['MiB/s']:>8.0f}  {got['CPU s/GiB']:>10.2f}")


if __name__ == "__main__":
    asyncio.run(main())
