"""The requester's side of the data plane: what a node asks of its peers (``PeerClient``,
over HTTP, libp2p streams, reverse channels or in memory) and how it judges their replies.
Every failure is a ``PeerError``: a peer's answer is untrusted, like its requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from p2p_sync import jsonbounds
from p2p_sync.errors import (
    HostileJsonError,
    MalformedJsonError,
    PeerBusyError,
    PeerError,
    PeerLacksError,
)
from p2p_sync.transport.limits import HttpLimits


class PeerClient(Protocol):
    """What a node asks of its peers' data planes (``DataClient`` over HTTP,
    ``MemoryClient`` in one process). Every failure is a ``PeerError``."""

    self_url: str | None
    limits: HttpLimits

    async def get_json(self, url: str) -> Any: ...
    async def get_bytes(
        self, url: str, limit: int | None = None, moved: Callable[[int], None] | None = None
    ) -> bytes:
        """A body of at most ``limit`` bytes; ``moved`` is told how many are in as they come
        (a chunk's, over transports that see them come: HTTP), else never."""
        ...

    def get_parts(self, url: str, sizes: list[int]) -> AsyncIterator[bytes]:
        """A ``/chunks`` reply as its parts of ``sizes`` bytes, each as soon as it is in;
        fewer if the body ends early, a ``PeerError`` if it ends within a part or runs over."""
        ...

    def get_feed(self, url: str) -> AsyncIterator[Any]:
        """A ``FEED`` reply's JSON answers, each as soon as its line is in (one answer over
        transports that send whole replies); ends when the peer ends the reply."""
        ...

    async def post_json(self, url: str, doc: Any) -> Any: ...
    async def announce(
        self,
        peer: str,
        digests: list[str],
        extra: Mapping[str, Any] | None = None,
        chunks: list[bytes] | None = None,
        manifests: bytes = b"",
    ) -> None:
        """``POST /announce``; ``extra``: its optional fields (offers, manifests); with
        packed ``manifests`` (``pack_manifests``) or ``chunks`` (those ``extra["pushing"]``
        names) the framed body, those after the JSON."""
        ...

    async def close(self) -> None: ...


def check_reply(url: str, status: int, length: int, limit: int, expect: int = 200) -> None:
    """A reply's status and announced length, judged before its body is read."""
    if status == 503:
        raise PeerBusyError(f"{url}: busy")
    if status == 404 and expect != 404:
        raise PeerLacksError(f"{url}: HTTP 404")
    if status != expect:
        raise PeerError(f"{url}: HTTP {status}")
    if length > limit:
        raise PeerError(f"{url}: response of {length} bytes over limit")


async def split_parts(body: Awaitable[bytes], url: str, sizes: list[int]) -> AsyncIterator[bytes]:
    """``get_parts`` over a client that has the reply only whole (``body``: its request).
    The parts come before any verdict on the length: a peer sending too many bytes still
    has its first parts checked against their hashes (and is banned if they fail)."""
    try:
        data, at = await body, 0
    except PeerLacksError:  # it lacks the first
        return
    view = memoryview(data)
    for size in sizes:
        if at == len(data):
            return
        if at + size > len(data):
            raise PeerError(f"{url}: reply ends within a chunk")
        yield bytes(view[at : at + size])
        at += size
    if at != len(data):
        raise PeerError(f"{url}: reply over the chunks' length")


def parse_json(url: str, body: bytes) -> Any:
    """A peer's JSON answer; a PeerError if it is not JSON or past ``jsonbounds`` limits."""
    try:
        return jsonbounds.loads(body)
    except HostileJsonError as exc:
        raise PeerError(f"{url}: {exc}") from None
    except MalformedJsonError:
        raise PeerError(f"{url}: not JSON") from None


async def gather_quietly(calls: list[Awaitable[Any]]) -> list[Any]:
    """Run calls concurrently; a PeerError becomes None in the result (peers come and go)."""

    async def one(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except PeerError:
            return None

    return list(await asyncio.gather(*(one(c) for c in calls)))
