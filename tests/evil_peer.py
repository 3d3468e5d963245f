"""A hostile peer for tests: relays the trainer's genuine manifests, claims every chunk, and
serves garbage of the right length. Honest nodes must ban it and still converge."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web


async def main(trainer: str) -> None:
    session = aiohttp.ClientSession()
    served = {"served": 0}

    async def proxy(request: web.Request) -> web.Response:
        async with session.get(trainer + request.path) as resp:
            return web.Response(body=await resp.read(), status=resp.status)

    async def have(request: web.Request) -> web.Response:
        async with session.get(f"{trainer}/manifest/{request.match_info['d']}") as resp:
            if resp.status != 200:
                raise web.HTTPNotFound()
            import json

            doc = json.loads(await resp.read())
        return web.json_response({"have": list(range(len(doc["signed"]["chunks"])))})

    async def chunk(request: web.Request) -> web.Response:
        served["served"] += 1
        return web.Response(body=b"\0" * 16384)  # wrong bytes (length right for full chunks)

    async def chunks(request: web.Request) -> web.Response:  # a run: as many wrong chunks
        served["served"] += 1
        return web.Response(body=b"\0" * 16384 * (len(request.match_info["shas"]) // 64))

    app = web.Application()
    app.add_routes(
        [
            web.get("/manifests", proxy),
            web.get("/manifest/{d}", proxy),
            web.get("/peers", proxy),
            web.get("/have/{d}", have),
            web.get("/chunk/{sha}", chunk),
            web.get("/chunks/{shas}", chunks),
            web.get("/stats", lambda r: web.json_response(served)),
            web.post("/announce", lambda r: web.json_response({}, status=202)),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
