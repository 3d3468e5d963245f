"""How soon a rollout two hops from the trainer gets its first chunk: early have feeds, forwarding.

A rollout that hears of a version from a relay gets the digest alone and fetches the manifest from
the relay (a round trip); its download then asked every peer it follows for its have-map (a second
round trip) before its first request. With early feeds (``p2p_sync.runtime.early``) it asks the
have-maps while the manifest comes. This runs real nodes (trainer, rollout A that follows it,
rollout B that never talks to the trainer, so it hears every version from A's relay) over the
in-memory network with a one-way latency on every message (``MemoryNetwork(latency_s)``), publishes
versions of the tiny model, and prints B's steps per version (``p2p_sync.runtime.timeline``: heard,
learned, first have-map offering a chunk, first chunk) in one-way latencies after it heard: with
neither, with early feeds alone, and with early feeds and A forwarding the chunks the trainer hands
it (``[download] forward_seed_chunks``, ``p2p_sync.runtime.forwarding``; the default), and how many
chunks A forwarded.

    python benchmarks/relay_start.py [--latency-ms 20] [--versions 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import p2p_sync.runtime.early  # noqa: E402
from p2p_sync.weights.workloads import Workload  # noqa: E402
from tests.nodebase import MemorySwarm  # noqa: E402

STEPS = ("learned", "first_have", "first_chunk", "fetched")
RUNS = {  # name: (early feeds, A forwards)
    "neither": (False, False),
    "early feeds": (True, False),
    "early feeds + forwarding": (True, True),
}


async def _run(
    latency_s: float, versions: int, early: bool, forward: bool
) -> tuple[list[dict[str, float]], int]:
    """B's steps after it heard, per version after v0, in seconds; chunks A forwarded."""
    p2p_sync.runtime.early.MAX_DIGESTS = 2 if early else 0
    tensors = list(Workload("tiny", lr=1e-4, seed=1).versions(versions + 1))
    with tempfile.TemporaryDirectory() as tmp:
        async with MemorySwarm(Path(tmp), latency_s=latency_s) as swarm:
            trainer = await swarm.start_trainer()
            download = swarm.config("a", "rollout").download
            a = await swarm.start_rollout(
                "a", download=replace(download, forward_seed_chunks=4 if forward else 0)
            )
            b = await swarm.start_rollout("b", peers=(a.url,))
            # out of the trainer's reach (as beyond its peer list in a large swarm): B hears
            # of each version only from A's relay, the digest alone
            b.ban(trainer.url or "", "benchmark: two hops from the trainer")
            rows = []
            for v, weights in enumerate(tensors):
                published = await swarm.publish(weights)
                await swarm.converge(v, timeout=60)
                steps = b.timeline.of(published[0].digest)
                if v > 0 and "heard" in steps:
                    rows.append({s: steps[s] - steps["heard"] for s in STEPS if s in steps})
            return rows, a.learner.forwarder.sent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--versions", type=int, default=4)
    args = ap.parse_args(argv)
    lat = args.latency_ms / 1000
    table = Table(
        title=f"rollout B, two hops from the trainer: one-way latencies ({args.latency_ms:g} ms)"
        " after it heard"
    )
    table.add_column("B's start")
    for step in STEPS:
        table.add_column(f"{step} (median, range)", justify="right")
    table.add_column("A forwarded", justify="right")
    for name, (early, forward) in RUNS.items():
        rows, forwarded = asyncio.run(_run(lat, args.versions, early, forward))
        cells = []
        for step in STEPS:
            got = [r[step] / lat for r in rows if step in r]
            cells.append(
                f"{statistics.median(got):.2f} ({min(got):.2f}-{max(got):.2f})" if got else "-"
            )
        table.add_row(name, *cells, str(forwarded))
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
