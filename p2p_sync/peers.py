"""The peer directory: which data-plane URLs a node knows, trusts, polls and has banned.

Sans-I/O, like the chunk scheduler (``p2p_sync.swarm``): events in (past tense), actions out;
no sockets, no clock, randomness passed in. The node feeds it what it hears and sees, and
carries out the actions (logging, metrics).

Why two kinds of peer: anyone can name a URL to a node (the ``X-P2PSync-Peer`` header on any
request, a ``/peers`` list, the ``url`` of an HTTP announcement), so a hostile client could
fill the table with URLs that lead nowhere, or only to its own nodes (an eclipse attack), and
push out the peers that serve real data. So a peer is *unproven* until it serves a chunk that
verifies against its signed manifest; then it is *proven*. (A manifest proves nothing: it is
a few hundred bytes anyone can relay; a chunk is upload the swarm needed.) Peers given in the
config (``--peers``) are trusted by the operator.

* Unproven peers hold at most ``max_unproven`` of the ``max_peers`` slots. When those slots
  are full, a newcomer takes the place of an unproven peer that has failed at least once (a
  URL that leads nowhere soon does), else it is not added. It never displaces a proven or
  given peer: a flood of fake URLs cannot push out the peers a node already trusts.
* Failures (no answer, transport errors) are counted; ``max_failures`` in a row drop a peer
  (it comes back when someone names it again); any answer resets the count.
* A peer that served data failing its signed hash, or a bad manifest, is banned for good.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PeerLimits:
    """Every limit of the directory."""

    max_peers: int = 64
    max_unproven: int = 32  # slots open to peers that have not served verified bytes yet
    max_failures: int = 5  # consecutive failures before a peer is dropped
    poll_fanout: int = 8  # peers asked per poll round: the given ones, then random others
    poll_interval_s: float = 1.0  # the node's pull fallback: one poll round this often


class Source(enum.Enum):
    """How a node heard of a peer."""

    GIVEN = "given"  # the node's own config: trusted by its operator
    HEARSAY = "hearsay"  # a header, a /peers list, an announcement, a peer record: unproven


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class PeerNamed:
    """Someone named ``url`` as a peer."""

    url: str
    source: Source = Source.HEARSAY


@dataclass(frozen=True)
class PeerAnswered:
    """``url`` answered a request (whatever the content): it is reachable."""

    url: str


@dataclass(frozen=True)
class PeerFailed:
    """A request to ``url`` got no usable answer."""

    url: str


@dataclass(frozen=True)
class PeerServedVerified:
    """``url`` served a chunk that verified against its signed manifest: it is proven."""

    url: str


@dataclass(frozen=True)
class PeerMisbehaved:
    """``url`` served data that failed verification: ban it."""

    url: str
    reason: str


PeerEvent = PeerNamed | PeerAnswered | PeerFailed | PeerServedVerified | PeerMisbehaved

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class PeerAdded:
    url: str


@dataclass(frozen=True)
class PeerDropped:
    url: str
    reason: str


@dataclass(frozen=True)
class PeerBanned:
    url: str
    reason: str


PeerAction = PeerAdded | PeerDropped | PeerBanned


@dataclass
class PeerEntry:
    """What the directory knows of one peer."""

    source: Source
    proven: bool = False
    failures: int = 0  # consecutive

    @property
    def trusted(self) -> bool:
        return self.proven or self.source is Source.GIVEN


@dataclass
class PeerDirectory:
    """The peers of one node (``me``: its own URL, never a peer of itself; ``given``: the URLs
    its operator configured, trusted whoever names them)."""

    limits: PeerLimits = field(default_factory=PeerLimits)
    me: set[str] = field(default_factory=set)  # this node's own names
    given: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.known: dict[str, PeerEntry] = {}  # insertion order: oldest first
        self.banned: set[str] = set()

    # ------------------------------------------------------------ queries

    def __contains__(self, url: object) -> bool:
        return url in self.known

    def __len__(self) -> int:
        return len(self.known)

    def usable(self) -> list[str]:
        return list(self.known)

    def unproven(self) -> list[str]:
        return [u for u, e in self.known.items() if not e.trusted]

    def failures(self, url: str) -> int:
        entry = self.known.get(url)
        return entry.failures if entry else 0

    def poll_targets(self, rng: random.Random) -> list[str]:
        """The given peers, plus a random few of the rest (``poll_fanout`` in all): news travels
        by announcement and gossip, so the poll is a fallback, and asking 64 peers a second
        each would cost the swarm thousands of requests a second."""
        given = [u for u, e in self.known.items() if e.source is Source.GIVEN]
        others = [u for u, e in self.known.items() if e.source is not Source.GIVEN]
        room = max(self.limits.poll_fanout - len(given), 0)
        return given + rng.sample(others, min(room, len(others)))

    # ------------------------------------------------------------ events

    def handle(self, event: PeerEvent) -> list[PeerAction]:
        """Apply one event; returns what the node should carry out (log, metrics)."""
        if isinstance(event, PeerNamed):
            return self._named(event.url, event.source)
        if isinstance(event, PeerMisbehaved):
            return self._ban(event.url, event.reason)
        entry = self.known.get(event.url)
        if entry is None:
            return []
        if isinstance(event, PeerFailed):
            return self._failed(event.url, entry)
        entry.failures = 0  # PeerAnswered or PeerServedVerified: reachable
        if isinstance(event, PeerServedVerified):
            entry.proven = True
        return []

    def _named(self, url: str, source: Source) -> list[PeerAction]:
        if url in self.me or url in self.banned:
            return []
        if url in self.given:
            source = Source.GIVEN
        entry = self.known.get(url)
        if entry is not None:
            if source is Source.GIVEN:
                entry.source = Source.GIVEN
            return []
        out: list[PeerAction] = []
        if source is Source.HEARSAY and not self._room_for_hearsay(out):
            return out
        if len(self.known) >= self.limits.max_peers:
            return out
        self.known[url] = PeerEntry(source)
        return [*out, PeerAdded(url)]

    def _room_for_hearsay(self, out: list[PeerAction]) -> bool:
        """Unproven slots left, or one freed by dropping an unproven peer that failed."""
        unproven = self.unproven()
        full = len(unproven) >= self.limits.max_unproven or len(self.known) >= self.limits.max_peers
        if not full:
            return True
        failing = [u for u in unproven if self.known[u].failures > 0]
        if not failing:
            return False
        worst = max(failing, key=lambda u: self.known[u].failures)  # oldest first among equals
        out.append(self._drop(worst, "displaced while unproven and failing"))
        return True

    def _failed(self, url: str, entry: PeerEntry) -> list[PeerAction]:
        entry.failures += 1
        if entry.failures < self.limits.max_failures:
            return []
        return [self._drop(url, f"{entry.failures} failures in a row")]  # back when named again

    def _drop(self, url: str, reason: str) -> PeerDropped:
        del self.known[url]
        return PeerDropped(url, reason)

    def _ban(self, url: str, reason: str) -> list[PeerAction]:
        self.known.pop(url, None)
        if url in self.banned:
            return []
        self.banned.add(url)
        return [PeerBanned(url, reason)]
