"""LAN shortcuts: a peer behind NAT reached over plain HTTP where its own network allows it.

Why: a node behind NAT is named ``p2p://<peer id>`` and served over libp2p streams (or a
reverse channel it opened to a public peer), because nobody outside can dial its HTTP port.
But volunteers often share a network: a lab's or a home's GPUs behind one router, a cluster's
nodes in one private subnet. They *can* dial each other's HTTP port, and HTTP costs ~1/15 of
py-libp2p's CPU per byte (``benchmarks/nat_serving.py``). So a node that reaches such a peer
over a direct libp2p connection (not through a relay) tries its HTTP port at the address that
connection goes to, and, once that answers as the same peer, sends its data-plane requests
there. The scheduler, scores and bans still see the one source ``p2p://<peer id>``.

Procedure (node B about peer X, the first time B sends X a request over libp2p streams):

1. ``GET /whoami`` over a stream to X: ``{"peer": X's peer id, "port": its data-plane port}``
   (the route is the data plane's own: ``transport.dataplane``). First, because it dials X if
   no connection is up yet: the probe starts with B's first request to X, and on a loaded
   machine that request is often the one that connects (reading the address first found
   none there, and the shortcut was then not tried again for ``RETRY_S``). If the request
   fails (libp2p may not know X's addresses yet), X was not asked: no verdict, the next
   request over streams tries again after ``ASK_AGAIN_S``;
2. the remote address of B's live direct libp2p connection to X (``direct_address``; none, or
   only a relayed one: no shortcut, ask again after ``RETRY_S``);
3. ``GET http://<that address>:<port>/whoami`` over HTTP within ``PROBE_TIMEOUT_S``: the
   shortcut holds if the answer names X.

Trust: the address is where B's Noise-authenticated connection to X goes, and the port is X's
own answer over it, so the shortcut can point only at X's own host (a relayed connection's
address is the relay's: step 2 skips those, and step 3 would find the relay's own peer id).
Chunk bytes are verified against the signed manifest whichever way they come. A shortcut that
stops connecting (``PeerUnreachableError``: the peer restarted elsewhere, the network changed)
is dropped; requests go over streams again and the shortcut is tried again after ``RETRY_S``.

Bounds: one probe per peer at a time, none for ``RETRY_S`` after one failed (``ASK_AGAIN_S``
after one that could not ask); at most
``MAX_ROUTES`` shortcuts (the oldest goes first: peers come and go, and one that is still
around is found again on its next request over streams).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from p2p_sync.errors import P2PError, PeerError
from p2p_sync.transport.client import PeerClient

log = logging.getLogger("p2psync.lan")
PROBE_TIMEOUT_S = 3.0  # the HTTP probe (step 3): a SYN nobody answers costs this, once
RETRY_S = 300.0  # after a failed probe, or a shortcut that stopped connecting
ASK_AGAIN_S = 5.0  # after a probe whose stream request failed: the peer was not asked at all
MAX_ROUTES = 256  # shortcuts kept (a node follows at most directory.max_peers peers)


def shortcut_url(address: str, port: Any) -> str | None:
    """``http://address:port`` for an IP address and a port number, else None."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast:
        return None
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"http://{host}:{port}"


def split_base(url: str) -> tuple[str, str]:
    """``p2p://<id>/path?q`` -> (``p2p://<id>``, ``/path?q``)."""
    cut = url.find("/", len("p2p://"))
    return (url, "") if cut < 0 else (url[:cut], url[cut:])


class LanShortcuts:
    """HTTP addresses of ``p2p://`` peers that B reached directly (see the module docstring).

    ``address(peer id)`` is the remote IP of a live direct libp2p connection to the peer, or
    None; ``streams`` asks over libp2p, ``http`` over HTTP."""

    def __init__(
        self,
        http: PeerClient,
        streams: PeerClient,
        address: Callable[[str], Awaitable[str | None]],
    ) -> None:
        self.http, self.streams, self._address = http, streams, address
        self.routes: dict[str, str] = {}  # p2p://<id> -> http://address:port
        self._failed: dict[str, float] = {}  # p2p://<id> -> when its last try failed
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.bytes_downloaded = 0  # chunk bytes fetched over shortcuts

    def route(self, url: str) -> str | None:
        """``url`` (a ``p2p://`` URL) over its shortcut, or None while there is none."""
        base, rest = split_base(url)
        target = self.routes.get(base)
        return None if target is None else target + rest

    def consider(self, url: str) -> None:
        """A request to ``url`` goes over libp2p: probe for a shortcut unless one is under
        way or failed less than ``RETRY_S`` ago. O(1) on every call but the first."""
        base, _ = split_base(url)
        if base in self.routes or base in self._probes:
            return
        failed = self._failed.get(base)
        if failed is not None and time.monotonic() - failed < RETRY_S:
            return
        self._failed.pop(base, None)
        task = asyncio.create_task(self._probe(base))
        self._probes[base] = task
        task.add_done_callback(lambda _t: self._probes.pop(base, None))

    def drop(self, url: str) -> None:
        """The shortcut for ``url``'s peer did not connect: streams again, retry later."""
        base, _ = split_base(url)
        if self.routes.pop(base, None) is not None:
            log.info("LAN shortcut to %s stopped connecting", base)
            self._fail(base)

    async def _probe(self, base: str) -> None:
        peer = base.removeprefix("p2p://")
        try:  # step 1: on a loaded machine libp2p may not know the peer's addresses yet
            doc = await self.streams.get_json(f"p2p://{peer}/whoami")
        except (PeerError, P2PError) as exc:  # not asked: no verdict, ask again soon
            log.debug("LAN shortcut to %s not asked: %s", base, exc)
            self._fail(base, RETRY_S - ASK_AGAIN_S)
            return
        try:
            target = await self._find(peer, doc)
        except (PeerError, P2PError) as exc:  # no answer, or libp2p stopped meanwhile
            log.debug("no LAN shortcut to %s: %s", base, exc)
            target = None
        if target is None:
            self._fail(base)
            return
        if len(self.routes) >= MAX_ROUTES:
            del self.routes[next(iter(self.routes))]
        self.routes[base] = target
        log.info("LAN shortcut: %s at %s", base, target)

    async def _find(self, peer: str, doc: Any) -> str | None:
        """Steps 2-3 after ``doc``, the peer's answer to step 1: the shortcut's URL, or None."""
        address = await self._address(peer)
        if address is None:
            return None
        target = shortcut_url(address, doc.get("port") if isinstance(doc, dict) else None)
        if target is None:
            return None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                seen = await self.http.get_json(f"{target}/whoami")
        except TimeoutError:
            return None
        return target if isinstance(seen, dict) and seen.get("peer") == peer else None

    def _fail(self, base: str, waited: float = 0.0) -> None:
        """Try ``base`` again ``RETRY_S - waited`` from now."""
        now = time.monotonic()
        self._failed = {b: t for b, t in self._failed.items() if now - t < RETRY_S}
        self._failed[base] = now - waited

    def status(self) -> dict[str, Any]:
        routes = dict(sorted(self.routes.items()))
        return {"routes": routes, "bytes_downloaded": self.bytes_downloaded}

    async def close(self) -> None:
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
