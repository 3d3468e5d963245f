"""What a rollout pays per chunk for the peers following its have-map on feeds.

Every chunk that lands wakes every feed held on the node (``GET /have/{digest}?feed=1``: one
per peer following it, up to ``max_peers``), and each answers the news on its open response
and waits again. A real rollout node (store, data view, the data plane's router) on the
in-memory network with no latency holds a manifest of ``--chunks`` chunks and ``--followers``
followers (``download.DataPlaneSource``, the node's own) each on a feed; a chunk lands once
every follower has heard of the one before. Prints the process CPU (node and followers share
it) per chunk and per chunk and follower.

    python benchmarks/have_feeds.py [--chunks 400] [--followers 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from have_news import _follow, _holder  # noqa: E402  (benchmarks/, the script's folder)
from have_polls import CHUNK  # noqa: E402

from p2p_sync.transport.download import DataPlaneSource  # noqa: E402
from p2p_sync.transport.memory import MemoryClient, MemoryNetwork  # noqa: E402


class _Heard(dict[int, float]):
    """A follower's ``seen``: counts, per chunk, the followers that heard of it, and wakes
    the lander once all ``k`` have (so the benchmark waits without spinning)."""

    def __init__(self, tally: dict[int, int], k: int, all_heard: asyncio.Event) -> None:
        super().__init__()
        self.tally, self.k, self.all_heard = tally, k, all_heard

    def setdefault(self, key: int, default: float) -> float:  # type: ignore[override]
        if key not in self:
            self.tally[key] = self.tally.get(key, 0) + 1
            if self.tally[key] == self.k:
                self.all_heard.set()
        return super().setdefault(key, default)


async def run(n: int, k: int) -> float:
    """Process CPU seconds for ``n`` chunks landing on a node ``k`` peers follow."""
    network = MemoryNetwork(0.0)
    with tempfile.TemporaryDirectory() as tmp:
        node, m, payload = _holder(Path(tmp), network, n)
        url = await node.start()
        tally: dict[int, int] = {}
        all_heard = asyncio.Event()
        seen = [_Heard(tally, k, all_heard) for _ in range(k)]
        followers = [
            asyncio.create_task(
                _follow(
                    DataPlaneSource(MemoryClient(network, f"http://f{j}.mem:9"), lambda: [url]),
                    url,
                    m,
                    True,
                    seen[j],
                )
            )
            for j in range(k)
        ]
        try:
            async with asyncio.timeout(60 + n * k / 100):
                start = time.process_time()
                for i in range(n):
                    all_heard.clear()
                    node.store.put_chunk(payload[i * CHUNK : (i + 1) * CHUNK])
                    node.view.notify_have()
                    await all_heard.wait()
                cpu = time.process_time() - start
                await asyncio.gather(*followers)
        finally:
            for f in followers:
                f.cancel()
            await node.stop()
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=400)
    ap.add_argument("--followers", type=int, nargs="+", default=[8, 32])
    args = ap.parse_args()
    for k in args.followers:
        cpu = asyncio.run(run(args.chunks, k))
        print(
            f"{args.chunks} chunks, {k:>3} followers on feeds: {cpu:.3f} s CPU, "
            f"{1e3 * cpu / args.chunks:.3f} ms per chunk, "
            f"{1e6 * cpu / (args.chunks * k):.0f} us per chunk and follower",
            flush=True,
        )


if __name__ == "__main__":
    main()
