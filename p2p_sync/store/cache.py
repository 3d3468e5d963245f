"""Chunks kept in memory, verified: a bounded LRU of recent ones and the node's own payloads.

Recently stored or served chunks are kept in a bounded LRU (``memory_cache_bytes``), so
relaying costs no disk read and no re-hash, and memory cannot rot like a disk can. A node's
own payloads of its newest version (the trainer's head patch and catch-up spans) are served
from the very bytes it built, whatever their size: every peer fetches them first, and an LRU a
little smaller than the head patch misses on every chunk (each miss evicts a chunk not yet
served).
"""

from __future__ import annotations

import collections

from p2p_sync.trust.manifest import Manifest


class ChunkCache:
    """The LRU of verified chunks by hash, and own payloads by manifest digest."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._hot: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # LRU
        self._hot_bytes = 0
        self._own: dict[str, tuple[Manifest, bytes]] = {}  # own payloads, newest version only

    def remember(self, digest: str, data: bytes) -> None:
        """Keep a verified chunk, dropping the least recently used past the budget."""
        if digest in self._hot or len(data) > self.max_bytes:
            return
        self._hot[digest] = data
        self._hot_bytes += len(data)
        while self._hot_bytes > self.max_bytes:
            _, old = self._hot.popitem(last=False)
            self._hot_bytes -= len(old)

    def forget(self, digest: str) -> None:
        hot = self._hot.pop(digest, None)
        self._hot_bytes -= len(hot) if hot is not None else 0

    def get(self, digest: str) -> bytes | None:
        """A cached chunk, now the most recently used."""
        hot = self._hot.get(digest)
        if hot is not None:
            self._hot.move_to_end(digest)
        return hot

    def peek(self, digest: str) -> bytes | None:
        """A cached chunk, the LRU order untouched (safe from a worker thread)."""
        return self._hot.get(digest)

    def keep_own(self, manifest: Manifest, payload: bytes) -> None:
        """Serve ``payload`` from memory until a newer version's own payload arrives (the
        caller, who built it, usually holds it anyway: no copy is made)."""
        for digest, (m, _) in list(self._own.items()):
            if m.version < manifest.version:
                del self._own[digest]
        self._own[manifest.digest] = (manifest, payload)

    def own(self, mdigest: str) -> tuple[Manifest, bytes] | None:
        return self._own.get(mdigest)

    def drop_own(self, mdigest: str) -> None:
        self._own.pop(mdigest, None)
