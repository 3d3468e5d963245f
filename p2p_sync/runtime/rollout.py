"""The rollout role: follow the swarm's head, fetch, verify, apply in place, log, hand off.

Loop: whenever new manifests arrive (announcement or poll), plan the cheapest valid path from
the local state to the head (``versions.plan``), fetch each artifact's chunks from every peer
that has them (``fetch``), then apply it **in place** to the weights this node holds (its own,
or an engine's live tensors: ``attach``), on their device. Per version the durable cost is the
patch's pack plus one fsynced log line (``Store.record``); full weights are written only every
``checkpoint_every`` versions and at clean shutdown. A restart rebuilds the head from the
checkpoint and the logged patches (``p2p_sync.store.restore``).

A full disk (``StoreFullError``, logged once by the store) pauses the loop, never ends it: the
download stops where it is (its chunks stay), a version applied but not logged is rolled back
to the logged state, a due checkpoint waits, and the loop tries again until the
disk has room (``[store] full_retry_s``, or sooner when a manifest could be stored), then goes
on from the logged state.

Hand-off, best first: an engine in this process applies pending versions itself, between
generation batches (``hold=True``: fetched versions wait in ``pending`` until
``apply_pending``); else the ``on_update`` callback; ``--export DIR`` (``model.safetensors``
then ``version.json``, each a link swapped atomically: one full write per version, because a
reloading engine needs the file; ``p2p_sync.weights.export``) and the ``--on-update CMD`` hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2p_sync import jsonbounds
from p2p_sync.errors import (
    DownloadStalledError,
    LayoutMismatchError,
    NoPathError,
    PatchError,
    StoreFullError,
)
from p2p_sync.memory import trim_heap
from p2p_sync.protocol.stalls import carry_unserved
from p2p_sync.protocol.versions import Artifact, PeerState, plan
from p2p_sync.runtime.fetch import fetch_payload
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.ports import EngineFeed
from p2p_sync.store.restore import TornApplyError, apply_artifact, load_snapshot, restore
from p2p_sync.trust.manifest import SNAPSHOT, Manifest
from p2p_sync.weights.export import write_export
from p2p_sync.weights.statehash import StateDigest, state_hash
from p2p_sync.weights.weights_io import write_to

log = logging.getLogger("p2psync.rollout")

UpdateCallback = Callable[[int, dict[str, torch.Tensor]], None]


def artifact(m: Manifest) -> Artifact:
    return Artifact(
        m.version, m.kind, m.base_version, m.base_state, m.target_state, m.payload_size, m.digest
    )


@dataclass
class Update:
    """One version handed off: what it cost and when (seconds; ``at`` is wall-clock time)."""

    version: int
    kind: str
    payload_bytes: int
    fetch_s: float = 0.0
    apply_s: float = 0.0  # decode + in-place apply + target hash check: the engine's pause
    persist_s: float = 0.0  # the log record (a due checkpoint follows the export, behind it)
    export_s: float = 0.0
    applied_at: float = 0.0  # wall clock: applied in place and verified (target state hash)
    at: float = 0.0  # wall clock: handed off (exported, when --export is set)
    timeline: dict[str, float] = field(default_factory=dict)  # node.timeline: its steps


def hook_env(version: int, state_hash: str, export: Path | None) -> dict[str, str]:
    """The ``--on-update`` hook's environment. ``P2PSYNC_EXPORT`` is absolute: the hook may
    hand it to an engine with another working directory (SGLang's ``model_path``)."""
    env = {**os.environ, "P2PSYNC_VERSION": str(version), "P2PSYNC_STATE_HASH": state_hash}
    if export is not None:
        env["P2PSYNC_EXPORT"] = str(export.resolve())
    return env


def _progress_bar() -> Any:
    """A transient download bar on stderr (rich is loaded only when one is shown: an engine
    importing the library does not pay for a terminal toolkit)."""
    from rich.console import Console
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    columns = (*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


class Follower:
    """Keeps one node's weights at the swarm's head."""

    def __init__(
        self,
        node: Node,
        device: str = "cpu",
        export: Path | None = None,
        on_update_cmd: str | None = None,
        callback: UpdateCallback | None = None,
        checkpoint_every: int | None = None,
        hold: bool = False,
        into: Mapping[str, torch.Tensor] | None = None,
        engine: EngineFeed | None = None,
    ):
        self.node, self.device, self.workers = node, device, node.cfg.threads  # workers: threads
        self.engine = engine  # a tensor-parallel engine's ranks, fed what the weights take
        self.export, self.cmd, self.callback = export, on_update_cmd, callback
        self.hold, self.checkpoint_every = hold, checkpoint_every or node.cfg.store.checkpoint_every
        self.weights: dict[str, torch.Tensor] | None = None
        self.digest: StateDigest | None = None  # the weights' sums, kept current in O(patch)
        self.into = dict(into) if into is not None else None  # an engine's tensors, if attached
        self._rebuild(self.into)  # the head, from the checkpoint and the logged patches
        self._start_planning()
        self.pending: list[tuple[Manifest, float]] = []  # fetched, not yet applied (hold mode)
        self.ready = asyncio.Event()  # set while ``pending`` is not empty
        self.advanced = asyncio.Event()  # replaced (after being set) at every applied version
        self.updates: list[Update] = []  # the last few hand-offs, newest last
        self.lock = asyncio.Lock()  # one apply at a time (engine call vs. the loop)
        self._checkpointing: asyncio.Task[None] | None = None
        self.full = False  # paused by a full disk: the next applied version says it resumed
        node.reports_hand_off = True  # a stale export is rewritten (run) before it is reported
        node.handed_off = None if self._export_stale() else node.store.state

    def _start_planning(self) -> None:
        """What the planner steers around, empty at first."""
        self.refused: set[str] = set()  # manifests whose verified payload failed to apply
        self.stalled: set[str] = set()  # manifests whose download stalled: planned around once
        # by manifest, the peers that claimed a chunk of it and did not serve it when its
        # download stalled: a later download of it does not count them as its sources
        self.unserved: dict[str, dict[int, set[str]]] = {}

    # ------------------------------------------------------------ state

    @property
    def state(self) -> PeerState:
        """The state the weights hold (what was applied and logged)."""
        s = self.node.store.state
        return PeerState(s.version, s.state_hash) if s else PeerState()

    @property
    def planned(self) -> PeerState:
        """The state after the fetched-but-pending versions: where fetching continues from."""
        if self.pending:
            m = self.pending[-1][0]
            return PeerState(m.version, m.target_state)
        return self.state

    def _plan(self) -> list[Manifest]:
        """The cheapest path to the head, around artifacts whose download stalled when
        another path exists (else through them again: their sources may be back)."""
        by_digest = {m.digest: m for m in self.node.store.manifests()}
        start = self.planned
        newer = self.node.trusted.newer(by_digest.values(), start.version)
        usable = [artifact(m) for m in newer if m.digest not in self.refused]
        live = {a.ident for a in usable}
        self.unserved = {d: r for d, r in self.unserved.items() if d in live and r}
        if not usable:
            return []
        head = max(a.version for a in usable)  # fixed: avoiding the only way there is no path
        for avoid in (self.stalled, set()):
            try:
                path = plan(start, [a for a in usable if a.ident not in avoid], head)
            except NoPathError:
                continue
            if not avoid:
                self.stalled.clear()  # through them again: they get a fresh chance
            return [by_digest[a.ident] for a in path]
        return []

    # ------------------------------------------------------------ applying

    def _apply_one(self, m: Manifest) -> dict[str, torch.Tensor]:
        """Apply a fetched, verified artifact to the weights (in place), in a worker thread.
        The heap is trimmed first: what the download (and the last apply) freed would
        otherwise stay in the RSS under this apply's temporaries (``p2p_sync.memory``)."""
        trim_heap()
        if m.kind == SNAPSHOT:  # into the tensors already held: never two copies of the model
            target = self.into if self.into is not None else self.weights
            try:
                weights, self.digest = load_snapshot(self.node.store, m, self.device, target)
                if self.engine is not None:
                    self.engine.lost()
                return weights
            except PatchError:
                if target is not None:  # they may be half-overwritten
                    self._rebuild(target)
                raise
        if self.weights is None or self.digest is None:
            raise PatchError(f"v{m.version}: a patch needs weights to apply to")
        sink = self.engine.collector() if self.engine is not None else None
        try:
            apply_artifact(self.node.store, m, self.weights, self.digest, self.workers, sink)
        except TornApplyError:
            self._rebuild(self.weights)
            raise
        if self.engine is not None:
            self.engine.took(m, sink)
        return self.weights

    def _rebuild(self, target: Mapping[str, torch.Tensor] | None) -> None:
        """Rebuild the accepted state from the store (at start, or to bring half-written
        tensors back), in place into ``target`` when given."""
        restored = restore(self.node.store, self.device, target, self.workers)
        if self.engine is not None and restored is not None:
            self.engine.lost()
        self.weights = restored.weights if restored is not None else None
        self.digest = restored.digest if restored is not None else None
        if restored is not None:
            state, replayed = restored.state, restored.replayed
            log.info("restored v%d (%d logged patches replayed)", state.version, replayed)

    async def _checkpoint_done(self) -> None:
        if self._checkpointing is not None:
            task, self._checkpointing = self._checkpointing, None
            with contextlib.suppress(StoreFullError):  # logged by the store; due again later
                await task

    async def _checkpoint(self, version: int, target: str) -> None:
        weights = self.weights
        assert weights is not None
        await asyncio.to_thread(
            self.node.store.set_checkpoint, version, target, lambda f: write_to(f, weights)
        )

    def _checkpoint_if_due(self, m: Manifest) -> None:
        """Checkpoint every ``checkpoint_every`` versions past the replay base, in the
        background (the next apply waits for it), once the version is exported: written
        beside the export, its 1.9 GB (1B model) took the export 1.4-3.4 s instead of ~0.8."""
        if self.node.store.checkpoint_due(self.checkpoint_every):
            self._checkpointing = asyncio.create_task(self._checkpoint(m.version, m.target_state))

    async def _export(self, version: int, state: str) -> bool:
        """Write ``--export``: the weights (``p2p_sync.weights.export``: double-buffered, swapped by
        atomic rename), then ``version.json``. Not fsynced: an fsync of a whole model costs
        twice the write on a slow disk, and the export is rebuilt from the store at start
        whenever it does not match the state. False (logged) when the write failed: the
        version is applied and logged, not handed off."""
        if self.export is None:
            return True
        weights, export = self.weights, self.export
        assert weights is not None
        info = json.dumps({"version": version, "state_hash": state}).encode()
        try:
            await asyncio.to_thread(write_export, export, weights, info)
        except OSError as exc:  # a full disk, a read-only export dir: the node carries on
            log.error(
                "v%d applied but --export %s failed (%s): the engine keeps the last version "
                "exported; the next version's export tries again",
                version,
                export,
                exc.strerror or exc,
            )
            return False
        return True

    def _export_stale(self) -> bool:
        """Whether ``--export`` is set and does not hold the logged head (a crash between the
        log record and the export, or an export directory edited by hand)."""
        state = self.node.store.state
        if self.export is None or state is None or self.weights is None:
            return False
        try:
            doc = jsonbounds.loads((self.export / "version.json").read_bytes())
        except (OSError, ValueError):
            doc = None
        return doc != {"version": state.version, "state_hash": state.state_hash}

    async def _export_if_stale(self) -> None:
        state = self.node.store.state
        if state is not None and self._export_stale():
            if not await self._export(state.version, state.state_hash):
                return
        self.node.handed_off = state

    async def _advance(self, m: Manifest, fetch_s: float) -> Update:
        """Apply one fetched artifact, log it, export it and hand it off. The log record
        comes first: its fsync would wait behind the writeback of the export's pages (up to
        1.5-2.1 s against 0.01-0.2 s, 1B model); a crash in between leaves an export behind the
        state, rewritten at start (``_export_if_stale``). ``/status`` reports the version, and
        the hook runs, only once both are done (``Node.handed_off``)."""
        up = Update(m.version, m.kind, m.payload_size, fetch_s=fetch_s)
        await self._checkpoint_done()  # a checkpoint reads the weights: never mutate under it
        t0 = time.perf_counter()
        self.weights = await asyncio.to_thread(self._apply_one, m)
        up.applied_at = time.time()
        t1 = time.perf_counter()
        await self._record(m)
        t2 = time.perf_counter()
        exported = await self._export(m.version, m.target_state)
        self._checkpoint_if_due(m)
        if exported:
            self.node.handed_off = self.node.store.state
        up.apply_s, up.persist_s, up.export_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        self._handed(m, up)
        self._note(up)
        self.node.metrics.version.set(m.version)
        if self.callback is not None:
            self.callback(m.version, self.weights)
        if exported:
            await self._hook(m)
        return up

    async def _record(self, m: Manifest) -> None:
        """The log record of ``m`` (one fsynced line); on a full disk, back to the logged state."""
        try:
            self.node.store.record(m.version, m.target_state, m.digest)
        except StoreFullError:  # not accepted after all
            await asyncio.to_thread(self._rebuild, self.weights)
            raise

    def _handed(self, m: Manifest, up: Update) -> None:
        """``m`` is handed off now: its timeline noted, the store kept in budget."""
        up.at = time.time()
        self.node.timeline.note(m.digest, "applied", up.applied_at)
        self.node.timeline.note(m.digest, "handed_off", up.at)
        up.timeline = self.node.timeline.of(m.digest)
        self.node.evict()  # a few unlinks: inline

    def _note(self, up: Update) -> None:
        if self.full:
            self.full = False
            log.info("the data dir has room again: following the swarm from v%d", up.version)
        news, self.advanced = self.advanced, asyncio.Event()
        news.set()
        self.updates = [*self.updates[-15:], up]
        self.node.last_update = asdict(up)
        log.info(
            "v%d applied (%s, %s bytes): fetch %.2fs, apply %.3fs, persist %.3fs, export %.2fs",
            up.version,
            up.kind,
            f"{up.payload_bytes:,}",
            up.fetch_s,
            up.apply_s,
            up.persist_s,
            up.export_s,
        )

    async def apply_pending(self) -> list[Update]:
        """Apply every fetched version now, in order (hold mode: the engine calls this between
        generation batches). A version that fails to apply is refused and dropped with the
        rest of the pending path; the weights stay at the last good version."""
        try:
            return await self._apply_all()
        finally:
            self.ready.clear()
            self.node.learner.new_info.set()  # re-plan from where the weights are now

    async def _apply_all(self) -> list[Update]:
        async with self.lock:
            done = []
            while self.pending:
                m, fetch_s = self.pending[0]  # stays pending while applied: plans skip it
                held = self.state.version
                try:
                    if held is None or m.version > held:
                        done.append(await self._advance(m, fetch_s))
                    self.pending.pop(0)
                except LayoutMismatchError:  # the engine's model does not fit: its error
                    self.pending.clear()
                    raise
                except StoreFullError:  # logged by the store: the rest wait for room
                    self.full = True
                    break
                except PatchError as exc:
                    log.error("v%d refused: %s; planning around it", m.version, exc)
                    self.refused.add(m.digest)
                    self.pending.clear()
            return done

    async def close(self) -> None:
        """Clean shutdown: finish a running checkpoint, then checkpoint the head unless the
        replay base already is the head (a restart then replays nothing)."""
        await self._checkpoint_done()
        state = self.node.store.state
        if self.weights is None or state is None or not self.node.store.checkpoint_due(1):
            return
        if state_hash(self.weights).hex() == state.state_hash:  # never checkpoint a torn state
            with contextlib.suppress(StoreFullError):  # logged; the log still rebuilds it
                await self._checkpoint(state.version, state.state_hash)

    # ------------------------------------------------------------ the loop

    async def _hook(self, m: Manifest) -> None:
        if not self.cmd:
            return
        env = hook_env(m.version, m.target_state, self.export)
        proc = await asyncio.create_subprocess_shell(self.cmd, env=env)
        try:
            rc = await asyncio.wait_for(proc.wait(), 300)
        except TimeoutError:
            proc.kill()
            rc = -9
        if rc:
            log.warning("--on-update command exited with %s for v%d", rc, m.version)

    async def _fetch(self, m: Manifest) -> None:
        """Fetch with a live rich progress bar when asked (or when stderr is a terminal),
        without the sources that failed an earlier download of ``m``."""
        unserved = self.unserved.get(m.digest)
        if not (self.node.cfg.progress or sys.stderr.isatty()):
            return await fetch_payload(self.node, m, unserved=unserved)
        with _progress_bar() as bar:
            task = bar.add_task(f"v{m.version} {m.kind}", total=m.payload_size)
            await fetch_payload(
                self.node, m, on_chunk=lambda n: bar.advance(task, n), unserved=unserved
            )

    async def step(self, m: Manifest) -> None:
        t0 = time.perf_counter()
        await self._fetch(m)
        fetch_s = time.perf_counter() - t0
        if self.hold:
            self.pending.append((m, fetch_s))
            self.ready.set()
            return
        async with self.lock:
            await self._advance(m, fetch_s)

    async def _take_plan(self, stop: asyncio.Event) -> bool:
        """Step through the planned versions until one fails (then re-plan); False once
        ``stop`` is set."""
        for m in self._plan():
            if stop.is_set():
                return False
            try:
                await self.step(m)
            except PatchError as exc:  # verified chunks, bad content: a trainer bug
                log.error("v%d refused: %s; planning around it", m.version, exc)
                self.refused.add(m.digest)
                break
            except DownloadStalledError as exc:  # nobody reachable serves it now
                log.warning("%s; re-planning", exc)
                self.stalled.add(exc.digest)
                record = self.unserved.setdefault(exc.digest, {})
                carry_unserved(record, exc.indices, exc.disowned)
                self.node.learner.new_info.set()  # another path, at once
                break
            except StoreFullError:  # logged by the store: try again later
                self.full = True
                break
        return True

    async def run(self, stop: asyncio.Event) -> None:
        await self._export_if_stale()
        try:
            while not stop.is_set():
                self.node.learner.new_info.clear()
                if not await self._take_plan(stop):
                    return
                wait = self.node.cfg.store.full_retry_s if self.full else 1.0
                try:
                    await asyncio.wait_for(self.node.learner.new_info.wait(), wait)
                except TimeoutError:
                    pass
        finally:
            await self.close()
