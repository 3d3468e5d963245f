"""A process that keeps writing to a Store until killed (for the crash-safety test).

Prints ``committed <version>`` after each accepted version is durable. Stops by itself after
``--max-versions`` versions so it can never run away.
"""

from __future__ import annotations

import argparse
import random
import sys

from p2p_sync.chunks import manifest_for
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import PATCH, SNAPSHOT, Manifest, SwarmPolicy, sign
from p2p_sync.store import Store


def manifest(key: SigningKey, swarm: str, version: int, payload: bytes) -> Manifest:
    """A snapshot every 5th version, else a patch, in 16 KiB chunks."""
    kind = SNAPSHOT if version % 5 == 0 else PATCH
    base = {} if kind == SNAPSHOT else {"base_version": version - 1, "base_state": "aa" * 16}
    return manifest_for(payload, swarm=swarm, version=version, kind=kind,
                        target_state="bb" * 16, layout="cc" * 16, now=0, chunk_size=16 * 1024,
                        **base)  # fmt: skip


def put_version(store: Store, key: SigningKey, swarm: str, version: int, payload: bytes):
    """Store one signed artifact and its payload (the pack first, as the trainer does)."""
    m = manifest(key, swarm, version, payload)
    store.put_payload(m, payload)
    store.put_manifest(m, sign(m, [key]))
    return m


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-versions", type=int, default=200)
    args = parser.parse_args()
    rnd = random.Random(args.seed)
    key = SigningKey.generate()
    swarm = SwarmPolicy("crash", (key.public,)).swarm_id
    store = Store.open(args.root)
    start = store.state.version + 1 if store.state else 0
    for version in range(start, start + args.max_versions):
        put_version(store, key, swarm, version, rnd.randbytes(rnd.randint(1, 120_000)))
        weights = rnd.randbytes(rnd.randint(1, 50_000))
        store.set_weights(version, f"{version:032x}", lambda p, w=weights: p.write_bytes(w))
        print(f"committed {version}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
