"""What a node does with one gossip message, whatever carried it (libp2p gossipsub, or the
in-memory hub of tests): judge it, remember what it accepted, count, and say whether to forward
it and whether its forwarder has now earned a blacklist.

The judging itself is the node's trusted gate (``TrustedSet.judge`` via a ``Judge``
callback); this holds the transport's part of the policy: a bounded memory of accepted digests
(so a repeat is ignored, not judged as news again) and ``max_rejects`` rejected messages per
forwarder before it is cut off. No asyncio, no libp2p: the callers pass a ``schedule`` that
hands accepted news to the node's loop (``call_soon_threadsafe`` from the Trio thread, plain
``call_soon`` in memory).

News a node learned another way first (an HTTP push or poll stored the manifest before the
gossip copy came) is still news *to gossip*: judged "already known", the copy would be ignored
and not forwarded, and every peer behind this one on the mesh would lose it (measured: a
bootstrap's leaf never heard an announcement). So the node notes such digests
(:meth:`GossipValidator.learned_elsewhere`); the first gossip copy of one is accepted and
forwarded, later ones are ignored. Replays stay bounded: a digest is forwarded at most once
per note, and only digests the node itself just learned are noted.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2p_sync.bounded import trim
from p2p_sync.trust.announce import Decision, Verdict

log = logging.getLogger("p2psync.p2p")

Judge = Callable[[bytes, Callable[[str], bool]], Decision]
OnAccept = Callable[[Decision, str | None, int], None]
OnKnown = Callable[[Decision, int], None]
Schedule = Callable[..., Any]  # schedule(fn, *args): run fn(*args) on the node's loop


@dataclass(frozen=True)
class Outcome:
    """The transport's answer: forward the message; cut its forwarder off now."""

    forward: bool
    blacklist: bool = False


class GossipValidator:
    """One node's gossip validation state."""

    def __init__(
        self,
        judge: Judge,
        on_accept: OnAccept,
        known: Callable[[str], bool],
        on_known: OnKnown | None,
        schedule: Schedule,
        max_rejects: int = 3,
        seen_digests: int = 4096,
    ) -> None:
        self._judge, self._on_accept, self._known = judge, on_accept, known
        self._on_known, self._schedule = on_known, schedule
        self.max_rejects, self.seen_digests = max_rejects, seen_digests
        self.counts = collections.Counter[str]()
        self.rejects = collections.Counter[str]()
        self._seen: dict[str, None] = {}
        self._elsewhere: dict[str, None] = {}  # known to the node, not yet seen by gossip
        self._lock = threading.RLock()  # validate: the transport's thread; notes: the node's

    def learned_elsewhere(self, digests: list[str]) -> None:
        """The node learned these manifests outside gossip: forward their first gossip copy."""
        with self._lock:
            for digest in digests:
                if digest not in self._seen:
                    self._elsewhere[digest] = None
            trim(self._elsewhere, self.seen_digests)

    def _knows(self, digest: str) -> bool:
        """Whether gossip news of ``digest`` is old news (seen by gossip, or known to the node
        and not noted as learned elsewhere)."""
        if digest in self._seen:
            return True
        return digest not in self._elsewhere and self._known(digest)

    def validate(self, data: bytes, forwarder: str, sender_url: str | None) -> Outcome:
        """Judge ``data`` relayed by ``forwarder`` (its HTTP URL, when known, is ``sender_url``)."""
        with self._lock:
            return self._validate(data, forwarder, sender_url)

    def _validate(self, data: bytes, forwarder: str, sender_url: str | None) -> Outcome:
        decision = self._judge(data, self._knows)
        self.counts[decision.verdict.value] += 1
        if decision.verdict is Verdict.REJECT:
            return Outcome(False, self._penalize(forwarder, decision.reason))
        now_ms = int(time.time() * 1000)
        if decision.verdict is Verdict.IGNORE:
            if self._on_known is not None and decision.announcement is not None:
                self._schedule(self._on_known, decision, now_ms)
            return Outcome(False)
        assert decision.announcement is not None
        for digest in decision.announcement.digests:
            self._seen[digest] = None
            self._elsewhere.pop(digest, None)
        trim(self._seen, self.seen_digests)
        self._schedule(self._on_accept, decision, sender_url, now_ms)
        return Outcome(True)

    def _penalize(self, forwarder: str, reason: str) -> bool:
        """Count a rejected message; True once ``forwarder`` has ``max_rejects`` of them."""
        self.rejects[forwarder] += 1
        log.warning("rejected announcement from %s: %s", forwarder, reason)
        return self.rejects[forwarder] >= self.max_rejects
