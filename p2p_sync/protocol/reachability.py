"""Can others dial this node's HTTP data plane? A verdict from peers' dial-backs (sans-I/O).

Why: most volunteers sit behind a home router or a carrier-grade NAT. They can dial out, nobody
can dial in, so an HTTP URL they advertise only makes peers wait for connect timeouts. A node
asks a few peers to dial its URL back (``POST /dialback``, ``transport.dataplane``): a peer
connects to the URL only when its host is the address the request came from (so nobody can
point peers at a third party), fetches ``/dialback/<nonce>`` and says whether the nonce came
back. One success proves the URL works from outside; ``needed_noes`` failures from distinct
peers with no success mean it does not. The node then names itself by its HTTP URL, or by
``p2p://<peer id>`` and serves over the libp2p connections it opened (``transport.streams``).

A lying peer can only mislead the asker about itself (a false "no" moves its uploads to libp2p
streams; a false "yes" costs peers a failed dial, after which the directory drops the URL), and
the question is asked again every ``recheck_s``.

Modes: ``auto`` asks; ``public`` (a server with a known address, a forwarded port) and
``private`` (never advertise HTTP) are the operator's word and ask nobody.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MODES = ("auto", "public", "private")


class Verdict(enum.Enum):
    UNKNOWN = "unknown"
    REACHABLE = "reachable"
    BEHIND_NAT = "behind NAT"


@dataclass(frozen=True)
class ReachabilityLimits:
    """How a node decides (``mode``) and every bound of the check, on both sides."""

    mode: str = "auto"  # auto: ask peers; public / private: the operator says
    max_asks: int = 3  # peers asked per round
    needed_noes: int = 2  # failed dial-backs from distinct peers (and no success) -> behind NAT
    recheck_s: float = 300.0  # a new round after this long
    retry_s: float = 2.0  # while unknown: look for peers to ask this often
    dial_timeout_s: float = 3.0  # a dial-back done for a peer: connect and answer
    max_concurrent: int = 4  # dial-backs this node does for others at once (more: busy)
    links: int = 32  # behind NAT: public peers it keeps a reverse channel open to
    max_channels: int = 64  # reverse channels this node accepts from NATed peers
    lan: bool = True  # NATed peers reached directly: plain HTTP on their network (transport.lan)


@dataclass(frozen=True)
class RelayBounds:
    """Circuit relay v2 (``transport.relay``): what a reachable node offers NATed ones, and how
    many relays a NATed node reserves on. Every bound of it."""

    max_reservations: int = 16  # NATed peers holding a slot here
    max_circuits: int = 4  # circuits to each of them at once
    mbps: float = 50.0  # everything relayed, both directions, all circuits together
    data_mb: float = 1024.0  # per circuit, both directions
    duration_s: float = 3600.0  # per circuit
    reservations: int = 2  # relays a NATed node reserves a slot on


@dataclass
class Reachability:
    """The verdict and the current round of questions."""

    limits: ReachabilityLimits = field(default_factory=ReachabilityLimits)
    verdict: Verdict = Verdict.UNKNOWN
    observed: str | None = None  # this node's address as the last answering peer saw it
    _asked: set[str] = field(default_factory=set)  # answered or pending this round
    _last_asked: dict[str, float] = field(default_factory=dict)  # ask a silent one again later
    _pending: set[str] = field(default_factory=set)
    _noes: set[str] = field(default_factory=set)
    _yes: bool = False  # a dial-back of this round succeeded
    _round_at: float | None = None

    @property
    def mode(self) -> str:
        return self.limits.mode

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"reachability must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode != "auto":
            self.verdict = Verdict.REACHABLE if self.mode == "public" else Verdict.BEHIND_NAT

    def to_ask(self, candidates: list[str], now: float) -> list[str]:
        """Peers to ask now (the caller reports each answer to :meth:`answered`)."""
        if self.mode != "auto":
            return []
        if self._round_at is not None and now - self._round_at >= self.limits.recheck_s:
            self._asked, self._noes, self._yes, self._round_at = set(), set(), False, None
        if self._yes or len(self._noes) >= self.limits.needed_noes:
            return []  # this round has its verdict
        room, retry = self.limits.max_asks - len(self._pending), self.limits.retry_s
        fresh = [
            p
            for p in candidates
            if p not in self._asked and now - self._last_asked.get(p, -retry) >= retry
        ][: max(room, 0)]
        if fresh and self._round_at is None:
            self._round_at = now
        if len(self._last_asked) > 4 * self.limits.max_asks + len(fresh):  # bounded memory
            self._last_asked = {p: t for p, t in self._last_asked.items() if now - t < retry}
        self._asked.update(fresh)
        self._pending.update(fresh)
        self._last_asked.update((p, now) for p in fresh)
        return fresh

    def answered(self, peer: str, reachable: bool | None, observed: str | None) -> bool:
        """``peer``'s answer (None: it gave none). True if the verdict changed."""
        self._pending.discard(peer)
        if reachable is None:
            self._asked.discard(peer)  # it said nothing: ask it again after retry_s
            return False
        self.observed = observed or self.observed
        before = self.verdict
        if reachable:
            self._yes, self.verdict = True, Verdict.REACHABLE
        else:
            self._noes.add(peer)
            if len(self._noes) >= self.limits.needed_noes and not self._yes:
                self.verdict = Verdict.BEHIND_NAT
        return self.verdict is not before

    def exhausted(self, candidates: list[str]) -> bool:
        """No more peers to ask and nothing pending: with at least one "no" and no "yes",
        conclude (a swarm of one other peer cannot give two answers). True if it changed."""
        if self.mode != "auto" or self._pending or self._yes or not self._noes:
            return False
        if any(p not in self._asked for p in candidates):
            return False
        before, self.verdict = self.verdict, Verdict.BEHIND_NAT
        return self.verdict is not before
