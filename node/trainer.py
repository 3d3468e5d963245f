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
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

from node.runtime import Node
from p2p_sync import codec
from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.chunks import manifest_for
from p2p_sync.keys import SigningKey
from p2p_sync.manifest import PATCH, SNAPSHOT, Manifest, sign
from p2p_sync.patch import Patch, diff, merge
from p2p_sync.seeding import SuperSeeder
from p2p_sync.tensors import TensorSet, layout_fingerprint, layout_of, state_hash
from p2p_sync.versions import PublishPolicy, to_publish

log = logging.getLogger("p2psync.trainer")

# Frames are independent, and zstd and numpy release the GIL: encode on every core.
WORKERS = os.cpu_count() or 1


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


class Publisher:
    """Turns successive state dicts into published versions."""

    def __init__(self, node: Node, key: SigningKey, policy: PublishPolicy) -> None:
        self.node, self.key, self.policy = node, key, policy
        self.prev: dict[str, torch.Tensor] | None = None
        self.history: collections.deque[Patch] = collections.deque(
            maxlen=max(policy.catchup_spans, default=1)
        )
        state = node.store.state
        if state is not None:
            self.prev = load_file(str(state.weights))

    @property
    def next_version(self) -> int:
        state = self.node.store.state
        return state.version + 1 if state else 0

    def _payloads(
        self, version: int, new: TensorSet, step: Patch | None
    ) -> list[tuple[str, int | None, bytes, Patch | None]]:
        out: list[tuple[str, int | None, bytes, Patch | None]] = []
        for kind, base in to_publish(version, self.policy):
            if kind == SNAPSHOT:
                out.append((SNAPSHOT, None, save(dict(new)), None))
            elif base == version - 1 and step is not None:
                out.append((PATCH, base, codec.encode(step, workers=WORKERS), step))
            elif base is not None and version - base <= len(self.history):
                merged = merge(list(self.history)[-(version - base) :])
                out.append((PATCH, base, codec.encode(merged, workers=WORKERS), merged))
        return out

    def _build(self, new: TensorSet) -> tuple[int, str, list[tuple[Manifest, bytes, bytes]]]:
        """CPU-heavy part (diff, encode, hash, sign), run in a worker thread."""
        version = self.next_version
        step = diff(self.prev, new) if self.prev is not None and version > 0 else None
        if step is not None:
            self.history.append(step)
        target = (step.target_hash if step else state_hash(new)).hex()  # diff hashed it already
        layout = layout_fingerprint(layout_of(new)).hex()
        built = []
        for kind, base, payload, patch in self._payloads(version, new, step):
            extra = {}
            if kind == PATCH:
                assert patch is not None
                extra = {"base_version": base, "base_state": patch.base_hash.hex()}
            m = manifest_for(
                payload, swarm=self.node.policy.swarm_id, version=version, kind=kind,
                target_state=target, layout=layout, now=int(time.time()),
                lifetime_s=self.node.cfg.manifest_lifetime_s, chunk_size=self.node.cfg.chunk_size,
                **extra,
            )  # fmt: skip
            built.append((m, sign(m, [self.key]), payload))
        return version, target, built

    def _store(self, version: int, target: str, new: TensorSet, built: list) -> None:
        store = self.node.store
        for m, signed, payload in built:
            store.put_payload(m, payload)  # hashed moments ago for the manifest
            store.put_manifest(m, signed)
        host = {k: v.detach().cpu().contiguous() for k, v in new.items()}
        store.set_weights(version, target, lambda p: save_file(host, str(p)))
        self.prev = {k: v.clone() for k, v in host.items()}

    async def publish(self, state_dict: TensorSet) -> list[Manifest]:
        """Publish ``state_dict`` as the next version; returns its manifests."""
        new = {k: v.detach() for k, v in state_dict.items()}
        version, target, built = await asyncio.to_thread(self._build, new)
        await asyncio.to_thread(self._store, version, target, new, built)
        self.node.evict()  # inline: the store is not shared across threads (a few unlinks)
        self.node.set_version(version)
        manifests = [m for m, _, _ in built]
        log.info("published v%d: %s", version,
                 ", ".join(f"{m.kind} {m.payload_size:,} B" for m in manifests))  # fmt: skip
        await self.node.announce([m.digest for m in manifests])
        self.node.new_info.set()
        return manifests

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
            weights = await asyncio.to_thread(load_file, str(path))
            await publisher.publish(weights)
            seen.add(path.name)
            atomic_write_bytes(seen_path, "\n".join(sorted(seen)).encode())
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
