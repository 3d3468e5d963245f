"""TCP congestion control of the data plane's sockets, and what the host does with an idle
connection.

Why: every version starts on connections that sat idle since the last one. Linux restarts a
connection idle for longer than its retransmission timeout in slow start (10 segments, then
doubling each round trip; ``net.ipv4.tcp_slow_start_after_idle = 1``, its default), unless the
connection's congestion control paces itself: BBR resumes at the rate it measured. On a
1 Gbit/s path with a 40 ms round trip a restarted connection needs ~4 round trips to carry one
128 KiB chunk, and a pull swarm's relay hops run on such connections: simulated, 100 peers at
20 ms and 1 Gbit/s finish at 2.07x the Kumar-Ross bound instead of 1.44x (``slow_start`` in a
scenario, ``simulations/network.py``). ``[http] tcp_congestion = "bbr"`` asks for BBR on every
socket the data plane opens or accepts (allowed to root, or where the host lists it in
``net.ipv4.tcp_allowed_congestion_control``); the host-wide alternative is the sysctl above set
to 0. Nodes report what their sockets got (``/status``: ``tcp``) and say at start when idle
connections restart.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger("p2psync.tcp")

PROC = Path("/proc/sys/net/ipv4")
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)  # Linux's option number
PACED = frozenset({"bbr"})  # mainline algorithms with their own control: no idle restart


def _read(name: str) -> str | None:
    try:
        return (PROC / name).read_text().strip()
    except OSError:
        return None  # not Linux, or /proc not mounted


def available() -> frozenset[str] | None:
    """The congestion controls this host's kernel offers (None: it does not say)."""
    text = _read("tcp_available_congestion_control")
    return None if text is None else frozenset(text.split())


def apply(sock: socket.socket, name: str) -> str | None:
    """Ask for congestion control ``name`` on ``sock`` ("" leaves the host's default); returns
    the one in effect (None: the platform does not say). A refusal (an unprivileged process
    asking for one the host does not allow) leaves the default: the node carries on."""
    if name:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, name.encode())
        except OSError:
            pass  # reported through the algorithm in effect
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16)
    except OSError:
        return None
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def socket_factory(name: str) -> Callable[[tuple[Any, ...]], socket.socket]:
    """A socket factory for aiohttp's ``TCPConnector``: client sockets get ``name`` too (a
    node uploads over connections it opened: announcements, reverse channels)."""

    def make(addr_info: tuple[Any, ...]) -> socket.socket:
        family, type_, proto = addr_info[:3]
        sock = socket.socket(family=family, type=type_, proto=proto)
        apply(sock, name)
        return sock

    return make


def session(
    timeout: aiohttp.ClientTimeout,
    congestion: str,
    tls: ssl.SSLContext | None = None,
    keepalive_s: float | None = None,
) -> aiohttp.ClientSession:
    """An aiohttp client session whose sockets get ``congestion`` ("": the host's default);
    ``tls``: the context of its ``https://`` requests (a private swarm's); ``keepalive_s``:
    how long an idle connection is kept (None: aiohttp's 15 s)."""
    if not congestion and tls is None and keepalive_s is None:
        return aiohttp.ClientSession(timeout=timeout)
    factory = socket_factory(congestion) if congestion else None
    keep = {} if keepalive_s is None else {"keepalive_timeout": keepalive_s}
    connector = aiohttp.TCPConnector(
        socket_factory=factory, ssl=tls if tls is not None else True, **keep
    )
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


def report(algorithm: str | None) -> dict[str, Any]:
    """What ``/status`` says of the data plane's TCP: the congestion control its sockets got,
    and whether an idle connection restarts in slow start (None: unknown)."""
    sysctl = _read("tcp_slow_start_after_idle")
    if algorithm is None or sysctl is None:
        restarts = None
    else:
        restarts = sysctl != "0" and algorithm not in PACED
    return {"congestion": algorithm, "idle_restart": restarts}


def announce(tcp: dict[str, Any], wanted: str) -> None:
    """One start-up line from ``report``'s answer: the congestion control in effect, and what
    to change where idle connections restart in slow start (fast, long paths only)."""
    algorithm = tcp["congestion"]
    if wanted and algorithm != wanted:
        log.warning(
            "tcp_congestion = %r refused (not allowed to this process?): sockets use %s",
            wanted,
            algorithm,
        )
    if tcp["idle_restart"]:
        log.info(
            "TCP %s restarts idle connections in slow start "
            "(net.ipv4.tcp_slow_start_after_idle = 1): on fast, long links set "
            '[http] tcp_congestion = "bbr" or that sysctl to 0 (README: Fast, long links)',
            algorithm,
        )
