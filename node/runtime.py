"""A running node: store, trust policy, peer directory, HTTP server and client, metrics.

Trainer and rollout share this; each adds its own loop (``trainer.Publisher``,
``rollout.Follower``). Peers are learned from ``--peers``, from who announces to us and from
peers' ``/peers`` lists (peer exchange), so one shared list bootstraps everyone. New versions
spread by push (``POST /announce``, relayed once by every node that accepts the manifest) with a
periodic pull of ``/manifests`` as the fallback for anything missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from node.config import NodeConfig
from p2p_sync.errors import ManifestError, RollbackAttackError
from p2p_sync.manifest import Manifest, SwarmPolicy, verify
from p2p_sync.store import Store
from p2p_sync.transport.http import (
    DataClient,
    DataServer,
    HttpLimits,
    PeerError,
    gather_quietly,
)

log = logging.getLogger("p2psync.node")


class Metrics:
    """Prometheus metrics of one node (its own registry, so several nodes fit in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.uploaded = Counter("p2psync_bytes_uploaded", "Chunk bytes served", registry=r)
        self.downloaded = Counter("p2psync_bytes_downloaded", "Verified chunk bytes fetched",
                                  registry=r)  # fmt: skip
        self.version = Gauge("p2psync_version", "Accepted weights version", registry=r)
        self.peers = Gauge("p2psync_peers", "Known peers", registry=r)
        self.bans = Counter("p2psync_peers_banned", "Peers banned for bad data", registry=r)
        self.version.set(-1)


class Node:
    """Shared machinery of trainer and rollout nodes (implements the data plane's NodeView)."""

    def __init__(self, cfg: NodeConfig, policy: SwarmPolicy, store: Store) -> None:
        self.cfg, self.policy, self.store = cfg, policy, store
        self.metrics = Metrics()
        self.peers: dict[str, int] = {}  # url -> consecutive failures
        self.banned: set[str] = set()
        self.url: str | None = None
        cap = cfg.max_upload_mbps * 1e6 / 8 if cfg.max_upload_mbps else None
        self.server = DataServer(self, HttpLimits(max_upload_bytes_per_s=cap))
        self.client: DataClient | None = None
        self.new_info = asyncio.Event()
        self._learning: set[str] = set()
        self._tasks: list[asyncio.Task[Any]] = []
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        if store.state is not None:
            self.metrics.version.set(store.state.version)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        host, port = self.cfg.host_port
        bound = await self.server.start(host, port)
        self.url = f"http://{self.cfg.advertise_host or host}:{bound}"
        self.client = DataClient(self.url)
        for peer in self.cfg.peers:
            self.add_peer(peer)
        self._tasks.append(asyncio.create_task(self._poll_loop(), name="poll"))
        return self.url

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        await self.server.stop()

    # ------------------------------------------------------------ peers

    def add_peer(self, url: str) -> None:
        if url == self.url or url in self.banned or url in self.peers:
            return
        if len(self.peers) < self.cfg.max_peers:
            self.peers[url] = 0
            self.metrics.peers.set(len(self.peers))

    def ban(self, url: str, reason: str) -> None:
        if url not in self.banned:
            log.warning("banned %s: %s", url, reason)
            self.banned.add(url)
            self.metrics.bans.inc()
        self.peers.pop(url, None)
        self.metrics.peers.set(len(self.peers))

    def usable_peers(self) -> list[str]:
        return [p for p in self.peers if p not in self.banned]

    def _peer_failed(self, url: str) -> None:
        if url in self.peers:
            self.peers[url] += 1
            if self.peers[url] >= 5:  # gone for now; it comes back when it announces again
                del self.peers[url]
                self.metrics.peers.set(len(self.peers))

    # ------------------------------------------------------------ learning manifests

    @property
    def accepted_version(self) -> int | None:
        return self.store.state.version if self.store.state else None

    def on_announce(self, url: str | None, digests: list[str]) -> None:
        if url is not None:
            self.add_peer(url)
        source = url if url is not None and url not in self.banned else None
        if source is not None:
            fresh = [d for d in digests if not self.store.has_manifest(d)]
            if fresh:
                self._tasks.append(asyncio.create_task(self.learn(source, fresh)))

    async def learn(self, peer: str, digests: list[str]) -> list[Manifest]:
        """Fetch, verify and keep manifests ``peer`` offers; relay the accepted ones onward."""
        assert self.client is not None
        accepted = []
        for digest in digests:
            if digest in self._learning or self.store.has_manifest(digest):
                continue
            self._learning.add(digest)
            try:
                manifest = await self._learn_one(peer, digest)
            finally:
                self._learning.discard(digest)
            if manifest is not None:
                accepted.append(manifest)
        if accepted:
            self.new_info.set()
            await self.announce([m.digest for m in accepted], exclude={peer})
        return accepted

    async def _learn_one(self, peer: str, digest: str) -> Manifest | None:
        assert self.client is not None
        try:
            data = await self.client.get_bytes(f"{peer}/manifest/{digest}", 8 * 2**20)
            manifest = verify(data, self.policy, time.time(), self.accepted_version)
        except PeerError:
            self._peer_failed(peer)
            return None
        except RollbackAttackError:
            return None  # stale news (we are already past it), not an attack by this peer
        except ManifestError as exc:
            self.ban(peer, f"offered a bad manifest ({exc})")
            return None
        if manifest.digest != digest:
            self.ban(peer, "manifest does not match the digest it was offered under")
            return None
        self.store.put_manifest(manifest, data)
        return manifest

    async def announce(self, digests: list[str], exclude: set[str] = frozenset()) -> None:
        if self.client is None or not digests:
            return
        peers = [p for p in self.usable_peers() if p not in exclude]
        await gather_quietly([self.client.announce(p, digests) for p in peers])

    async def _poll_loop(self) -> None:
        """Pull fallback: every poll interval, ask each peer for its manifests and peers."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.cfg.poll_interval_s)

    async def poll_once(self) -> None:
        assert self.client is not None
        peers = self.usable_peers()
        indexes = await gather_quietly([self.client.get_json(f"{p}/manifests") for p in peers])
        lists = await gather_quietly([self.client.get_json(f"{p}/peers") for p in peers])
        for peer, index, plist in zip(peers, indexes, lists):
            if index is None:
                self._peer_failed(peer)
                continue
            if peer in self.peers:
                self.peers[peer] = 0  # answered: reset its failure count
            for url in (plist or {}).get("peers", [])[: self.cfg.max_peers]:
                if isinstance(url, str):
                    self.add_peer(url)
            fresh = self._fresh_from_index(index)
            if fresh:
                await self.learn(peer, fresh)

    def _fresh_from_index(self, index: Any) -> list[str]:
        if not isinstance(index, list):
            return []
        floor, out = self.accepted_version, []
        for entry in index[:10_000]:
            if not isinstance(entry, dict) or not isinstance(entry.get("digest"), str):
                continue
            version = entry.get("version")
            if isinstance(version, int) and (floor is None or version > floor):
                if not self.store.has_manifest(entry["digest"]):
                    out.append(entry["digest"])
        return out

    # ------------------------------------------------------------ NodeView (data plane)

    def manifest_index(self) -> list[dict[str, Any]]:
        return [
            {"digest": m.digest, "version": m.version, "kind": m.kind,
             "base_version": m.base_version, "payload_size": m.payload_size}
            for m in self.store.manifests()
        ]  # fmt: skip

    def manifest_bytes(self, digest: str) -> bytes | None:
        return self.store.manifest_bytes(digest)

    def manifest(self, digest: str) -> Manifest | None:
        return self.store.manifest(digest)

    def have(self, digest: str, requester: str | None) -> list[int] | None:
        m = self.manifest(digest)
        if m is None:
            return None
        return [i for i, c in enumerate(m.chunks) if self.store.has_chunk(c)]

    def chunk(self, sha256: str) -> bytes | None:
        return self.store.get_chunk(sha256)

    def peer_urls(self) -> list[str]:
        return sorted(self.usable_peers())

    def count_upload(self, nbytes: int) -> None:
        self.bytes_uploaded += nbytes
        self.metrics.uploaded.inc(nbytes)

    def count_download(self, nbytes: int) -> None:
        self.bytes_downloaded += nbytes
        self.metrics.downloaded.inc(nbytes)

    def status(self) -> dict[str, Any]:
        state = self.store.state
        return {
            "role": self.cfg.role,
            "url": self.url,
            "swarm": self.policy.swarm_id,
            "version": state.version if state else None,
            "state_hash": state.state_hash if state else None,
            "peers": self.peer_urls(),
            "banned": sorted(self.banned),
            "bytes_uploaded": self.bytes_uploaded,
            "bytes_downloaded": self.bytes_downloaded,
            "manifests": self.store.manifest_count(),
        }

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics.registry)

    def set_version(self, version: int) -> None:
        self.metrics.version.set(version)
