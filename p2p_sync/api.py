"""The embedding API: ``p2p_sync.Trainer`` and ``p2p_sync.Rollout``, for synchronous and
asyncio programs alike.

Most training loops (TRL, verl, plain PyTorch) and inference servers are not asyncio programs,
so each class has two faces over one node:

* synchronous: ``with Trainer(...) as t: t.publish(model.state_dict())``. The node's event loop
  runs in a background thread; each call submits to it and waits for the result.
* asyncio: ``async with Trainer(...) as t: await t.apublish(sd)``, on the caller's own loop.

Settings are the node's (``p2p_sync.runtime.config.NodeConfig``): a TOML file, keyword arguments,
or both
(keywords win), checked the same way as the command line's, with the same error messages.

Both report as the CLI does: one line per version (and the node's warnings) on stderr, through
the ``p2psync`` logger, unless the program has configured logging itself (then its handlers
get them) or passes ``report=False``. The root logger is left alone. ``status()`` is the node's
``/status`` document: version, peers, bans, bytes.

A rollout in the engine's process keeps the engine's live tensors at the swarm's head: pass
``model=`` (a ``torch.nn.Module`` or a state dict). The node fetches and verifies new versions
in the background and holds them; the engine applies them in place when it chooses
(``apply_updates()``, e.g. between generation batches), and gets the pause it cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from p2p_sync.errors import PublishError
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.configfile import load
from p2p_sync.runtime.identity import pick_device, policy_for
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower, Update
from p2p_sync.runtime.sharded import ShardedPublishing, StepPublisher, is_sharded, rank
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.store import Store
from p2p_sync.trust.manifest import PATCH, Manifest
from p2p_sync.weights.layout import EngineLayout
from p2p_sync.weights.served import ServedWeights

if TYPE_CHECKING:
    from p2p_sync.runtime.tp_engine import TensorParallel

T = TypeVar("T")
log = logging.getLogger("p2psync.node")


class _ReportHandler(logging.StreamHandler):
    """The node's lines on stderr, as the CLI prints them, while the program has configured
    no logging of its own (once it has, its root handlers get the same records)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(asctime)s p2psync %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.stream = sys.stderr  # as it is now (a test or a notebook may swap it)
            super().emit(record)


def _report(enabled: bool) -> None:
    """Let the ``p2psync`` logger's INFO lines (one per version) reach stderr; never the root
    logger's settings."""
    logger = logging.getLogger("p2psync")
    if not enabled or any(isinstance(h, _ReportHandler) for h in logger.handlers):
        return
    logger.addHandler(_ReportHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _config(
    role: str, config: str | os.PathLike[str] | None, settings: dict[str, Any]
) -> NodeConfig:
    if "p2p" not in settings:
        settings["p2p"] = bool(settings.get("bootstrap"))  # libp2p only when asked to join by it
    path = Path(config) if config is not None else None
    return load(path, {**settings, "role": role})


def _tensors(
    model: torch.nn.Module | Mapping[str, torch.Tensor], layout: EngineLayout | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a model's weights live in (state dict entries share the parameters'
    storage, so writing into them updates the live model), as checkpoint tensors: views of
    them where ``layout`` says the engine fuses or pads."""
    tensors = dict(model.state_dict()) if isinstance(model, torch.nn.Module) else dict(model)
    return layout.views(tensors) if layout is not None else tensors


def _tensor_parallel(model: Any, layout: EngineLayout | None, group: Any) -> TensorParallel | None:
    """The tensor-parallel side of a rollout whose engine holds shards (DTensors, or a layout
    for one rank of a sharded engine); None for any other. Imported only then: it loads
    ``torch.distributed.tensor``."""
    if model is None:
        return None
    tensors = _tensors(model)
    if not (is_sharded(tensors) or (layout is not None and layout.sharded)):
        return None
    from p2p_sync.runtime.tp_engine import TensorParallel

    return TensorParallel(tensors, group, layout)


class _LoopThread:
    """An asyncio loop in a daemon thread: where the node lives for synchronous callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="p2psync-node", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


class _Embedded:
    """What both sides share: a node started on demand, on the caller's loop or a thread's."""

    role = ""

    def __init__(
        self, config: str | os.PathLike[str] | None, settings: dict[str, Any], report: bool = True
    ) -> None:
        self.cfg = _config(self.role, config, dict(settings))
        self.report = report
        self.node: Node | None = None
        self._thread: _LoopThread | None = None

    @property
    def url(self) -> str | None:
        """This node's HTTP data-plane URL (peers pass it as ``peers=``)."""
        return self.node.url if self.node else None

    @property
    def multiaddr(self) -> str | None:
        return self.node.multiaddr if self.node else None

    @property
    def version(self) -> int | None:
        """The accepted version: published (trainer), or held by the weights (rollout; the
        engine's, when attached)."""
        state = self.node.store.state if self.node else None
        return state.version if state else None

    def status(self) -> dict[str, Any]:
        """Where the node stands: its ``/status`` document (version, peers, bans, bytes), or
        ``{"role": ..., "running": False}`` before it is open."""
        if self.node is None:
            return {"role": self.role, "running": False}
        if self._thread is not None:
            return self._thread.run(self._astatus())
        return self.node.status()

    async def _astatus(self) -> dict[str, Any]:
        assert self.node is not None
        return self.node.status()

    async def _open_node(self, node_cls: type[Node]) -> Node:
        _report(self.report)
        policy, key = policy_for(self.cfg)
        # locked while the node runs: a second node on this data dir is refused
        store = await asyncio.to_thread(Store.open, self.cfg.data_dir, self.cfg.store, True)
        try:
            node = node_cls(self.cfg, policy, store)
            node.signer = key
            await node.start()
        except BaseException:
            store.close()
            raise
        self.node, self._key = node, key
        state, peers = store.state, ", ".join(self.cfg.peers) or "none given"
        at = f"v{state.version}" if state else "no version yet"
        log.info("%s listening on %s (%s; peers: %s)", self.role, node.url, at, peers)
        return node

    def _sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._thread is None:
            coro.close()
            raise RuntimeError(
                f"{type(self).__name__} is not open: use it in a with block "
                "(or async with, and the a-prefixed methods)"
            )
        return self._thread.run(coro, timeout)

    async def _astart(self) -> None:
        raise NotImplementedError

    async def _astop(self) -> None:
        raise NotImplementedError

    def open(self) -> Any:
        """Start the node in a background thread (the synchronous face)."""
        self._thread = _LoopThread()
        try:
            self._thread.run(self._astart())
        except BaseException:
            with contextlib.suppress(Exception):  # a node started part-way: its data dir's lock
                self._thread.run(self._astop(), timeout=60)
            self._thread.close()
            self._thread = None
            raise
        return self

    def close(self) -> None:
        """Stop the node cleanly (a checkpoint of the head is written) and its thread."""
        if self._thread is not None:
            try:
                self._thread.run(self._astop(), timeout=600)
            finally:
                self._thread.close()
                self._thread = None

    def __enter__(self) -> Any:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Any:
        try:
            await self._astart()
        except BaseException:
            with contextlib.suppress(Exception):  # a node started part-way: its data dir's lock
                await self._astop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._astop()


class Trainer(_Embedded):
    """Publishes versions to the swarm: ``publish(state_dict)`` after each optimizer step.

    >>> with Trainer(key="trainer.key", data_dir="p2psync-trainer", listen="0.0.0.0:7000") as t:
    ...     for batch in data:
    ...         train_step(model, batch)
    ...         t.publish(model.state_dict())

    ``publish`` returns once the version is stored, signed and announced; the tensors are only
    read (the trainer keeps one copy of the last version, updated in place per patch).
    ``serve_dtype=torch.bfloat16`` publishes fp32 master weights as the engines serve them,
    each tensor cast on its own device as it is read (no second copy of the model).
    """

    role = "trainer"

    def __init__(
        self,
        config: str | os.PathLike[str] | None = None,
        *,
        serve_dtype: torch.dtype | None = None,
        report: bool = True,
        **settings: Any,
    ) -> None:
        super().__init__(config, settings, report)
        self.publisher: Publisher | None = None
        self.serve_dtype = serve_dtype
        self._warned = False
        self._sharded: ShardedPublishing | None = None

    async def _astart(self) -> None:
        if rank() != 0:  # a rank of a sharded trainer: it diffs its blocks, rank 0 publishes
            self._sharded = ShardedPublishing(None)
            return
        node = await self._open_node(TrainerNode)
        self.publisher = await asyncio.to_thread(StepPublisher, node, self._key)
        self._sharded = ShardedPublishing(self.publisher)

    async def _astop(self) -> None:
        if self.publisher is not None:
            await self.publisher.aclose()
        if self.node is not None:
            await self.node.stop()

    async def apublish(self, state_dict: Mapping[str, torch.Tensor]) -> list[Manifest]:
        if is_sharded(state_dict):
            raise PublishError("a sharded state dict is published by publish() on every rank")
        assert self.publisher is not None, "Trainer is not open"
        if self.serve_dtype is not None:
            return await self.publisher.publish(self._served(state_dict))
        manifests = await self.publisher.publish(dict(state_dict))
        self._warn_fp32(state_dict, manifests)
        return manifests

    def _served(self, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``state_dict`` as the engines serve it (``serve_dtype``), cast as it is read."""
        if self.serve_dtype is None:
            return state_dict
        return ServedWeights(state_dict, self.serve_dtype)

    def _warn_fp32(self, state_dict: Mapping[str, torch.Tensor], published: list[Manifest]) -> None:
        """Once, at the first patch of float32 weights published as they are: what it cost."""
        patch = [m for m in published if m.kind == PATCH]
        if self._warned or not patch:
            return
        if any(t.dtype == torch.float32 for t in state_dict.values()):
            self._warned = True
            log.warning(
                "v%d: float32 weights published as they are (a %s-byte patch); if the engines "
                "serve bfloat16, Trainer(serve_dtype=torch.bfloat16) publishes what they serve",
                patch[0].version,
                f"{patch[0].payload_size:,}",
            )

    def publish(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Publish the next version from synchronous code; returns its version number. A
        sharded state dict (DTensors: FSDP2, tensor parallel) is published by every rank
        together, each diffing its own blocks (``runtime.sharded``)."""
        if is_sharded(state_dict):
            assert self._sharded is not None, "Trainer is not open"
            return self._sharded.publish(self._served(state_dict), self._sync)
        if rank() != 0:
            raise PublishError("plain tensors are published by rank 0 alone (DTensors: by all)")
        manifests = self._sync(self.apublish(state_dict))
        return manifests[0].version

    @property
    def last_publish(self) -> dict[str, Any] | None:
        """Timings of the last publish (diff, encode, hash and sign, store; seconds)."""
        return self.node.last_publish if self.node else None


@dataclass
class HandOff:
    """What ``apply_updates`` did: the version the model now holds and the pause it cost."""

    version: int | None
    pause_s: float
    updates: list[Update] = field(default_factory=list)


class Rollout(_Embedded):
    """Follows the swarm's head; optionally keeps an engine's live model there.

    >>> with Rollout(trust=["trainer.pub"], peers=["http://trainer:7000"], model=model) as r:
    ...     while True:
    ...         outputs = model.generate(...)          # the engine's own work
    ...         if r.wait_for_update(timeout=0):       # a verified new version is ready
    ...             print(r.apply_updates().pause_s)   # applied in place, here and now

    With ``model``, new versions are fetched and verified in the background but applied only
    in ``apply_updates`` (``hold=False`` applies them as they arrive instead). Without it the
    node keeps its own copy, applied as versions arrive (``weights``, ``on_update``). An engine
    that fuses or pads its tensors passes its ``layout`` (``p2p_sync.weights.layout``), e.g.
    ``fused_qkv_gate_up(checkpoint_config)``: patches are applied straight into its tensors.

    A tensor-parallel engine (a model whose parameters are DTensors, e.g. Hugging Face's
    ``tp_plan="auto"``) opens a Rollout on every rank; rank 0 runs the node, and opening,
    ``wait_for_update``, ``apply_updates`` and ``wait_for_version`` are collective calls that
    every rank makes together (``runtime.tp_engine``; ``group``: the engine's process group).
    """

    role = "rollout"

    def __init__(
        self,
        config: str | os.PathLike[str] | None = None,
        *,
        model: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        layout: EngineLayout | None = None,
        hold: bool | None = None,
        on_update: Any = None,
        report: bool = True,
        group: Any = None,
        **settings: Any,
    ) -> None:
        super().__init__(config, settings, report)
        self._model = _tensors(model, layout) if model is not None else None
        self.hold = hold if hold is not None else model is not None
        self.tp = _tensor_parallel(model, layout, group)
        self.callback = on_update
        self.follower: Follower | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self) -> Rollout:
        """Start the node (on a tensor-parallel engine: rank 0's, then every rank attaches)."""
        if self.tp is None:
            return super().open()
        if self.tp.leader:
            super().open()
        try:
            self.tp.attach(self._head)
        except BaseException:
            self.close()
            raise
        return self

    async def _astart(self) -> None:
        if self.tp is not None and self._thread is None:  # before any rank opens a node
            raise RuntimeError("a tensor-parallel engine uses the synchronous face on every rank")
        node = await self._open_node(Node)
        tp = self.tp is not None  # the node keeps the head on the host; the ranks take frames
        self.follower = await asyncio.to_thread(
            Follower,
            node,
            "cpu" if tp else self._device(),
            self.cfg.export,
            self.cfg.on_update,
            self.callback,
            hold=self.hold and not tp,
            into=None if tp else self._model,
            engine=self.tp.queue if self.tp is not None else None,
        )
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.follower.run(self._stop))

    def _device(self) -> str:
        if self._model:
            return str(next(iter(self._model.values())).device)
        return pick_device(self.cfg.device)

    async def _astop(self) -> None:
        if self._stop is not None and self._task is not None:
            self._stop.set()
            await self._task
        if self.node is not None:
            await self.node.stop()

    @property
    def weights(self) -> dict[str, torch.Tensor] | None:
        return self.follower.weights if self.follower else None

    @property
    def pending(self) -> list[int]:
        """Versions fetched and verified, waiting for ``apply_updates``."""
        return [m.version for m, _ in self.follower.pending] if self.follower else []

    async def await_update(self, timeout: float | None = None) -> bool:
        """True once a fetched version waits to be applied (hold mode), or, without hold,
        once the weights are newer than when called; False on timeout."""
        assert self.follower is not None, "Rollout is not open"
        news = self.follower.ready if self.hold else self.follower.advanced
        if self.hold and self.follower.pending:
            return True
        try:
            await asyncio.wait_for(news.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def aapply_updates(self) -> HandOff:
        assert self.follower is not None, "Rollout is not open"
        t0 = time.perf_counter()
        updates = await self.follower.apply_pending()
        return HandOff(self.version, time.perf_counter() - t0, updates)

    def wait_for_update(self, timeout: float | None = None) -> bool:
        """Block until a new version is ready (see ``await_update``); False on timeout."""
        if self.tp is not None:
            return self.tp.sync.ready(timeout)
        return self._sync(self.await_update(timeout))

    def apply_updates(self) -> HandOff:
        """Apply every version fetched so far to the model, in place, now; returns the version
        reached and the pause (decode, apply, target-hash check, log record)."""
        if self.tp is not None:
            t0 = time.perf_counter()
            updates = self.tp.sync.apply()
            return HandOff(self.tp.sync.state.version, time.perf_counter() - t0, updates)
        return self._sync(self.aapply_updates())

    def _head(self, fn: Any) -> Any:
        """``fn(weights, state)`` on the node's verified head, between two applied versions."""
        return self._sync(self._ahead(fn))

    async def _ahead(self, fn: Any) -> Any:
        assert self.follower is not None
        async with self.follower.lock:
            return await asyncio.to_thread(fn, self.follower.weights, self.follower.state)

    @property
    def version(self) -> int | None:
        """The version the weights hold (a tensor-parallel engine's: verified on every rank)."""
        return self.tp.sync.state.version if self.tp is not None else super().version

    def wait_for_version(self, version: int, timeout: float = 60.0) -> None:
        """Block until the weights hold ``version`` or newer (applying held versions as they
        come, in hold mode); raises TimeoutError."""
        if self.tp is not None:
            return self.tp.until(version, timeout)
        deadline = time.monotonic() + timeout
        while (self.version is None or self.version < version) and time.monotonic() < deadline:
            if self.wait_for_update(max(deadline - time.monotonic(), 0)) and self.hold:
                self.apply_updates()
        if self.version is None or self.version < version:
            raise TimeoutError(f"still at v{self.version} after {timeout:.0f} s, wanted v{version}")
