"""What the trainer's seeder costs per version: one offer per chunk it serves.

A trainer node answers each follower's have feed with ``SuperSeeder.offer`` over the whole
manifest, and serving a chunk wakes its requester's feed (``runtime.dataview``): a version
costs one offer per chunk served, so a pass over the manifest per offer is quadratic in the
chunks. Here ``--followers`` requesters ask in turn; each fetches one chunk it is shown (the
seed asks ``may_serve`` and notes the upload, as the node does), and asks again, until every
chunk is out: one offer per chunk served. Run on the seeder (arrays) and on the pass it replaced
(``tests/protocol/reference_seeder.py``), the same calls on both. Prints the offers made,
microseconds per offer and the seeder's seconds per version.

    python benchmarks/seeder.py [--chunks 1536 4096] [--followers 1 32 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2p_sync.protocol.seeding import SuperSeeder  # noqa: E402
from p2p_sync.protocol.versions import PublishPolicy  # noqa: E402
from tests.protocol.reference_seeder import ScanningSeeder  # noqa: E402

STEP_S = 0.0005  # between two offers: a 1,536-chunk version served in ~1 s


def version(seeder: SuperSeeder, chunks: int, followers: int) -> tuple[int, float]:
    """Offers made and seconds spent serving one version of ``chunks`` chunks."""
    keys = tuple(f"{i:064x}" for i in range(chunks))
    served, offers, now = set[int](), 0, 0.0
    start = time.perf_counter()
    while len(served) < chunks and offers < 50 * chunks:
        for f in range(followers):
            shown = seeder.offer(keys, f, now)
            offers += 1
            now += STEP_S
            for i in [i for i in shown if i not in served][:1]:  # each one wakes its feed
                if seeder.may_serve(keys[i], f, now):
                    seeder.note_served(keys[i], f, now)
                    served.add(i)
    return offers, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1536, 4096])
    ap.add_argument("--followers", type=int, nargs="+", default=[1, 32, 256])
    args = ap.parse_args()
    print(f"{'chunks':>7} {'followers':>9} {'offers':>7} {'pass us':>8} {'arrays us':>9} ", end="")
    print(f"{'pass s':>7} {'arrays s':>8} {'x':>6}")
    for chunks in args.chunks:
        for followers in args.followers:
            policy = PublishPolicy()  # the trainer's defaults
            n_old, t_old = version(ScanningSeeder.of(policy), chunks, followers)
            n_new, t_new = version(SuperSeeder.of(policy), chunks, followers)
            assert n_old == n_new, "the two seeders diverged"
            print(
                f"{chunks:>7} {followers:>9} {n_new:>7} {1e6 * t_old / n_old:>8.0f} "
                f"{1e6 * t_new / n_new:>9.0f} {t_old:>7.3f} {t_new:>8.3f} {t_old / t_new:>6.1f}"
            )


if __name__ == "__main__":
    main()
