"""A hostile peer for tests: relays the trainer's genuine manifests and claims every chunk.

What it does with a chunk request depends on its ``mode``: ``garbage`` serves wrong bytes of
the right length (honest nodes must ban it and still converge), ``silent`` accepts the request
and never answers, ``half`` sends half of the chunk's bytes and then falls silent (honest nodes
must count either as not served, stop waiting on it, and still reach the head).

Run in a test's own event loop: ``app(TRAINER_URL, mode)``, an
:class:`aiohttp.web.Application` (``serve`` starts it on loopback). A peer that holds the real
artifacts and corrupts what it serves runs on the in-memory swarm instead
(``tests/protocol/test_control_plane.py``).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

MODES = ("garbage", "silent", "half")
HOLD_S = 0.2  # how long its have feed stays open after its answer (a node's have_wait_s)
STATS = web.AppKey("stats", dict[str, int])  # chunk requests taken: {"served": n}


def app(trainer: str, mode: str = "garbage") -> web.Application:
    """The hostile peer's routes, relaying to ``trainer``; ``app[STATS]["served"]`` counts
    the chunk requests it took."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    stats = {"served": 0}
    lengths: dict[str, int] = {}  # chunk sha -> its length, from the manifests relayed
    closing = asyncio.Event()  # set at cleanup: held requests end
    session: list[aiohttp.ClientSession] = []

    async def start(_app: web.Application) -> None:
        session.append(aiohttp.ClientSession())

    async def stop(_app: web.Application) -> None:
        closing.set()
        await session[0].close()

    async def proxy(request: web.Request) -> web.Response:
        async with session[0].get(trainer + request.path) as resp:
            return web.Response(body=await resp.read(), status=resp.status)

    async def have(request: web.Request) -> web.StreamResponse:
        async with session[0].get(f"{trainer}/manifest/{request.match_info['d']}") as resp:
            if resp.status != 200:
                raise web.HTTPNotFound()
            signed = json.loads(await resp.read())["signed"]
        size, step = signed["payload_size"], signed["chunk_size"]
        for i, sha in enumerate(signed["chunks"]):
            lengths[sha] = min(step, size - i * step)
        reply = web.StreamResponse()
        answer = {"have": list(range(len(signed["chunks"])))}  # a whole list, every time
        try:
            await reply.prepare(request)
            await reply.write(json.dumps(answer).encode() + b"\n")
            if mode != "garbage":  # a feed held open, as a node's, then ended: asked again
                await asyncio.wait_for(closing.wait(), HOLD_S)
        except (TimeoutError, ConnectionError):
            pass  # held long enough, or the follower left
        return reply

    async def hold(request: web.Request, body: bytes) -> web.StreamResponse:
        """Answer with ``body`` of the full length announced, then fall silent."""
        reply = web.StreamResponse()
        reply.content_length = 2 * len(body) or 1
        try:
            await reply.prepare(request)
            if body:
                await reply.write(body)
        except ConnectionError:
            return reply  # the requester gave up already
        await closing.wait()
        return reply

    async def chunk(request: web.Request) -> web.StreamResponse:
        stats["served"] += 1
        if mode == "garbage":
            return web.Response(body=b"\0" * 16384)  # wrong bytes (length right for full chunks)
        half = b"\0" * (lengths.get(request.match_info["sha"], 16384) // 2)
        return await hold(request, half if mode == "half" else b"")

    async def chunks(request: web.Request) -> web.StreamResponse:  # a run
        stats["served"] += 1
        if mode == "garbage":  # as many wrong chunks
            return web.Response(body=b"\0" * 16384 * (len(request.match_info["shas"]) // 64))
        first = request.match_info["shas"][:64]
        half = b"\0" * (lengths.get(first, 16384) // 2)
        return await hold(request, half if mode == "half" else b"")

    async def report(_request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def announced(_request: web.Request) -> web.Response:
        return web.json_response({}, status=202)

    application = web.Application()
    application[STATS] = stats
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    application.add_routes(
        [
            web.get("/manifests", proxy),
            web.get("/manifest/{d}", proxy),
            web.get("/peers", proxy),
            web.get("/have/{d}", have),
            web.get("/chunk/{sha}", chunk),
            web.get("/chunks/{shas}", chunks),
            web.get("/stats", report),
            web.post("/announce", announced),
        ]
    )
    return application


async def serve(application: web.Application) -> tuple[web.AppRunner, str]:
    """Start ``application`` on a free loopback port: its runner and URL."""
    runner = web.AppRunner(application, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"
