"""What followers' have-map long polls cost a seed while it serves: a real trainer node on
loopback, ``--followers`` peers holding ``GET /have/{digest}?known=N`` polls on it (as rollouts
following it do), and one peer fetching every chunk of an ``--chunks``-chunk manifest.

The simulator charges nothing for a have-map; a node pays for every poll it wakes. Prints, per
number of followers: chunks served per second, the seeder's offers computed per chunk served,
and the process CPU per chunk (server and clients share this one process and event loop; the
followers' polls stay held, so their client side costs nothing while the fetch runs).

    python benchmarks/have_polls.py --chunks 763 --followers 0 8 32 128
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from p2p_sync.runtime.config import NodeConfig  # noqa: E402
from p2p_sync.runtime.trainer import TrainerNode  # noqa: E402
from p2p_sync.store import Store  # noqa: E402
from p2p_sync.transport.messages import PEER_HEADER  # noqa: E402
from p2p_sync.trust.chunks import manifest_for  # noqa: E402
from p2p_sync.trust.keys import SigningKey  # noqa: E402
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, SwarmPolicy, sign  # noqa: E402

CHUNK = 16 * 1024
DEPTH = 4  # the fetcher's requests in flight


def distinct_snapshot(n: int) -> tuple[SigningKey, bytes, Manifest]:
    """Swarm "bench"'s version 0 of ``n`` distinct ``CHUNK``-byte chunks (no tensors behind
    it): a new signing key, the payload and its manifest (also ``have_news.py``'s)."""
    payload = b"".join(i.to_bytes(4, "little") * (CHUNK // 4) for i in range(n))
    m = manifest_for(
        payload,
        swarm="bench",
        version=0,
        kind=SNAPSHOT,
        target_state="00" * 16,
        layout="00" * 16,
        now=int(time.time()),
        chunk_size=CHUNK,
    )
    return SigningKey.generate(), payload, m


def _trainer(root: Path, n: int, outstanding: int) -> tuple[TrainerNode, Manifest]:
    """A trainer holding a signed snapshot of ``n`` distinct chunks."""
    key, payload, m = distinct_snapshot(n)
    cfg = NodeConfig(role="trainer", data_dir=root, key=root / "k", p2p=False)
    cfg = replace(cfg, publish=replace(cfg.publish, seed_outstanding=outstanding))
    node = TrainerNode(cfg, SwarmPolicy("bench", (key.public,)), Store.open(root))
    node.store.put_payload(m, payload)
    node.store.put_manifest(m, sign(m, [key]))
    return node, m


async def _follow(s: aiohttp.ClientSession, url: str, peer: str, stop: asyncio.Event) -> None:
    """A follower: take the seed's offer, then long-poll it until ``stop``."""
    known = ""
    while not stop.is_set():
        async with s.get(f"{url}{known}", headers={PEER_HEADER: peer}) as r:
            known = f"?known={len((await r.json())['have'])}"


async def _fetch_all(s: aiohttp.ClientSession, url: str, m: Manifest) -> None:
    queue = list(m.chunks)

    async def worker() -> None:
        while queue:
            sha = queue.pop()
            async with s.get(
                f"{url}/chunk/{sha}", headers={PEER_HEADER: "http://127.0.0.1:9"}
            ) as r:
                await r.read()

    await asyncio.gather(*(worker() for _ in range(DEPTH)))


async def run(root: Path, n: int, followers: int, outstanding: int) -> dict[str, float]:
    node, m = _trainer(root, n, outstanding)
    url = await node.start()
    offers = [0]
    offer = node.view.seeder.offer

    def counted(keys, requester, now):  # type: ignore[no-untyped-def]
        offers[0] += 1
        return offer(keys, requester, now)

    node.view.seeder.offer = counted  # type: ignore[method-assign]
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            have = f"{url}/have/{m.digest}"
            polls = [
                asyncio.create_task(_follow(s, have, f"http://127.0.0.1:{10 + i}", stop))
                for i in range(followers)
            ]
            router = node.transport.server.router
            for _ in range(1000):  # bounded: until every follower's poll is held
                if router.polls_held >= followers:
                    break
                await asyncio.sleep(0.01)
            offers[0], cpu, t0 = 0, time.process_time(), time.perf_counter()
            await _fetch_all(s, url, m)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
            per_chunk = offers[0] / n
            stop.set()
            node.transport.server.router.close()  # held polls answer now
            await asyncio.gather(*polls, return_exceptions=True)
    finally:
        await node.stop()
    return {"chunks_s": n / wall, "offers": per_chunk, "cpu_ms": cpu / n * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=763)
    ap.add_argument("--followers", type=int, nargs="+", default=[0, 8, 32, 128])
    ap.add_argument("--outstanding", type=int, default=8, help="the seed's hand-outs a peer")
    args = ap.parse_args()
    print(f"{args.chunks} chunks of {CHUNK // 1024} KiB, one fetcher ({DEPTH} in flight)")
    print(f"{'followers':>10} {'chunks/s':>10} {'offers/chunk':>13} {'CPU ms/chunk':>13}")
    for k in args.followers:
        with tempfile.TemporaryDirectory(prefix="have-polls-") as tmp:
            r = asyncio.run(run(Path(tmp), args.chunks, k, args.outstanding))
        print(f"{k:>10} {r['chunks_s']:>10.0f} {r['offers']:>13.2f} {r['cpu_ms']:>13.2f}")


if __name__ == "__main__":
    main()
