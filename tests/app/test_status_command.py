"""`p2psync status URL` against a running node: its counters, a given peer that is down and its
state, a banned peer with when and why."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from pathlib import Path

from simulations.localswarm import ROOT
from tests.helpers import make_node


async def _ban(node, url: str) -> None:
    node.ban(url, "served chunk 3 failing its hash")


def test_status_command_prints_a_running_node(tmp_path: Path) -> None:
    given = "http://127.0.0.1:9"  # nothing listens there: a given peer that is down
    node = make_node(tmp_path, peers=(given,))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    urls: list[str] = []

    async def serve() -> None:
        urls.append(await node.start())
        started.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True
    )
    thread.start()
    try:
        assert started.wait(10)
        bad = "http://127.0.0.1:7"
        asyncio.run_coroutine_threadsafe(_ban(node, bad), loop).result(10)
        out = subprocess.run(
            [sys.executable, "-m", "node", "status", urls[0]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "bytes_uploaded" in out.stdout and urls[0] in out.stdout
        assert f"given peer       {given} " in out.stdout  # and its state
        assert re.search(rf"banned +{bad} since 20\d\d-.*: served chunk 3 failing", out.stdout)
    finally:
        asyncio.run_coroutine_threadsafe(node.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
