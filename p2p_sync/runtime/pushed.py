"""Chunks pushed behind an announcement, kept until the download of their payload takes them.

The trainer sends each follower the first chunks it hands it right behind the manifest, in the
same ``POST /announce`` body (``transport.announcement``, the framed form): its uplink then carries
chunks during the round trip the follower's first request would take. The data plane reads
them while the follower is still verifying the manifest and planning, so they wait here: the
learner stores each, verified, as soon as the manifest is in (``Learner._adopt``), and the
download of that payload takes them for its scheduler (``transport.download``). Bounded in
bytes: a push no download takes (a follower planning another artifact, a payload it already
has) is dropped oldest first, never held for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

MAX_BYTES = 16 * 2**20  # pushed chunks held at once, all payloads together


@dataclass
class PushedChunks:
    """Pushed chunks by payload digest, each as (peer, index, bytes), oldest first."""

    max_bytes: int = MAX_BYTES
    _held: dict[str, list[tuple[str, int, bytes]]] = field(default_factory=dict)
    _news: dict[str, asyncio.Event] = field(default_factory=dict)
    _bytes: int = 0

    def put(self, peer: str, digest: str, index: int, data: bytes) -> None:
        """Keep a pushed chunk (unverified) and wake its payload's download."""
        if len(data) > self.max_bytes:
            return
        while self._bytes + len(data) > self.max_bytes:
            self._drop_oldest()
        self._held.setdefault(digest, []).append((peer, index, data))
        self._bytes += len(data)
        event = self._news.get(digest)
        if event is not None:
            event.set()

    def held(self, digest: str) -> list[tuple[str, int, bytes]]:
        """What was pushed of ``digest`` and not taken yet (left here)."""
        return list(self._held.get(digest, ()))

    def take(self, digest: str) -> list[tuple[str, int, bytes]]:
        """What was pushed of ``digest`` so far (forgotten here)."""
        got = self._held.pop(digest, [])
        self._bytes -= sum(len(d) for _, _, d in got)
        return got

    async def follow(self, digest: str) -> AsyncIterator[tuple[str, int, bytes]]:
        """Every chunk pushed of ``digest``, as it comes, until the caller stops iterating
        (the download ends)."""
        event = self._news.setdefault(digest, asyncio.Event())
        try:
            while True:
                event.clear()
                for item in self.take(digest):
                    yield item
                await event.wait()
        finally:
            if self._news.get(digest) is event:
                del self._news[digest]

    def _drop_oldest(self) -> None:
        digest = next(iter(self._held))
        self.take(digest)
