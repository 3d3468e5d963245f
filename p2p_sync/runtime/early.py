"""Have feeds opened while a manifest is on its way: a relayed version's first round trip.

A peer that hears of a version from a relay (the announcement names digests only) fetches
the manifest from the relay, a round trip; its download then asked each peer it follows for
its have-map, a second round trip, before it could request a chunk. Both questions need only
the digest, so the node asks them at once: it opens its have feeds to the peers the download
will follow when it hears the digest (``Learner.learn``), and the download takes each feed
over, with its answers so far, when it starts (``ChunkSource.early``). A peer that has not
learned the manifest yet holds the question until it has (``DataRouter._manifest_learned``).

Bounds, since an HTTP announcement is not signed and anyone may name a digest: feeds for at
most ``MAX_DIGESTS`` digests at a time, closed at once when the manifest cannot be had, and
those no download took closed ``2 * have_wait_s`` after they opened.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import aclosing
from typing import Any

from p2p_sync.errors import PeerError
from p2p_sync.protocol import sourcing
from p2p_sync.transport.client import PeerClient
from p2p_sync.transport.download import DataPlaneSource, HaveCursor, Timed
from p2p_sync.transport.frames import SCHEME

MAX_DIGESTS = 2  # digests with early feeds at once (a version's patch, and one spare)


def follow_order(urls: Collection[str], trusted: Callable[[str], bool], salt: str) -> list[str]:
    """The order in which a download follows peers (``protocol.sourcing.follow_order``):
    peers behind NAT are the ``p2p://`` ones, and the rest go in an order of this node's and
    this payload's own (``salt``). The early feeds and the download take the same order, so
    the download follows the peers already asked."""

    def rank(url: str) -> bytes:
        return hashlib.blake2b(f"{salt}\n{url}".encode(), digest_size=8).digest()

    return sourcing.follow_order(urls, trusted, lambda url: url.startswith(SCHEME), rank)


def _round_trip(res: Any, took: float) -> float | None:
    """The round trip a first answer took, less the time its peer held it waiting for the
    manifest (``held_ms``; None if that is not a count of milliseconds within ``took``)."""
    held = res.get("held_ms", 0) if isinstance(res, dict) else 0
    if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held <= took * 1000:
        return None
    return took - held / 1000


class _Feed:
    """One peer's have feed for one digest, read into a queue until a download takes it."""

    def __init__(self, client: PeerClient, peer: str, digest: str) -> None:
        self.answers: asyncio.Queue[Timed | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._read(client, peer, digest))

    async def _read(self, client: PeerClient, peer: str, digest: str) -> None:
        since, asked = HaveCursor(), time.monotonic()
        try:
            async with aclosing(client.get_feed(f"{peer}/have/{digest}{since.query()}")) as lines:
                async for res in lines:
                    rtt = _round_trip(res, time.monotonic() - asked) if since.known < 0 else None
                    have, since = DataPlaneSource.answer(peer, res, since)
                    self.answers.put_nowait((have, since, rtt))
        except PeerError:
            pass  # the download asks again itself
        finally:
            self.answers.put_nowait(None)

    async def follow(self) -> AsyncIterator[Timed]:
        """Its answers so far, then each later one, until the feed ends; closing stops it."""
        try:
            while (answer := await self.answers.get()) is not None:
                yield answer
        finally:
            self.task.cancel()


class EarlyFeeds:
    """The node's early feeds, by digest and peer."""

    def __init__(self, client: Callable[[], PeerClient | None], hold_s: float) -> None:
        self._client, self.hold_s = client, hold_s
        self._feeds: dict[str, dict[str, _Feed]] = {}
        self._expiry: dict[str, asyncio.TimerHandle] = {}
        self.salt = f"{random.getrandbits(64):016x}"  # this node's follow order

    def salt_for(self, digest: str) -> str:
        return f"{self.salt}:{digest}"

    def open(self, digest: str, peers: list[str]) -> bool:
        """Open feeds for ``digest`` to ``peers`` (the first the download will follow), unless
        they are open or ``MAX_DIGESTS`` digests have feeds already."""
        client = self._client()
        if client is None or digest in self._feeds or len(self._feeds) >= MAX_DIGESTS:
            return False
        self._feeds[digest] = {p: _Feed(client, p, digest) for p in peers}
        loop = asyncio.get_running_loop()
        self._expiry[digest] = loop.call_later(self.hold_s, self.close, digest)
        return True

    def take(self, digest: str, peer: str) -> AsyncIterator[Timed] | None:
        """``peer``'s feed for ``digest``, for a download to follow from here on; once."""
        feeds = self._feeds.get(digest, {})
        feed = feeds.pop(peer, None)
        if not feeds:
            self.close(digest)  # all taken: its slot is free
        return None if feed is None else feed.follow()

    def close(self, digest: str) -> None:
        """Stop the feeds of ``digest`` no download took (the manifest did not come, the
        download started without them, or they were never taken)."""
        handle = self._expiry.pop(digest, None)
        if handle is not None:
            handle.cancel()
        for feed in self._feeds.pop(digest, {}).values():
            feed.task.cancel()

    async def stop(self) -> None:
        """Close every feed no download took, and wait for them to end."""
        tasks = [f.task for feeds in self._feeds.values() for f in feeds.values()]
        for digest in list(self._feeds):
            self.close(digest)
        await asyncio.gather(*tasks, return_exceptions=True)

    def open_digests(self) -> list[str]:
        return list(self._feeds)
