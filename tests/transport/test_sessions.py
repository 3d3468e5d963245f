"""The client's pool renewed on a newer revocation list: new requests take a new pool, and a
transfer on the old one runs to its end before that pool closes."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.sessions import RenewedPools


async def _renewal_midway() -> dict[str, object]:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"first ")
        await release.wait()
        await resp.write(b"rest")
        return resp

    async def quick(_request: web.Request) -> web.Response:
        return web.Response(body=b"quick")

    app = web.Application()
    app.add_routes([web.get("/slow", slow), web.get("/quick", quick)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    generation = [0]
    sessions = RenewedPools(aiohttp.ClientSession, lambda: generation[0])
    seen: dict[str, object] = {}
    try:
        async with sessions.request("GET", f"http://127.0.0.1:{port}/slow") as resp:
            old = sessions.pool
            seen["first"] = await resp.content.readexactly(6)
            generation[0] += 1  # a newer list adopted meanwhile
            async with sessions.request("GET", f"http://127.0.0.1:{port}/quick") as other:
                seen["quick"] = await other.read()
            seen["renewed"] = sessions.pool is not old and sessions.renewed == 1
            seen["old_open_midway"] = not old.closed
            release.set()
            seen["rest"] = await resp.read()
        seen["old_closed_after"] = old.closed
    finally:
        await sessions.close()
        await runner.cleanup()
    seen["all_closed"] = sessions.pool.closed
    return seen


def test_a_renewed_pool_lets_the_transfer_in_progress_finish_then_closes_the_old_one() -> None:
    seen = asyncio.run(_renewal_midway())
    assert seen["first"] == b"first " and seen["rest"] == b"rest"
    assert seen["quick"] == b"quick" and seen["renewed"] is True
    assert seen["old_open_midway"] is True and seen["old_closed_after"] is True
    assert seen["all_closed"] is True


def test_a_private_servers_idle_connections_outlast_its_clients_keep_alive() -> None:
    """The client closes an idle TLS connection first, so it never sends into one the server
    closed; an open swarm's server keeps its own, shorter idle limit."""
    limits = HttpLimits(tls_keepalive_s=120.0, idle_timeout_s=30.0)
    assert limits.server_idle_s(tls=True) == 150.0
    assert limits.server_idle_s(tls=False) == 30.0
