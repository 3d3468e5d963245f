"""The peer directory: which data-plane URLs a node knows, trusts, polls and has banned.

Sans-I/O, like the chunk scheduler (``p2p_sync.protocol.swarm``): events in (past tense), actions
out;
no sockets, no clock (``now`` is passed in), randomness passed in (``rng``). The node feeds it
what it hears and sees, and carries out the actions (logging, metrics).

**Names.** Every name is normalised before it is stored or shared (:func:`peer_name`): scheme
``http`` or ``https``, a host (an IP address, or a DNS name) and a port (the scheme's default
when none is written), nothing else; or ``p2p://<peer id>``. Anything else (another scheme, a
path, a query, credentials, a bad port) is refused: a hostile ``/peers`` answer can neither
make the node request a path of its choosing nor have it hand such a name on.

**Admission: a peer enters the table when it has proved something.** Anyone can name a URL (the
``X-P2PSync-Peer`` header on any request, a ``/peers`` list, the ``url`` of an announcement),
so a name alone proves nothing: taken as it comes, a flood of names from one client would fill
the table with URLs that lead nowhere or to the attacker's nodes (an eclipse), keep newcomers
out, and cost the node a stream of requests to them. What a name comes with
(:class:`Source`) decides:

* ``GIVEN``: the operator's config (``--peers``). Trusted; never dropped: retried with capped
  exponential back-off and jitter (``retry_min_s`` doubling up to ``retry_max_s``) for as long
  as the node runs; ``PeerDown`` once when it stops answering, ``PeerBack`` when it answers.
* ``DIALED``: this node dialed the URL back for a reachability question from the URL's own host
  (``p2p_sync.protocol.reachability``) and the nonce came back: it answers there.
* ``RECORD``: a signed libp2p peer record carries it, or it is ``p2p://`` the peer id of a
  libp2p connection to this node (the key proved in its handshake).
* ``REQUESTER``: chunk bytes were served to a request naming it from the URL's own host (a
  ``p2p://`` name: counted against the request's address). Upload demand, which the requester
  pays for too, so a node that fetches from us is known (and can be told of news).
* ``HEARSAY``: listed in ``/peers`` by a peer this node trusts (:meth:`vouches`: given or
  proven), which lists only names it has checked itself (:meth:`PeerDirectory.shared`).
* ``CLAIM``: anything else (a header on any other request, an announcement's url, the list of
  a peer that proved nothing): refused. Such names never take a slot, so they cannot crowd
  out requesters or anyone else, and the node sends them nothing.

**Bounds.** A peer is *proven* once it serves a chunk that verifies against its signed manifest
(a manifest proves nothing: anyone can relay a few hundred signed bytes). Peers neither given
nor proven hold at most ``max_unproven`` of the ``max_peers`` slots, and at most
``max_per_address`` of those count against one address (an IPv4 address, an IPv6 /64, the
address a ``p2p://`` name came from): a client with one address holds that many slots whatever
it proves, and newcomers from elsewhere still get in. When full, a newcomer takes the place of
an unproven peer that has failed (one of the same address, when that address is full); it
never displaces a proven or given peer.

**Failures.** A peer that fails is not polled again before its back-off has passed. One not
given is dropped after ``max_failures`` in a row (it comes back only with new evidence); any
answer resets the count. A peer that served data failing its signed hash, or a bad manifest,
is banned for good.

**Sharing.** ``/peers`` lists given and proven peers and those this node checked itself (it
dialed them back, a signed record carries them, they answered its requests), while they
answer: never a bare name.
"""

from __future__ import annotations

import enum
import ipaddress
import random
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from p2p_sync.errors import MalformedPeerUrlError

PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")  # a libp2p peer id (base58btc)
P2P = "p2p://"  # a peer reached over libp2p only (behind NAT: ``transport.streams``)
PORTS = {"http": 80, "https": 443}  # the schemes of a data plane, and their default ports
MAX_NAME = 255
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_DNS = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")

# ---------------------------------------------------------------- names


def peer_name(url: object) -> str:
    """``url`` as a peer's name: ``scheme://host:port`` (``http``/``https``, the host lowercased,
    IPv6 in brackets, the default port written out) or ``p2p://<peer id>``; anything else
    raises :class:`MalformedPeerUrlError`. A name is its own normal form."""
    if not isinstance(url, str):
        raise MalformedPeerUrlError(f"a peer URL must be text, not {type(url).__name__}")
    shown = repr(url[:80])
    if len(url) > MAX_NAME or not url.isascii() or not url.isprintable() or " " in url:
        raise MalformedPeerUrlError(f"{shown}: not a short ASCII URL")
    if url.startswith(P2P):
        if PEER_ID.match(url[len(P2P) :]):
            return url
        raise MalformedPeerUrlError(f"{shown}: not p2p://<peer id>")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MalformedPeerUrlError(f"{shown}: {exc}") from None
    if parts.scheme not in PORTS:
        raise MalformedPeerUrlError(f"{shown}: the scheme must be http, https or p2p")
    if "@" in parts.netloc:
        raise MalformedPeerUrlError(f"{shown}: credentials in a peer URL")
    if parts.path not in ("", "/") or "?" in url or "#" in url:
        raise MalformedPeerUrlError(f"{shown}: a peer URL has no path, query or fragment")
    if port == 0:
        raise MalformedPeerUrlError(f"{shown}: port 0")
    return f"{parts.scheme}://{_host(parts.hostname, shown)}:{port or PORTS[parts.scheme]}"


def is_peer_name(url: object) -> bool:
    """Does :func:`peer_name` take ``url``?"""
    return _name_or_none(url) is not None


def _host(host: str | None, shown: str) -> str:
    """A URL's host as written in a name: an IP address that can be dialed, or a DNS name
    (none that reads as a number: resolvers take those for IPv4 addresses in other spellings)."""
    if not host or "%" in host:  # none, or an IPv6 zone: a link on the namer's machine
        raise MalformedPeerUrlError(f"{shown}: no host, or a zoned one")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if _DNS.match(host.rstrip(".")) and not host.rstrip(".").rpartition(".")[2].isdigit():
            return host.rstrip(".")
        raise MalformedPeerUrlError(f"{shown}: not an IP address or a host name") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255":
        raise MalformedPeerUrlError(f"{shown}: {ip} cannot be dialed")
    return f"[{ip.compressed}]" if ip.version == 6 else str(ip)


def address_key(host: str | None) -> str | None:
    """The address slots are counted against, for a host or a request's address: an IPv4
    address, an IPv6 /64 (one subscriber's share: a home or a server gets a whole /64), else
    the name as it is; None for none."""
    if not host:
        return None
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def address_of(name: str) -> str | None:
    """The address a normalised name's slot counts against; None for ``p2p://`` names."""
    return None if name.startswith(P2P) else address_key(urlsplit(name).hostname)


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PeerLimits:
    """Every limit of the directory."""

    max_peers: int = 64
    max_unproven: int = 32  # slots open to peers that have not served verified bytes yet
    max_per_address: int = 16  # of those, held by one address (an IPv4 address, an IPv6 /64)
    max_failures: int = 5  # consecutive failures before a peer not given is dropped
    # a peer that failed is asked again after retry_min_s, doubling with each failure in a
    # row up to retry_max_s (each wait jittered: half to all of it)
    retry_min_s: float = 1.0
    retry_max_s: float = 60.0
    poll_fanout: int = 8  # peers asked per poll round: the given ones, then random others
    poll_interval_s: float = 1.0  # the node's pull fallback: one poll round this often


class Source(enum.Enum):
    """How a node heard of a peer: what the name comes with (the module docstring)."""

    GIVEN = "given"  # the node's own config: trusted by its operator
    DIALED = "dialed"  # this node dialed it back for a question from its host: it answers
    RECORD = "record"  # a signed libp2p record, or a libp2p connection, proves it
    REQUESTER = "requester"  # it fetched chunks from this node, from its own address
    HEARSAY = "hearsay"  # listed by a peer this node trusts (given or proven)
    CLAIM = "claim"  # named by anyone else: refused


CHECKED = frozenset({Source.GIVEN, Source.DIALED, Source.RECORD})  # seen to answer, or signed
ON_ITS_HOST = frozenset({Source.DIALED, Source.REQUESTER})  # the name's host must be who asked

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class PeerNamed:
    """Someone named ``url`` as a peer; ``address``: where the naming request came from (for
    ``DIALED`` and ``REQUESTER``, which must come from the name's own host)."""

    url: str
    source: Source = Source.HEARSAY
    address: str | None = None


@dataclass(frozen=True)
class PeerAnswered:
    """``url`` answered a request (whatever the content): it is reachable."""

    url: str


@dataclass(frozen=True)
class PeerFailed:
    """A request to ``url`` got no usable answer."""

    url: str
    reason: str = "no answer"


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


@dataclass(frozen=True)
class PeerDown:
    """A given peer stopped answering (once per outage: it is retried with back-off)."""

    url: str
    reason: str


@dataclass(frozen=True)
class PeerBack:
    """A given peer that was down answered again."""

    url: str


@dataclass(frozen=True)
class PeerRefused:
    """A name that is no peer URL (:func:`peer_name`), from someone this node listens to."""

    url: str
    reason: str


PeerAction = PeerAdded | PeerDropped | PeerBanned | PeerDown | PeerBack | PeerRefused


@dataclass
class PeerEntry:
    """What the directory knows of one peer."""

    source: Source
    address: str | None = None  # what its unproven slot counts against
    proven: bool = False
    checked: bool = False  # it answered this node, or was dialed back, or signed a record
    seen: bool = False  # it answered this node at least once
    failures: int = 0  # consecutive
    retry_at: float = 0.0  # not polled again before this (back-off after failures)
    error: str = ""  # why the last request to it failed

    @property
    def trusted(self) -> bool:
        return self.proven or self.source is Source.GIVEN

    @property
    def state(self) -> str:
        """``down`` (its last request failed), ``up`` (it answered), ``unknown`` (not asked)."""
        if self.failures:
            return "down"
        return "up" if self.seen else "unknown"


@dataclass
class PeerDirectory:
    """The peers of one node (``me``: its own names, never a peer of itself; ``given``: the
    URLs its operator configured, trusted whoever names them; ``rng``: the back-off's
    jitter)."""

    limits: PeerLimits = field(default_factory=PeerLimits)
    me: set[str] = field(default_factory=set)  # this node's own names
    given: frozenset[str] = frozenset()
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.given = frozenset(n for n in map(_name_or_none, self.given) if n is not None)
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

    def vouches(self, url: str) -> bool:
        """Are the names in ``url``'s ``/peers`` answer taken (``HEARSAY``)? Only from a peer
        this node trusts: given, or proven by the chunks it served."""
        entry = self.known.get(url)
        return entry is not None and entry.trusted

    def shared(self) -> list[str]:
        """What this node hands on in ``/peers``: given and proven peers, and the others it
        checked itself, while they answer. Never a bare name (module docstring)."""
        return sorted(
            u for u, e in self.known.items() if not e.failures and (e.trusted or e.checked)
        )

    def poll_targets(self, rng: random.Random, now: float) -> list[str]:
        """The given peers, plus a random few of the rest (``poll_fanout`` in all), leaving
        out those whose back-off has not passed: news travels by announcement and gossip, so
        the poll is a fallback, and asking 64 peers a second each would cost the swarm
        thousands of requests a second."""
        due = [(u, e) for u, e in self.known.items() if e.retry_at <= now]
        given = [u for u, e in due if e.source is Source.GIVEN]
        others = [u for u, e in due if e.source is not Source.GIVEN]
        room = max(self.limits.poll_fanout - len(given), 0)
        return given + rng.sample(others, min(room, len(others)))

    def given_status(self, now: float) -> list[dict[str, Any]]:
        """The given peers as ``/status`` shows them: state (``up``, ``down``, ``unknown``:
        not asked yet), failures in a row, seconds to the next try, the last error."""
        return [
            {
                "url": u,
                "state": e.state,
                "failures": e.failures,
                "retry_in_s": round(max(e.retry_at - now, 0.0), 2),
                "error": e.error,
            }
            for u, e in self.known.items()
            if e.source is Source.GIVEN
        ]

    def retry_delay(self, failures: int) -> float:
        """The back-off after ``failures`` in a row: ``retry_min_s`` doubling with each one,
        capped at ``retry_max_s``, jittered to half to all of that (peers that lost the same
        peer at once do not all come back at once)."""
        exponent = min(max(failures - 1, 0), 62)
        cap = min(self.limits.retry_max_s, self.limits.retry_min_s * 2.0**exponent)
        return cap * (0.5 + 0.5 * self.rng.random())

    # ------------------------------------------------------------ events

    def handle(self, event: PeerEvent, now: float) -> list[PeerAction]:
        """Apply one event at time ``now``; returns what the node should carry out."""
        if isinstance(event, PeerNamed):
            return self._named(event.url, event.source, event.address)
        url = self.name_of(event.url)
        if url is None:
            return []
        if isinstance(event, PeerMisbehaved):
            return self._ban(url, event.reason)
        entry = self.known.get(url)
        if entry is None:
            return []
        if isinstance(event, PeerFailed):
            return self._failed(url, entry, event.reason, now)
        return self._answered(url, entry, isinstance(event, PeerServedVerified))

    def name_of(self, url: str) -> str | None:
        """``url``'s name: as it is when known (the common case, no parsing), else normalised."""
        return url if url in self.known else _name_or_none(url)

    def _named(self, url: str, source: Source, address: str | None) -> list[PeerAction]:
        if source is Source.CLAIM:
            return []  # nobody vouched for it: not worth a slot, a request or a log line
        if source is Source.REQUESTER and url in self.known:
            return []  # a known peer fetching again (every chunk served): no parsing
        try:
            name = peer_name(url)
        except MalformedPeerUrlError as exc:
            return [PeerRefused(str(url)[:80], str(exc))]
        if name in self.banned or name in {_name_or_none(m) for m in self.me}:
            return []
        if name in self.given:
            source = Source.GIVEN
        slot = address_of(name)
        if source in ON_ITS_HOST and slot is not None and slot != address_key(address):
            return []  # a name for another host than the one that asked: a third party's
        entry = self.known.get(name)
        if entry is not None:
            self._upgrade(entry, source)
            return []
        slot = slot or address_key(address)
        out: list[PeerAction] = []
        if source is not Source.GIVEN and not self._room_for_unproven(slot, out):
            return out
        if len(self.known) >= self.limits.max_peers:
            return out
        self.known[name] = PeerEntry(source, slot, checked=source in CHECKED)
        return [*out, PeerAdded(name)]

    @staticmethod
    def _upgrade(entry: PeerEntry, source: Source) -> None:
        """A known peer named again: the operator's word, or a check, counts from now on."""
        if source is Source.GIVEN:
            entry.source = Source.GIVEN
        if source in CHECKED:
            entry.checked = True

    def _room_for_unproven(self, slot: str | None, out: list[PeerAction]) -> bool:
        """A slot for one more unproven peer counted against ``slot``: free, or freed by
        dropping an unproven peer that failed (of the same address, if that one is full)."""
        unproven = self.unproven()
        if slot is not None:
            same = [u for u in unproven if self.known[u].address == slot]
            if len(same) >= self.limits.max_per_address:
                return self._displace(same, out)
        full = len(unproven) >= self.limits.max_unproven or len(self.known) >= self.limits.max_peers
        return self._displace(unproven, out) if full else True

    def _displace(self, candidates: list[str], out: list[PeerAction]) -> bool:
        failing = [u for u in candidates if self.known[u].failures > 0]
        if not failing:
            return False
        worst = max(failing, key=lambda u: self.known[u].failures)  # oldest first among equals
        out.append(self._drop(worst, "displaced while unproven and failing"))
        return True

    def _failed(self, url: str, entry: PeerEntry, reason: str, now: float) -> list[PeerAction]:
        entry.failures += 1
        entry.error = reason
        entry.retry_at = now + self.retry_delay(entry.failures)
        if entry.source is Source.GIVEN:  # never dropped: asked again after its back-off
            return [PeerDown(url, reason)] if entry.failures == 1 else []
        if entry.failures < self.limits.max_failures:
            return []
        return [self._drop(url, f"{entry.failures} failures in a row")]

    @staticmethod
    def _answered(url: str, entry: PeerEntry, served: bool) -> list[PeerAction]:
        back = entry.failures > 0 and entry.source is Source.GIVEN
        entry.failures, entry.retry_at, entry.error = 0, 0.0, ""
        entry.checked = entry.seen = True
        entry.proven = entry.proven or served
        return [PeerBack(url)] if back else []

    def _drop(self, url: str, reason: str) -> PeerDropped:
        del self.known[url]
        return PeerDropped(url, reason)

    def _ban(self, url: str, reason: str) -> list[PeerAction]:
        self.known.pop(url, None)
        if url in self.banned:
            return []
        self.banned.add(url)
        return [PeerBanned(url, reason)]


def _name_or_none(url: object) -> str | None:
    try:
        return peer_name(url)
    except MalformedPeerUrlError:
        return None
