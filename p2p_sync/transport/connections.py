"""Bounds on the data plane's inbound connections: how many it holds at once, in all and from
one address.

Why: a server that keeps every connection it accepts runs out of descriptors. 1,100 idle
connections against a node at the usual 1,024-descriptor limit left ``/status`` unanswered and
filled the log with "Too many open files" (76 MB in 30 s). The gate counts live connections; a
new one over ``HttpLimits.max_connections`` (never more than half the descriptor limit), or
over ``max_connections_per_address`` from its address, is refused: the server answers it 503
(a peer's client takes that as "busy, ask later") and closes it at once. Connections that send
no request, or a request header too slowly, are timed out by the server (``transport.http``),
so an idle flood frees its places within ``header_timeout_s``.

Sans-I/O: the server tells the gate of each connection made (``admit``) and lost
(``release``); the gate answers, and counts.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from p2p_sync.transport.limits import HttpLimits

try:
    import resource
except ImportError:  # not Unix: no descriptor limit to read
    resource = None  # type: ignore[assignment]

IPV6_PREFIX = 64  # an IPv6 host picks any address in its /64: one site's connections count as one


def address_key(host: str) -> str:
    """What a connection from ``host`` counts against: its IPv4 address (an IPv4-mapped IPv6
    one too), or its IPv6 /64; anything else (a Unix socket, no address) as it is."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_PREFIX), strict=False))
    return str(ip)


def descriptor_share() -> int | None:
    """Half this process's soft descriptor limit (RLIMIT_NOFILE), the share inbound
    connections may take; None where there is no limit or it is unknown."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else max(1, soft // 2)


def connection_cap(limits: HttpLimits, share: int | None = None) -> int:
    """Connections held at once: ``max_connections``, lowered to ``share`` (by default
    :func:`descriptor_share`) so that the node's own connections and files still open."""
    share = descriptor_share() if share is None else share
    return limits.max_connections if share is None else min(limits.max_connections, share)


@dataclass
class ConnectionGate:
    """Live inbound connections, in all and per address key (:func:`address_key`)."""

    total: int
    per_address: int
    held: int = 0
    refused: int = 0  # connections refused since the start
    _by_address: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, limits: HttpLimits, share: int | None = None) -> ConnectionGate:
        return cls(connection_cap(limits, share), limits.max_connections_per_address)

    def admit(self, key: str) -> str | None:
        """Count a new connection from ``key``: None when it may stay, else why it may not
        (a refused connection is not counted: the caller closes it at once)."""
        if self.held >= self.total:
            why = f"{self.held} connections held (max_connections)"
        elif self._by_address[key] >= self.per_address:
            why = f"{self._by_address[key]} held from it (max_connections_per_address)"
        else:
            self.held += 1
            self._by_address[key] += 1
            return None
        self.refused += 1
        return why

    def release(self, key: str) -> None:
        """An admitted connection from ``key`` closed."""
        self.held -= 1
        self._by_address[key] -= 1
        if self._by_address[key] <= 0:
            del self._by_address[key]

    def from_address(self, key: str) -> int:
        """Connections held from ``key`` now."""
        return self._by_address[key]
