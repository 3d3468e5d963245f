"""The trainer role: publish every new version as signed, chunked artifacts, and seed them.

``Publisher.publish(state_dict)`` is the Python API (call it after an optimizer step); the CLI
drives it from ``--watch DIR``. Per version it publishes what ``versions.PublishPolicy`` says
(1-step patch, periodic anchor snapshot, aligned merged catch-up patches), stores and serves
the chunks, persists the weights, and announces the manifests to its peers.

Seeding: the trainer's have-map answers come from ``p2p_sync.seeding.SuperSeeder`` (each
requester is shown chunks of its own), so the trainer's upload stays near one copy of the
payload however many rollouts there are.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from node.runtime import Node
from p2p_sync import codec
from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.chunks import file_chunk_hashes, manifest_for
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import PATCH, SNAPSHOT, Manifest, sign
from p2p_sync.patch import Patch, apply, diff, merge
from p2p_sync.restore import restore
from p2p_sync.seeding import SuperSeeder
from p2p_sync.tensors import TensorSet, layout_fingerprint, layout_of, state_hash
from p2p_sync.versions import PublishPolicy, to_publish
from p2p_sync.weights_io import load_weights, save_weights, write_to

log = logging.getLogger("p2psync.trainer")

# Frames are independent, and zstd and numpy release the GIL: encode on every core.
WORKERS = os.cpu_count() or 1
Built = tuple[Manifest, bytes, bytes | Path]  # manifest, its signed bytes, payload (or its file)


class TrainerNode(Node):
    """A node that seeds: each requester is shown a few chunks of its own (super-seeding)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seeder = SuperSeeder(self.cfg.seed_outstanding, self.cfg.reseed_after_s)

    def chunk(self, sha256: str) -> bytes | None:
        data = super().chunk(sha256)
        if data is not None:
            self.seeder.note_served(sha256)
            self.notify_have()  # its requester may be offered more now
        return data

    def have(self, digest: str, requester: str | None) -> list[int] | None:
        m = self.manifest(digest)
        if m is None:
            return None
        return self.seeder.offer(m.chunks, requester, time.monotonic())


@dataclass
class PublishTimings:
    """Where one publish spent its time (seconds), for logs, /status and benchmarks."""

    version: int = -1
    diff_s: float = 0.0
    encode_s: float = 0.0
    hash_sign_s: float = 0.0
    store_s: float = 0.0
    snapshot_s: float = 0.0  # anchors only: writing the full weights as a pack (and hashing it)
    total_s: float = 0.0
    patch_bytes: int = 0
    finished_at: float = 0.0  # wall clock (time.time()) when the manifests were announced


class Publisher:
    """Turns successive state dicts into published versions.

    It holds one copy of the last published weights (``prev``: a diff needs the old bits) and
    keeps it current by applying each 1-step patch to it in place: O(patch) per version, no
    per-version copy. Durable state is the store's checkpoint and log (``p2p_sync.store``): the
    published artifacts are the log; anchors double as checkpoints, and full weights are
    written otherwise only every ``checkpoint_every`` versions and at ``close()``.
    """

    def __init__(
        self, node: Node, key: SigningKey, policy: PublishPolicy, checkpoint_every: int = 10
    ) -> None:
        self.node, self.key, self.policy = node, key, policy
        self.checkpoint_every = checkpoint_every
        self.prev: dict[str, torch.Tensor] | None = None
        self.prev_hash: bytes | None = None
        self.timings = PublishTimings()
        # Recent 1-step patches for merged catch-up patches, kept encoded (format 1, fast to
        # decode, no base needed): decoded, 16 steps of a 1B model would hold ~5 GB of
        # positions; encoded they hold ~16 patch payloads.
        self.history: collections.deque[bytes] = collections.deque(
            maxlen=max(policy.catchup_spans, default=0)
        )
        restored = restore(node.store, workers=WORKERS)
        if restored is not None:
            self.prev, self.prev_hash = restored.weights, bytes.fromhex(restored.state.state_hash)

    @property
    def next_version(self) -> int:
        state = self.node.store.state
        return state.version + 1 if state else 0

    def _payloads(self, version: int, step: Patch | None) -> list[tuple[str, int | None, Patch]]:
        out: list[tuple[str, int | None, Patch]] = []
        for kind, base in to_publish(version, self.policy):
            if kind == PATCH and base == version - 1 and step is not None:
                out.append((PATCH, base, step))
            elif kind == PATCH and base is not None and version - base <= len(self.history):
                out.append((PATCH, base, self._merged(version - base)))
        return out

    def _merged(self, span: int) -> Patch:
        """The last ``span`` steps as one patch, merged one decoded step at a time."""
        steps = list(self.history)[-span:]
        acc = codec.decode(steps[0], workers=WORKERS)
        for data in steps[1:]:
            acc = merge([acc, codec.decode(data, workers=WORKERS)])
        return acc

    def _manifest(self, version: int, kind: str, target: str, layout: str,
                  payload: bytes | None, **extra) -> Manifest:  # fmt: skip
        return manifest_for(
            payload, swarm=self.node.policy.swarm_id, version=version, kind=kind,
            target_state=target, layout=layout, now=int(time.time()),
            lifetime_s=self.node.cfg.manifest_lifetime_s, chunk_size=self.node.cfg.chunk_size,
            **extra,
        )  # fmt: skip

    def _snapshot(self, version: int, new: TensorSet, target: str, layout: str) -> Built:
        """The anchor: written straight to a pack file one tensor at a time, hashed by reading
        it back block by block; the bytes never sit in memory as one payload."""
        fd, name = tempfile.mkstemp(prefix=".snapshot-", suffix=".tmp", dir=self.node.store.root)
        with os.fdopen(fd, "wb") as f:
            write_to(f, new)
        t0 = time.perf_counter()
        chunks = file_chunk_hashes(name, self.node.cfg.chunk_size)
        m = self._manifest(version, SNAPSHOT, target, layout, None, chunks=chunks)
        self.timings.hash_sign_s += time.perf_counter() - t0
        return m, sign(m, [self.key]), Path(name)

    def _build(self, new: TensorSet) -> tuple[int, str, Patch | None, list[Built]]:
        """CPU-heavy part (diff, encode, hash, sign), run in a worker thread."""
        version = self.next_version
        t = self.timings = PublishTimings(version)
        t0 = time.perf_counter()
        step = None
        if self.prev is not None and version > 0:
            step = diff(self.prev, new, base_hash=self.prev_hash, workers=WORKERS)
            if self.history.maxlen:
                self.history.append(codec.encode(step, level=1, workers=WORKERS))
        target = (step.target_hash if step else state_hash(new)).hex()  # diff hashed it already
        layout = layout_fingerprint(layout_of(new)).hex()
        t.diff_s = time.perf_counter() - t0
        built: list[Built] = []
        if version % self.policy.anchor_every == 0:
            t1 = time.perf_counter()
            built.append(self._snapshot(version, new, target, layout))
            t.snapshot_s = time.perf_counter() - t1
        for kind, base, patch in self._payloads(version, step):
            t1 = time.perf_counter()
            if base == version - 1 and self.node.cfg.patch_format == 2:  # base is ``prev``
                payload = codec.encode(patch, workers=WORKERS, base=self.prev,
                                       base_hash=self.prev_hash)  # fmt: skip
            else:  # a merged catch-up patch: its base is not held here, format 1 coding
                payload = codec.encode(patch, workers=WORKERS)
            t2 = time.perf_counter()
            m = self._manifest(version, kind, target, layout, payload, base_version=base,
                               base_state=patch.base_hash.hex())  # fmt: skip
            built.append((m, sign(m, [self.key]), payload))
            t.encode_s += t2 - t1
            t.hash_sign_s += time.perf_counter() - t2
            t.patch_bytes += len(payload) if base == version - 1 else 0
        return version, target, step, built

    def _store(self, version: int, target: str, new: TensorSet, step: Patch | None,
               built: list[Built], owned: bool) -> None:  # fmt: skip
        t0 = time.perf_counter()
        store = self.node.store
        for m, signed, payload in built:
            if isinstance(payload, Path):
                store.put_pack_file(m, payload)
            else:
                store.put_payload(m, payload)  # hashed moments ago for the manifest
            store.put_manifest(m, signed)
        record = built[0][0]  # the anchor when there is one: a replay base, not a patch
        store.record(version, target, record.digest)
        self._advance(new, step, target, owned)
        base, _ = store.replay_chain()
        if base is None or version - base.version >= self.checkpoint_every:
            assert self.prev is not None
            store.set_checkpoint(version, target, lambda p: save_weights(p, self.prev))
        self.timings.store_s = time.perf_counter() - t0

    def _advance(self, new: TensorSet, step: Patch | None, target: str, owned: bool) -> None:
        """Bring ``prev`` to the new version: apply the step in place (O(patch)), or take the
        caller's tensors when they are handed over (``owned``), or copy them once (v0)."""
        if self.prev is not None and step is not None and not owned:
            apply(self.prev, step, verify_target=False, base_hash=self.prev_hash)
        elif owned:
            self.prev = dict(new)
        else:
            self.prev = {k: v.detach().clone() for k, v in new.items()}
        self.prev_hash = bytes.fromhex(target)

    async def publish(self, state_dict: TensorSet, owned: bool = False) -> list[Manifest]:
        """Publish ``state_dict`` as the next version; returns its manifests. The tensors are
        only read; pass ``owned=True`` when the caller hands them over for good (``--watch``
        loads each file just for this), so no copy is kept."""
        t0 = time.perf_counter()
        new = {k: v.detach() for k, v in state_dict.items()}
        version, target, step, built = await asyncio.to_thread(self._build, new)
        await asyncio.to_thread(self._store, version, target, new, step, built, owned)
        self.node.evict()  # inline: the store is not shared across threads (a few unlinks)
        self.node.set_version(version)
        manifests = [m for m, _, _ in built]
        await self.node.announce([m.digest for m in manifests])
        self.node.new_info.set()
        t = self.timings
        t.total_s, t.finished_at = time.perf_counter() - t0, time.time()
        self.node.last_publish = dataclasses.asdict(t)
        log.info("published v%d in %.2fs (diff %.2f, encode %.2f, hash+sign %.2f, store %.2f, "
                 "snapshot %.2f): %s", version, t.total_s, t.diff_s, t.encode_s, t.hash_sign_s,
                 t.store_s, t.snapshot_s,
                 ", ".join(f"{m.kind} {m.payload_size:,} B" for m in manifests))  # fmt: skip
        return manifests

    def close(self) -> None:
        """Checkpoint the head at clean shutdown, so a restart replays nothing."""
        state, store = self.node.store.state, self.node.store
        base, _ = store.replay_chain()
        if state is not None and self.prev is not None and base is not None \
                and base.version < state.version:  # fmt: skip
            store.set_checkpoint(state.version, state.state_hash,
                                 lambda p: save_weights(p, self.prev))  # fmt: skip

    def refresh(self, now: int) -> list[Manifest]:
        """Re-sign the newest manifest of each (version, kind, base) once half its lifetime has
        passed: same chunks, new created/expires. Without it, an anchor older than the manifest
        lifetime would be refused by newcomers as a freeze attack. Peers already past that
        version ignore the re-signed copy (not newer than what they accepted)."""
        newest: dict[tuple, Manifest] = {}
        for m in self.node.store.manifests():
            key = (m.version, m.kind, m.base_version)
            if key not in newest or m.expires > newest[key].expires:
                newest[key] = m
        fresh = []
        for m in newest.values():
            if now < m.expires - (m.expires - m.created) // 2:
                continue
            renewed = dataclasses.replace(
                m, created=now, expires=now + self.node.cfg.manifest_lifetime_s
            )
            self.node.store.put_manifest(renewed, sign(renewed, [self.key]))
            fresh.append(renewed)
        return fresh

    async def refresh_loop(self, stop: asyncio.Event, interval: float = 600.0) -> None:
        while not stop.is_set():
            renewed = await asyncio.to_thread(self.refresh, int(time.time()))
            if renewed:
                log.info("re-signed %d manifest(s) nearing expiry", len(renewed))
                await self.node.announce([m.digest for m in renewed])
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


async def watch(
    publisher: Publisher, directory: Path, stop: asyncio.Event, interval: float = 0.2
) -> None:
    """Publish every ``*.safetensors`` that appears in ``directory``, in order of appearance.

    Files must appear by rename (written elsewhere, then moved in), so a file is never read half
    written. Names already published are remembered in the data dir across restarts.
    """
    seen_path = publisher.node.store.root / "watched.txt"
    seen = set(seen_path.read_text().split("\n")) if seen_path.exists() else set()
    while not stop.is_set():
        fresh = [p for p in directory.glob("*.safetensors") if p.name not in seen]
        for path in sorted(fresh, key=lambda p: (p.stat().st_mtime_ns, p.name)):
            weights = await asyncio.to_thread(load_weights, path)
            await publisher.publish(weights, owned=True)
            seen.add(path.name)
            atomic_write_bytes(seen_path, "\n".join(sorted(seen)).encode())
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
