"""The rollout role: follow the swarm's head, fetch, verify, apply, persist, hand off.

Loop: whenever new manifests arrive (announcement or poll), plan the cheapest valid path from
the local state to the head (``versions.plan``), fetch each artifact's chunks from every peer
that has them (``fetch``), verify, apply, persist atomically, then hand the weights off: the
``on_update`` callback (Python API), ``--export DIR`` (``model.safetensors`` then
``version.json``, each atomic) and the ``--on-update CMD`` hook.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import DownloadColumn, Progress, TransferSpeedColumn
from safetensors.torch import load, load_file, save_file

from node.fetch import fetch_payload
from node.runtime import Node
from p2p_sync import codec
from p2p_sync.atomic import atomic_write_bytes, atomic_write_with
from p2p_sync.errors import NoPathError, P2PSyncError, PatchError
from p2p_sync.manifest import SNAPSHOT, Manifest
from p2p_sync.patch import apply
from p2p_sync.tensors import layout_fingerprint, layout_of, state_hash
from p2p_sync.versions import Artifact, PeerState, plan

log = logging.getLogger("p2psync.rollout")

UpdateCallback = Callable[[int, dict[str, torch.Tensor]], None]


def artifact(m: Manifest) -> Artifact:
    return Artifact(m.version, m.kind, m.base_version, m.base_state, m.target_state,
                    m.payload_size, m.digest)  # fmt: skip


class Follower:
    """Keeps one node's weights at the swarm's head."""

    def __init__(
        self,
        node: Node,
        device: str = "cpu",
        export: Path | None = None,
        on_update_cmd: str | None = None,
        callback: UpdateCallback | None = None,
    ):
        self.node, self.device = node, device
        self.export, self.cmd, self.callback = export, on_update_cmd, callback
        self.weights: dict[str, torch.Tensor] | None = None
        state = node.store.state
        if state is not None:
            self.weights = load_file(str(state.weights), device=device)
            if state_hash(self.weights).hex() != state.state_hash:
                raise P2PSyncError(f"{state.weights}: stored weights do not match their state hash")
        self.refused: set[str] = set()  # manifests whose verified payload failed to apply

    @property
    def state(self) -> PeerState:
        s = self.node.store.state
        return PeerState(s.version, s.state_hash) if s else PeerState()

    def _plan(self) -> list[Manifest]:
        by_digest = {m.digest: m for m in self.node.store.manifests()}
        floor = self.state.version
        arts = [
            artifact(m)
            for m in by_digest.values()
            if (floor is None or m.version > floor) and m.digest not in self.refused
        ]
        try:
            return [by_digest[a.ident] for a in plan(self.state, arts)]
        except NoPathError:
            return []

    def _apply(self, m: Manifest, payload: memoryview) -> dict[str, torch.Tensor]:
        if m.kind == SNAPSHOT:
            weights = {k: v.to(self.device) for k, v in load(bytes(payload)).items()}
            if layout_fingerprint(layout_of(weights)).hex() != m.layout:
                raise PatchError("snapshot layout differs from its manifest")
            if state_hash(weights).hex() != m.target_state:
                raise PatchError(f"v{m.version} does not hash to its signed target state")
        else:
            patch = codec.decode(payload, workers=os.cpu_count() or 1)
            if patch.base_hash.hex() != m.base_state or patch.target_hash.hex() != m.target_state:
                raise PatchError("patch hashes differ from its signed manifest")
            assert self.weights is not None
            weights = self.weights
            apply(weights, patch)  # checks base and target hashes (the target's is signed)
        return weights

    def _persist(self, m: Manifest, weights: dict[str, torch.Tensor]) -> None:
        host = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        if self.export is not None:  # first, so a reported version always has its export
            self.export.mkdir(parents=True, exist_ok=True)
            atomic_write_with(self.export / "model.safetensors", lambda p: save_file(host, str(p)))
            doc = {"version": m.version, "state_hash": m.target_state}
            atomic_write_bytes(self.export / "version.json", json.dumps(doc).encode())
        self.node.store.set_weights(m.version, m.target_state, lambda p: save_file(host, str(p)))

    async def _hook(self, m: Manifest) -> None:
        if not self.cmd:
            return
        env = {
            **os.environ,
            "P2PSYNC_VERSION": str(m.version),
            "P2PSYNC_STATE_HASH": m.target_state,
        }
        if self.export is not None:
            env["P2PSYNC_EXPORT"] = str(self.export)
        proc = await asyncio.create_subprocess_shell(self.cmd, env=env)
        try:
            rc = await asyncio.wait_for(proc.wait(), 300)
        except TimeoutError:
            proc.kill()
            rc = -9
        if rc:
            log.warning("--on-update command exited with %s for v%d", rc, m.version)

    async def _fetch(self, m: Manifest) -> memoryview:
        """Fetch with a live rich progress bar when asked (or when stderr is a terminal)."""
        if not (self.node.cfg.progress or sys.stderr.isatty()):
            return await fetch_payload(self.node, m)
        columns = (*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(f"v{m.version} {m.kind}", total=m.payload_size)
            return await fetch_payload(self.node, m, on_chunk=lambda n: bar.advance(task, n))

    async def step(self, m: Manifest) -> None:
        t0 = time.monotonic()
        payload = await self._fetch(m)
        weights = await asyncio.to_thread(self._apply, m, payload)
        await asyncio.to_thread(self._persist, m, weights)
        self.weights = weights
        self.node.evict()  # inline: the store is not shared across threads (a few unlinks)
        self.node.set_version(m.version)
        log.info("v%d applied (%s, %s bytes) in %.2fs", m.version, m.kind,
                 f"{m.payload_size:,}", time.monotonic() - t0)  # fmt: skip
        if self.callback is not None:
            self.callback(m.version, weights)
        await self._hook(m)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.node.new_info.clear()
            for m in self._plan():
                if stop.is_set():
                    return
                try:
                    await self.step(m)
                except PatchError as exc:  # verified chunks, bad content: a trainer-side bug
                    log.error("v%d refused: %s; planning around it", m.version, exc)
                    self.refused.add(m.digest)
                    break
            try:
                await asyncio.wait_for(self.node.new_info.wait(), 1.0)
            except TimeoutError:
                pass
