"""The data plane's TCP congestion control (``transport.tcp``): asked for on the sockets a node
listens and dials on, reported in ``/status`` with whether idle connections restart in slow
start, and a refusal that leaves the host's default."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from p2p_sync.runtime.node import Node
from p2p_sync.transport import tcp
from p2p_sync.transport.limits import HttpLimits
from tests.helpers import make_node


def _host_default() -> str:
    with socket.socket() as sock:
        got = tcp.apply(sock, "")
    assert got is not None  # Linux says
    return got


async def _status(node: Node, congestion: str) -> dict:
    """The node's /status, fetched over a ``tcp.session`` asking for ``congestion``."""
    url = await node.start()
    try:
        async with tcp.session(aiohttp.ClientTimeout(total=10), congestion) as s:
            async with s.get(f"{url}/status") as resp:
                return await resp.json()
    finally:
        await node.stop()


def test_the_listening_and_dialing_sockets_get_the_configured_algorithm(
    tmp_path: Path, monkeypatch
) -> None:
    """Reno is in every Linux kernel, and root may pick it whatever the host's default:
    the listener (whose accepted connections inherit it) and the client's socket get it."""
    got: set[tuple[bool, str, str | None]] = set()  # (a listener?, asked, in effect)
    original = tcp.apply

    def apply(sock: socket.socket, name: str) -> str | None:
        listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        got.add((listening, name, effect := original(sock, name)))
        return effect

    monkeypatch.setattr(tcp, "apply", apply)
    node = make_node(tmp_path)
    node.cfg = replace(node.cfg, http=HttpLimits(tcp_congestion="reno"))
    status = asyncio.run(_status(node, "reno"))
    sysctl = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip()
    assert status["tcp"] == {"congestion": "reno", "idle_restart": sysctl != "0"}
    assert got == {(True, "reno", "reno"), (False, "reno", "reno")}  # listener, client


def test_an_algorithm_the_kernel_refuses_leaves_the_default(caplog) -> None:
    with socket.socket() as sock:
        assert tcp.apply(sock, "warp") == _host_default()
    with caplog.at_level("WARNING", logger="p2psync.tcp"):
        tcp.announce(tcp.report(_host_default()), "warp")
    assert "tcp_congestion = 'warp' refused" in caplog.text


@pytest.mark.parametrize(
    ("sysctl", "algorithm", "restarts"),
    [("1", "cubic", True), ("1", "reno", True), ("1", "bbr", False), ("0", "cubic", False)],
)
def test_idle_restart_is_the_sysctl_unless_the_algorithm_paces_itself(
    tmp_path: Path, monkeypatch, caplog, sysctl: str, algorithm: str, restarts: bool
) -> None:
    (tmp_path / "tcp_slow_start_after_idle").write_text(sysctl + "\n")
    monkeypatch.setattr(tcp, "PROC", tmp_path)
    assert tcp.report(algorithm) == {"congestion": algorithm, "idle_restart": restarts}
    with caplog.at_level("INFO", logger="p2psync.tcp"):
        tcp.announce(tcp.report(algorithm), "")
    assert ("restarts idle connections in slow start" in caplog.text) == restarts


def test_a_host_that_does_not_say_reports_unknown(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tcp, "PROC", tmp_path / "absent")
    assert tcp.report("cubic") == {"congestion": "cubic", "idle_restart": None}
    assert tcp.available() is None
