"""Addresses in libp2p's form (multiaddrs) for what the node names otherwise: its data-plane
URL as it rides in a signed peer record (``/ip4/h/tcp/p/http``), its libp2p listen address,
and listen addresses as others should dial them. Pure string work: no libp2p import, so a node
without libp2p can still compute them.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import multiaddr


def ip_proto(host: str) -> str:
    """The multiaddr protocol naming ``host``: ip4, ip6, or dns4 for a name."""
    try:
        return "ip6" if ipaddress.ip_address(host.strip("[]")).version == 6 else "ip4"
    except ValueError:
        return "dns4"


def http_multiaddr(url: str) -> str:
    """``http://h:p`` -> ``/ip4/h/tcp/p/http`` (how a data-plane URL rides in a peer record)."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    return f"/{ip_proto(host)}/{host.strip('[]')}/tcp/{int(port)}/http"


def url_from_multiaddr(addr: str) -> str | None:
    """The inverse of :func:`http_multiaddr` (None for any other kind of address)."""
    parts = addr.split("/")
    if len(parts) < 6 or parts[3] != "tcp" or parts[5] != "http":
        return None
    if parts[1] not in ("ip4", "ip6", "dns4", "dns6") or not parts[4].isdigit():
        return None
    host = f"[{parts[2]}]" if parts[1] == "ip6" else parts[2]
    return f"http://{host}:{parts[4]}"


def default_listen(http_host: str) -> str:
    """A free TCP port on the HTTP listen host."""
    return f"/{ip_proto(http_host)}/{http_host.strip('[]')}/tcp/0"


def rehost(addrs: list[multiaddr.Multiaddr], host: str | None) -> list[multiaddr.Multiaddr]:
    """Listen addresses as others should dial them (``advertise_host`` replaces the IP)."""
    if host is None:
        return addrs
    out: list[multiaddr.Multiaddr] = []
    for addr in addrs:
        parts = str(addr).split("/")
        if len(parts) > 3 and parts[1] in ("ip4", "ip6", "dns4", "dns6"):
            parts[1], parts[2] = ip_proto(host), host.strip("[]")
        rehosted = multiaddr.Multiaddr("/".join(parts))
        if rehosted not in out:
            out.append(rehosted)
    return out


def never_dial_http(host: Any) -> None:
    """Peer records carry our HTTP URL as an address; libp2p must not try to dial it."""
    gate = host.get_network().connection_gate
    allowed = gate.is_allowed

    async def is_allowed(addr: multiaddr.Multiaddr) -> bool:
        if any(p.name == "http" for p in addr.protocols()):
            return False
        return await allowed(addr)

    gate.is_allowed = is_allowed
