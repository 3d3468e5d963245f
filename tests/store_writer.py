"""A process that keeps writing to a Store until killed (for the crash-safety test).

Like a node: per version it stores a real artifact (a patch of a small bf16 tensor set, or a
snapshot), logs it, and checkpoints the full weights every third version; at start it rebuilds
its weights from the store (checkpoint + replay). Prints ``committed <version>`` after each
accepted version is durable (or sends it down a pipe, forked from a
preloaded forkserver: the crash test starts 40 writers, and importing torch 40 times would be
most of its minute). Stops by itself after ``--max-versions`` versions so it can never run away.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch
from safetensors.torch import save

from p2p_sync import codec
from p2p_sync.store import Store
from p2p_sync.store.restore import restore
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import PATCH, SNAPSHOT, Manifest, SwarmPolicy, sign
from p2p_sync.weights.patch import diff
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.tensors import layout_fingerprint, layout_of
from p2p_sync.weights.weights_io import write_to


def manifest(key: SigningKey, swarm: str, version: int, payload: bytes) -> Manifest:
    """A snapshot every 5th version, else a patch, in 16 KiB chunks."""
    kind = SNAPSHOT if version % 5 == 0 else PATCH
    base = {} if kind == SNAPSHOT else {"base_version": version - 1, "base_state": "aa" * 16}
    return manifest_for(
        payload,
        swarm=swarm,
        version=version,
        kind=kind,
        target_state="bb" * 16,
        layout="cc" * 16,
        now=0,
        chunk_size=16 * 1024,
        **base,
    )


def put_version(store: Store, key: SigningKey, swarm: str, version: int, payload: bytes):
    """Store one signed artifact and its payload (the pack first, as the trainer does)."""
    m = manifest(key, swarm, version, payload)
    store.put_payload(m, payload)
    store.put_manifest(m, sign(m, [key]))
    return m


def _next(weights: dict[str, torch.Tensor], rnd: random.Random) -> dict[str, torch.Tensor]:
    """The next version: a few hundred bf16 elements nudged by one ulp or so."""
    new = {k: v.clone() for k, v in weights.items()}
    for t in new.values():
        bits = t.view(torch.int16).reshape(-1)
        idx = torch.tensor(rnd.sample(range(bits.numel()), 300))
        steps = [rnd.choice((-2, -1, 1, 2)) for _ in range(300)]
        bits[idx] += torch.tensor(steps, dtype=torch.int16)
    return new


def _initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(64, 96, generator=g).to(torch.bfloat16) for i in range(3)}


def publish(
    store: Store,
    key: SigningKey,
    swarm: str,
    version: int,
    prev: dict[str, torch.Tensor] | None,
    new: dict[str, torch.Tensor],
) -> Manifest:
    """Store one real artifact (a snapshot every 5th version, else the patch from ``prev``)."""
    target, layout = state_hash(new).hex(), layout_fingerprint(layout_of(new)).hex()
    if prev is None or version % 5 == 0:
        payload, extra = save(new), {}
    else:
        patch = diff(prev, new)
        payload, extra = (
            codec.encode(patch),
            {"base_version": version - 1, "base_state": patch.base_hash.hex()},
        )
    kind = SNAPSHOT if not extra else PATCH
    m = manifest_for(
        payload,
        swarm=swarm,
        version=version,
        kind=kind,
        target_state=target,
        layout=layout,
        now=0,
        chunk_size=16 * 1024,
        **extra,
    )
    store.put_payload(m, payload)
    store.put_manifest(m, sign(m, [key]))
    return m


def run(root: str, seed: int, max_versions: int, report: Callable[[int], None]) -> None:
    """Rebuild from the store, then commit up to ``max_versions`` versions, reporting each."""
    rnd = random.Random(seed)
    key = SigningKey.generate()
    swarm = SwarmPolicy("crash", (key.public,)).swarm_id
    store = Store.open(root)
    restored = restore(store)
    prev = restored.weights if restored else None
    start = restored.state.version + 1 if restored else 0
    for version in range(start, start + max_versions):
        new = _next(prev, rnd) if prev is not None else _initial()
        m = publish(store, key, swarm, version, prev, new)
        store.record(version, m.target_state, m.digest)
        if version % 3 == 0:  # checkpoints now and then, as a node does every K versions
            store.set_checkpoint(version, m.target_state, lambda f, w=new: write_to(f, w))
        prev = new
        report(version)


def run_to_pipe(root: str, seed: int, conn: Connection, max_versions: int = 200) -> None:
    """:func:`run` in a forked child (the crash test): each commit goes down ``conn``."""
    run(root, seed, max_versions, conn.send)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-versions", type=int, default=200)
    args = parser.parse_args()
    run(args.root, args.seed, args.max_versions, lambda v: print(f"committed {v}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
