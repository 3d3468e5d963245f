"""A test base with N real nodes in one process over the in-memory network (py-ipv8 style).

Every node is the real thing (store, trust gate, peer directory, learner, download driver,
data-plane router, gossip validator, follower); only the wire is ``p2p_sync.transport.memory``.
So a control-plane scenario (who learns what, who gets banned, what a flood does) runs in a
fraction of a second, deterministically ordered on one event loop, and the few tests that need
sockets, processes and libp2p stay on top (``test_p2p_swarm``, ``test_python_api``...).

Waiting is on the nodes' own events (``Follower.advanced``), each wait bounded by a timeout.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.runtime.transports import MemoryTransport
from p2p_sync.store import Store
from p2p_sync.transport.memory import MemoryNetwork
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import Manifest, SwarmPolicy

CHUNK = 16 * 1024  # the smallest: a tiny model spans many chunks, so peers have things to trade


class MemorySwarm:
    """A trainer and rollouts on one :class:`MemoryNetwork`; ``async with`` stops them all."""

    def __init__(self, tmp: Path, gossip: bool = False, latency_s: float = 0.0) -> None:
        self.tmp, self.gossip = tmp, gossip
        self.network = MemoryNetwork(latency_s)
        self.key = SigningKey.generate()
        self.policy = SwarmPolicy("memory", (self.key.public,))
        self.trainer: TrainerNode | None = None
        self.publisher: Publisher | None = None
        self.rollouts: list[Node] = []
        self.followers: dict[str, Follower] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._nodes: list[Node] = []

    def config(self, name: str, role: str, **overrides: Any) -> NodeConfig:
        """A node's config: quick polls, small chunks, libp2p only as the memory gossip."""
        base = NodeConfig(
            role=role,
            data_dir=self.tmp / name,
            trust=(self.policy.keys[0].text(),),
            directory=PeerLimits(poll_interval_s=0.2),
            download=SwarmConfig(have_poll_s=0.05, stall_timeout_s=2.0),
            publish=PublishPolicy(chunk_size=CHUNK, anchor_every=4),
            p2p=self.gossip,
        )
        return replace(base, **overrides)

    async def node(
        self, name: str, role: str = "rollout", policy: SwarmPolicy | None = None, **cfg: Any
    ) -> Node:
        """Start a bare node (no follower): an attacker's, or one a test drives by hand."""
        config = self.config(name, role, **cfg)
        cls = TrainerNode if role == "trainer" else Node
        store = Store.open(config.data_dir, config.store)
        node = cls(config, policy or self.policy, store, MemoryTransport(self.network, name))
        await node.start()
        self._nodes.append(node)
        return node

    async def start_trainer(self, **cfg: Any) -> TrainerNode:
        trainer = await self.node("trainer", "trainer", **cfg)
        assert isinstance(trainer, TrainerNode)
        trainer.signer = self.key
        self.trainer, self.publisher = trainer, Publisher(trainer, self.key)
        return trainer

    async def start_rollout(self, name: str, **cfg: Any) -> Node:
        """A rollout that knows the trainer (unless ``peers`` says otherwise), following."""
        assert self.trainer is not None and self.trainer.url is not None
        cfg.setdefault("peers", (self.trainer.url,))
        node = await self.node(name, **cfg)
        follower = Follower(node)
        self.rollouts.append(node)
        self.followers[node.url or name] = follower
        self._tasks.append(asyncio.create_task(follower.run(self._stop)))
        return node

    async def at_v0(
        self, tensors: dict[str, torch.Tensor], *names: str, **cfg: Any
    ) -> tuple[TrainerNode, list[Node]]:
        """A trainer and rollouts ``names`` (each with ``cfg``) that all hold ``tensors`` as v0:
        every rollout has asked the trainer for have-maps by then (a follower of it)."""
        trainer = await self.start_trainer()
        rollouts = [await self.start_rollout(name, **cfg) for name in names]
        await self.publish(tensors)
        await self.converge(0)
        return trainer, rollouts

    async def publish(self, tensors: dict[str, torch.Tensor]) -> list[Manifest]:
        assert self.publisher is not None
        return await self.publisher.publish(tensors)

    async def converge(self, version: int, timeout: float = 30.0, nodes: Any = None) -> None:
        """Wait until every following rollout (or ``nodes``) holds ``version``."""
        followers = [self.followers[n.url] for n in nodes] if nodes else self.followers.values()
        async with asyncio.timeout(timeout):
            for f in followers:
                while f.state.version is None or f.state.version < version:
                    await f.advanced.wait()

    def weights(self, node: Node) -> dict[str, torch.Tensor] | None:
        return self.followers[node.url or ""].weights

    async def __aenter__(self) -> MemorySwarm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.publisher is not None:
            await self.publisher.aclose()
        for node in reversed(self._nodes):
            await node.stop()
