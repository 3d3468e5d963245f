"""What a rollout's have-map costs per version: listed whole after every chunk, or grown.

A node lists its have-map after every chunk that lands (its followers' long polls answer the
news). Listing it whole each time (``Store.have_indices`` and a ``HaveLog.sync`` of the list)
made a version O(chunks^2); ``DataView.have`` now adds only what arrived since
(``Store.held_since``, ``HaveLog.grow``). A real rollout node (store, data view) holds a
manifest of ``--chunks`` chunks that land one by one in a random order; prints, per mode, the
CPU seconds of the listings over the version, per chunk, and the store's own writes for
scale. ``chunks.TARGET_CHUNKS`` (1,536) is what the trainer aims at for any payload above
~100 MB.

    python benchmarks/have_listing.py [--chunks 384 1536 3072]
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from have_news import _holder  # noqa: E402  (benchmarks/, the script's folder)
from have_polls import CHUNK  # noqa: E402

from p2p_sync.protocol.havelog import HaveLog  # noqa: E402
from p2p_sync.transport.memory import MemoryNetwork  # noqa: E402


def run(n: int, whole: bool) -> tuple[float, float]:
    """(seconds of listings, seconds of ``put_chunk``) for one version of ``n`` chunks."""
    with tempfile.TemporaryDirectory() as tmp:
        node, m, payload = _holder(Path(tmp), MemoryNetwork(0.0), n)
        log, listed, put = HaveLog(), 0.0, 0.0
        for i in random.Random(1).sample(range(n), n):
            t0 = time.process_time()
            node.store.put_chunk(payload[i * CHUNK : (i + 1) * CHUNK])
            t1 = time.process_time()
            node.view.notify_have()
            if whole:  # what the node did before: the whole map, and its log synced to it
                log = log.sync(node.store.have_indices(m))
            else:
                node.view.have(m.digest, None)
            listed, put = listed + time.process_time() - t1, put + t1 - t0
        held = log.order if whole else node.view.have_log(m.digest).order  # type: ignore[union-attr]
        assert sorted(held) == list(range(n)), "the map must end whole"
    return listed, put


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[384, 1536, 3072])
    args = ap.parse_args()
    for n in args.chunks:
        for whole in (True, False):
            listed, put = run(n, whole)
            print(
                f"{n:>6} chunks, {'listed whole' if whole else 'grown':>12}: listings "
                f"{listed:.3f} s CPU ({1e3 * listed / n:.3f} ms per chunk); put_chunk {put:.3f} s",
                flush=True,
            )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
