"""The data-plane client's connection pool, renewed when what it trusted changes.

A private swarm keeps its TLS connections open between versions (``HttpLimits.
tls_keepalive_s``: one handshake per pair of peers, not per version), so a connection to a
server revoked since could otherwise carry requests for as long. When the node adopts a newer
revocation list (``SwarmTls.adopted`` counts them) the next request takes a new pool, whose
handshakes check the new list; the old pool closes once the requests it carries end, so a
transfer in progress is not cut.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp


class RenewedPools:
    """``request`` through the current pool (an aiohttp ``ClientSession``); ``generation()``
    changing retires it."""

    def __init__(
        self, make: Callable[[], aiohttp.ClientSession], generation: Callable[[], int]
    ) -> None:
        self._make, self._generation = make, generation
        self.pool, self._made_at = make(), generation()
        self._busy: dict[aiohttp.ClientSession, int] = {}
        self.renewed = 0  # pools retired so far

    def _current(self) -> aiohttp.ClientSession:
        now = self._generation()
        if now != self._made_at:
            old, self.pool, self._made_at = self.pool, self._make(), now
            self.renewed += 1
            self._busy.setdefault(old, 0)  # closed by the request that finds it idle
        return self.pool

    @contextlib.asynccontextmanager
    async def request(self, method: str, url: str, **kw: Any) -> AsyncIterator[Any]:
        """``pool.request(method, url, **kw)`` as a context, counted while it runs."""
        pool = self._current()
        self._busy[pool] = self._busy.get(pool, 0) + 1
        try:
            async with pool.request(method, url, **kw) as resp:
                yield resp
        finally:
            self._busy[pool] -= 1
            await self._close_idle()

    async def _close_idle(self) -> None:
        """Close every retired pool that carries no request any more."""
        for old in [s for s, n in self._busy.items() if n == 0 and s is not self.pool]:
            del self._busy[old]
            await old.close()

    async def close(self) -> None:
        for old in list(self._busy):
            if old is not self.pool:
                await old.close()
        self._busy.clear()
        await self.pool.close()
