"""The node's face of the sans-I/O peer directory: events in, with the time, and its actions
carried out (logs, metrics). The directory decides; this only executes.

Logs: a ban, and a given peer going down ("peer X down (reason)", once per outage) and coming
back ("peer X back"). What any peer can make happen again and again (a malformed name in its
``/peers`` answer, an answer no parser can read: ``complain``) gets one line per
``COMPLAINT_EVERY_S``, which says how many it stands for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from p2p_sync.protocol.peers import (
    PeerAction,
    PeerAnswered,
    PeerBack,
    PeerBanned,
    PeerDirectory,
    PeerDown,
    PeerEntry,
    PeerEvent,
    PeerFailed,
    PeerMisbehaved,
    PeerNamed,
    PeerRefused,
    PeerServedVerified,
    Source,
)
from p2p_sync.protocol.ratelimit import RepeatedLine
from p2p_sync.runtime.metrics import Metrics

log = logging.getLogger("p2psync.node")
COMPLAINT_EVERY_S = 5.0


BANS_SHOWN = 256  # ban records /status lists (a flood of bad peers cannot grow it)


class Peering:
    """Who a node knows, trusts and bans."""

    def __init__(
        self,
        directory: PeerDirectory,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory, self.metrics, self.clock = directory, metrics, clock
        self.bans: dict[str, dict[str, Any]] = {}  # the latest BANS_SHOWN: peer, reason, since
        self._complaints = RepeatedLine(COMPLAINT_EVERY_S)

    @property
    def known(self) -> dict[str, PeerEntry]:
        return self.directory.known

    @property
    def banned(self) -> set[str]:
        return self.directory.banned

    def handle(self, event: PeerEvent) -> list[PeerAction]:
        """Feed the directory; carry out what it says."""
        actions: list[PeerAction] = self.directory.handle(event, self.clock())
        for a in actions:
            if isinstance(a, PeerBanned):
                log.warning("banned %s: %s", a.url, a.reason)
                self.metrics.bans.inc()
                self._record_ban(a)
            elif isinstance(a, PeerDown):
                log.warning("peer %s down (%s)", a.url, a.reason)
            elif isinstance(a, PeerBack):
                log.info("peer %s back", a.url)
            elif isinstance(a, PeerRefused):
                self.complain(None, f"refused a peer name: {a.reason}")
        if actions:
            self.metrics.peers.set(len(self.directory))
        return actions

    def add(
        self, url: str, source: Source = Source.HEARSAY, address: str | None = None
    ) -> str | None:
        """Someone named a peer, with what it proved (``Source``); its name if it is known now."""
        self.handle(PeerNamed(url, source, address))
        name = self.directory.name_of(url)
        return name if name in self.known else None

    def answered(self, url: str) -> None:
        self.handle(PeerAnswered(url))

    def failed(self, url: str, reason: str) -> None:
        self.handle(PeerFailed(url, reason[:200]))

    def ban(self, url: str, reason: str) -> None:
        self.handle(PeerMisbehaved(url, reason))

    def served(self, url: str) -> None:
        """``url`` served a chunk that verified against its signed manifest: a proven peer."""
        self.handle(PeerServedVerified(url))

    def usable(self) -> list[str]:
        return self.directory.usable()

    def complain(self, peer: str | None, what: str) -> None:
        """Something a peer sent that no part of the node could take: one log line, unless
        one was written less than ``COMPLAINT_EVERY_S`` ago (any peer can send it again and
        again); the next line says how many it stands for."""
        held = self._complaints.hit(self.clock())
        if not held:
            return
        more = f" (and {held - 1} more since the last such line)" if held > 1 else ""
        log.warning("%s%s%s", f"peer {peer}: " if peer else "", what[:300], more)

    def _record_ban(self, ban: PeerBanned) -> None:
        """Keep what ``status`` shows of a ban (wall-clock ``since``); bounded: the oldest
        records go first, the bans themselves stay."""
        self.bans[ban.url] = {"peer": ban.url, "reason": ban.reason[:300], "since": time.time()}
        while len(self.bans) > BANS_SHOWN:
            del self.bans[next(iter(self.bans))]

    def status(self) -> list[dict[str, Any]]:
        """The given peers' states, as ``/status`` lists them."""
        return self.directory.given_status(self.clock())


def described(exc: BaseException) -> str:
    """An error in a few words for a log line: its type and its message, cut short (no
    traceback: what a peer sent is no bug of ours)."""
    return f"{type(exc).__name__}: {str(exc)[:160]}"
