"""How long a chunk's news takes to reach a follower: have feeds against a long poll per answer.

A relay hop costs the news of a chunk (its holder's have-map answer), the request, and the
transfer. This measures the first of those over the in-memory network with a one-way latency
(``MemoryNetwork(latency_s)``: every request and every answer line takes that long): a real
rollout node (its ``DataView`` and have log, the data plane's router) holds a manifest whose
chunks land at random moments (a Poisson stream at ``--rate`` chunks/s, as a relay's arrive),
and one follower (``download.DataPlaneSource``, the node's own) follows its have-map either on
one feed (``GET /have?feed=1``: every answer on the open response, as the node does now) or
with one answer per request (the long poll before feeds: the follower reads the first answer
and asks again from there). Prints, per latency and rate, the news delay (a chunk's landing
to the follower's reading of it) in one-way latencies, and the requests made.

    python benchmarks/have_news.py [--latency-ms 20] [--rate 50 500] [--chunks 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from contextlib import aclosing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from have_polls import CHUNK, distinct_snapshot  # noqa: E402  (benchmarks/, the script's folder)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from p2p_sync.protocol.peers import PeerLimits  # noqa: E402
from p2p_sync.runtime.config import NodeConfig  # noqa: E402
from p2p_sync.runtime.node import Node  # noqa: E402
from p2p_sync.runtime.transports import MemoryTransport  # noqa: E402
from p2p_sync.store import Store  # noqa: E402
from p2p_sync.transport.download import DataPlaneSource, HaveCursor  # noqa: E402
from p2p_sync.transport.memory import MemoryClient, MemoryNetwork  # noqa: E402
from p2p_sync.trust.manifest import Manifest, SwarmPolicy, sign  # noqa: E402


def _holder(root: Path, network: MemoryNetwork, n: int) -> tuple[Node, Manifest, bytes]:
    """A rollout node on ``network`` that knows a signed ``n``-chunk manifest, no chunk yet."""
    key, payload, m = distinct_snapshot(n)
    cfg = NodeConfig(
        role="rollout", data_dir=root, trust=("x",), directory=PeerLimits(poll_interval_s=600)
    )
    policy = SwarmPolicy("bench", (key.public,))
    node = Node(cfg, policy, Store.open(root), MemoryTransport(network, "holder"))
    node.store.put_manifest(m, sign(m, [key]))
    return node, m, payload


async def _land(node: Node, payload: bytes, n: int, rate: float, landed: dict[int, float]) -> None:
    """Chunks land one by one in a random order, ``rate`` a second on average."""
    rng = random.Random(1)
    for i in rng.sample(range(n), n):
        await asyncio.sleep(rng.expovariate(rate))
        node.store.put_chunk(payload[i * CHUNK : (i + 1) * CHUNK])
        landed[i] = time.monotonic()
        node.view.notify_have()


async def _follow(
    source: DataPlaneSource, peer: str, m: Manifest, feed: bool, seen: dict[int, float]
) -> None:
    """Follow ``peer``'s have-map until every chunk was heard of; with ``feed`` False, one
    answer per request (the follower asks again from where it stands)."""
    since = HaveCursor()
    while len(seen) < len(m.chunks):
        async with aclosing(source.have_feed(peer, m, since)) as answers:
            async for have, after in answers:
                now, since = time.monotonic(), after
                for i in have:
                    seen.setdefault(i, now)
                if not feed or len(seen) == len(m.chunks):
                    break


async def run(latency: float, rate: float, n: int, feed: bool) -> dict[str, float]:
    network = MemoryNetwork(latency)
    with tempfile.TemporaryDirectory() as tmp:
        node, m, payload = _holder(Path(tmp), network, n)
        url = await node.start()
        source = DataPlaneSource(MemoryClient(network, "http://follower.mem:9"), lambda: [url])
        landed: dict[int, float] = {}
        seen: dict[int, float] = {}
        try:
            async with asyncio.timeout(60 + 4 * n / rate):
                await asyncio.gather(
                    _land(node, payload, n, rate, landed), _follow(source, url, m, feed, seen)
                )
        finally:
            await node.stop()
    delays = sorted((seen[i] - landed[i]) / latency for i in landed)
    return {
        "mean": statistics.fmean(delays),
        "p50": delays[len(delays) // 2],
        "p90": delays[int(0.9 * len(delays))],
        "max": delays[-1],
        "requests": network.requests["have"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[20.0])
    ap.add_argument("--rate", type=float, nargs="+", default=[50.0, 500.0])
    ap.add_argument("--chunks", type=int, default=300)
    args = ap.parse_args()
    table = Table(title="a chunk's news, landing to follower (in one-way latencies)")
    for col in ("latency", "chunks/s", "follower", "mean", "p50", "p90", "max", "requests"):
        table.add_column(col, justify="right")
    for latency in args.latency_ms:
        for rate in args.rate:
            for feed in (False, True):
                r = asyncio.run(run(latency / 1e3, rate, args.chunks, feed))
                table.add_row(
                    f"{latency:g} ms",
                    f"{rate:g}",
                    "feed" if feed else "poll per answer",
                    *(f"{r[k]:.2f}" for k in ("mean", "p50", "p90", "max")),
                    str(r["requests"]),
                )
    Console().print(table)


if __name__ == "__main__":
    main()
