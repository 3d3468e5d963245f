"""NAT routers in the emulated tier: volunteers behind home routers or carrier NAT.

Needs root, ``ip netns`` and nftables' ``nft`` with the kernel's nf_tables nat (CI installs
nftables: ``make nftables``); elsewhere the tests that build a topology skip, naming what is
missing. The plan (addresses, MACs, the delay line's ports) and the config's checks are tested
without root. Every namespace a test creates is deleted by ``Topology``'s exit, and again by
the fixture's finalizer should that fail. Each test is bounded by its sockets' timeouts.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest

from simulations import netns
from simulations.netns import (
    Host,
    LinkShape,
    Topology,
    TopologyConfig,
    cleanup_stale,
    connect_times,
    list_namespaces,
    mac_of,
    measure_rate,
    probe_nat,
)
from tests.netnsbase import leftovers

# Shaped links and measured rates: run alone (`make test`'s serial pass), not beside other tests
pytestmark = pytest.mark.serial

# host 0 public, 1 and 2 behind router 1 (one home LAN), 3 behind router 2, 4 public
NAT = (0, 1, 1, 2)
FAIL_S = 1.0  # a connect that a real router would drop is given up after this long
PORT = 41_000  # a listening / source port the NAT tests use (nothing else runs in their hosts)


def accept_from(
    topo: Topology, src: Host, dst: Host, dst_ip: str, src_port: int = 0
) -> tuple[tuple[str, int], tuple[str, int]]:
    """``src`` connects to ``dst`` (listening at ``dst_ip``) from ``src_port`` (0: any):
    (the peer address ``dst`` accepts, ``src``'s own end)."""
    server = topo.call(dst, socket.create_server, (dst_ip, 0))
    server.settimeout(10)

    def connect() -> socket.socket:
        s = socket.socket()
        s.settimeout(10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # PORT may be bound already
        s.bind(("", src_port))
        s.connect((dst_ip, server.getsockname()[1]))
        return s

    with server, topo.call(src, connect) as client:
        conn, peer = server.accept()
        conn.close()
        return peer, client.getsockname()


def connect_fails(topo: Topology, src: Host, ip: str, port: int) -> tuple[OSError | None, float]:
    """Try a TCP connect from ``src``: (its error, None if it got through; seconds taken)."""

    def attempt() -> OSError | None:
        try:
            socket.create_connection((ip, port), timeout=FAIL_S).close()
        except OSError as exc:
            return exc
        return None

    t0 = time.monotonic()
    return topo.call(src, attempt), time.monotonic() - t0


def listen(topo: Topology, host: Host) -> socket.socket:
    """``host`` listens on PORT, every address (what a node behind a NAT would do)."""
    server = topo.call(host, socket.create_server, ("", PORT))
    server.setblocking(False)
    return server


def assert_blocked(topo: Topology, src: Host, targets: list[str], server: socket.socket) -> None:
    """Every connect from ``src`` to ``targets`` (port PORT) fails within 2 s, and the listener
    behind them never sees a connection."""
    for ip in targets:
        error, took = connect_fails(topo, src, ip, PORT)
        assert error is not None and took <= 2.0, (ip, error, took)
    with pytest.raises(BlockingIOError):
        server.accept()


# ---------------------------------------------------------------- without root


def test_the_plan_puts_nated_hosts_on_private_lans_behind_their_routers() -> None:
    topo = Topology(TopologyConfig(hosts=5, nat=NAT, subnet="10.9.8", delay_ms=20.0))
    pub, a, b, c, pub2 = topo.hosts
    assert [h.ip for h in topo.hosts] == [
        "10.9.8.1", "192.168.1.2", "192.168.1.3", "192.168.2.2", "10.9.8.5"
    ]  # fmt: skip
    # a router takes its first host's public slot, which that host leaves free
    public = ["10.9.8.1", "10.9.8.2", "10.9.8.2", "10.9.8.4", "10.9.8.5"]
    assert [h.public_ip for h in topo.hosts] == public
    assert (a.nat, c.nat, pub2.nat) == (1, 2, 0) and topo.router_of(b) is topo.routers[1]
    r1, r2 = topo.routers[1], topo.routers[2]
    assert (r1.hosts, r2.hosts, r1.ns, r2.port) == ((1, 2), (3,), f"{topo.prefix}-nat1", "r2")
    assert len({*(h.mac for h in topo.hosts), r1.mac, r2.mac}) == 7  # no MAC twice
    ports = [arg for arg in Topology._delay_line_argv(topo) if "=" in arg]
    assert ports == [f"b0={mac_of(0)}", f"b4={mac_of(4)}", f"r1={r1.mac}", f"r2={r2.mac}"]
    assert topo.namespaces()[-2:] == [r1.ns, r2.ns]


def test_without_nat_the_plan_is_unchanged() -> None:
    topo = Topology(TopologyConfig(hosts=3, subnet="10.9.8"))
    assert topo.hosts == [
        Host(i, f"{topo.prefix}-h{i}", f"10.9.8.{i + 1}", LinkShape(), mac_of(i)) for i in range(3)
    ]
    assert topo.routers == {} and all(h.public_ip == h.ip for h in topo.hosts)
    ports = [arg for arg in Topology._delay_line_argv(topo) if "=" in arg]
    assert ports == [f"b{i}={mac_of(i)}" for i in range(3)]


@pytest.mark.parametrize(
    ("nat", "message"),
    [
        ((0, -1), r"nat\[1\] must be a NAT group 0..255 \(0: public\), not -1"),
        ((256,), r"nat\[0\] must be a NAT group 0..255"),
        ((0, 0, 0, 1), r"nat has 4 entries for 3 hosts"),
    ],
)
def test_a_bad_nat_group_is_a_value_error_naming_it(nat: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(TopologyConfig(hosts=3, nat=nat))


def test_the_nat_probe_names_a_missing_nft(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "nft: not installed" in (probe_nat() or "")


@pytest.mark.parametrize(
    ("stderr", "skips"),
    [
        ("Error: Could not process rule: No such file or directory", True),  # no nf_nat
        ("Error: Could not process rule: Operation not supported", True),  # no nf_tables
        ("Error: syntax error, unexpected masquerade", False),  # our ruleset is wrong: a bug
    ],
)
def test_the_nat_probe_skips_only_for_a_missing_part(
    monkeypatch: pytest.MonkeyPatch, stderr: str, skips: bool
) -> None:
    def failing(argv: list[str], timeout: float, stdin: str | None = None) -> str:
        if "nft" in argv:  # ip works, nft fails with stderr
            raise netns.NetnsError(f"`{' '.join(argv)}` failed: {stderr}")
        return ""

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(netns, "_run", failing)
    if skips:
        assert stderr in (probe_nat() or "")
    else:
        with pytest.raises(netns.NetnsError, match="syntax error"):
            probe_nat()


# ---------------------------------------------------------------- over real namespaces


@pytest.mark.parametrize("delay_ms", [0.0, 20.0])
def test_a_nated_host_reaches_a_public_one_as_its_routers_address(
    nat_prefix: str, delay_ms: float
) -> None:
    with Topology(TopologyConfig(hosts=5, nat=NAT, delay_ms=delay_ms)) as topo:
        pub, a = topo.hosts[0], topo.hosts[1]
        peer, local = accept_from(topo, a, pub, pub.ip, src_port=PORT)
        times = connect_times(topo, a, pub, count=3)
    assert local == (a.ip, PORT)  # a knows only its private address
    assert peer == (a.public_ip, PORT)  # masquerade keeps a free source port: hole punching
    assert a.public_ip == topo.routers[1].ip != a.ip
    assert min(times) >= 2 * delay_ms / 1000, times  # one round trip, never early
    assert leftovers(nat_prefix) == []


@pytest.mark.parametrize("delay_ms", [0.0, 20.0])
def test_nothing_dials_into_a_nat(nat_prefix: str, delay_ms: float) -> None:
    with Topology(TopologyConfig(hosts=5, nat=NAT, delay_ms=delay_ms)) as topo:
        pub, a = topo.hosts[0], topo.hosts[1]
        with listen(topo, a) as server:
            # its private address has no route here; its router drops an unsolicited SYN
            assert_blocked(topo, pub, [a.ip, a.public_ip], server)
    assert leftovers(nat_prefix) == []


def test_hosts_behind_one_nat_share_a_lan(nat_prefix: str) -> None:
    with Topology(TopologyConfig(hosts=5, nat=NAT)) as topo:
        a, b = topo.hosts[1], topo.hosts[2]
        peer, _ = accept_from(topo, b, a, a.ip)
    assert peer[0] == b.ip  # directly, not through the masquerade
    assert leftovers(nat_prefix) == []


def test_hosts_behind_different_nats_cannot_reach_each_other(nat_prefix: str) -> None:
    with Topology(TopologyConfig(hosts=5, nat=NAT)) as topo:
        a, c = topo.hosts[1], topo.hosts[3]
        with listen(topo, c) as server:
            assert_blocked(topo, a, [c.ip, c.public_ip], server)
    assert leftovers(nat_prefix) == []


def test_masquerade_keeps_a_free_source_port_and_reuses_a_mapping_towards_anyone(
    nat_prefix: str,
) -> None:
    """What hole punching relies on. Linux keeps a host's source port when no connection to the
    same destination holds it already (else it picks a random one), and while a mapping's first
    connection is tracked it reuses it for the same inside address and port towards any
    destination (nf_nat's find_appropriate_src: endpoint-independent mapping, RFC 4787), so
    the port a rendezvous server sees is the one other peers must punch towards."""
    with Topology(TopologyConfig(hosts=5, nat=NAT)) as topo:
        pub, a, b = topo.hosts[:3]
        server = topo.call(pub, socket.create_server, (pub.ip, 0))
        server.settimeout(10)

        def connect() -> socket.socket:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", PORT))
            s.connect(server.getsockname())
            return s

        with server, topo.call(a, connect), topo.call(b, connect):
            peers = [server.accept()[1] for _ in range(2)]  # in connect order: a, then b
            elsewhere, _ = accept_from(topo, b, pub, pub.ip, src_port=PORT)  # another peer
    assert peers[0] == (a.public_ip, PORT)  # a's port was free: kept
    assert peers[1][0] == a.public_ip and peers[1][1] != PORT  # b's would clash: remapped
    assert elsewhere == peers[1]  # b's mapping, reused towards another peer


def test_a_simultaneous_open_punches_through_both_nats(nat_prefix: str) -> None:
    """TCP hole punching: both sides connect from PORT to the other's public PORT at once;
    each router passes the other's SYN as the reply to its own (the one that came first was
    dropped silently, so nothing refused it)."""
    with Topology(TopologyConfig(hosts=5, nat=NAT, delay_ms=5.0)) as topo:
        a, c = topo.hosts[1], topo.hosts[3]
        peers: dict[int, tuple[str, int]] = {}

        def punch(me: Host, other: Host) -> threading.Thread:
            s = socket.socket()
            s.settimeout(5)
            s.bind(("", PORT))

            def run() -> None:
                with s:
                    s.connect((other.public_ip, PORT))
                    peers[me.index] = s.getpeername()

            return threading.Thread(target=run, daemon=True)

        threads = [topo.call(a, punch, a, c), topo.call(c, punch, c, a)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert peers == {a.index: (c.public_ip, PORT), c.index: (a.public_ip, PORT)}
    assert leftovers(nat_prefix) == []


def download_mbps(topo: Topology, src: Host, dst: Host, nbytes: int) -> float:
    """``dst`` (behind a NAT) connects to ``src``, which then sends ``nbytes``: the rate on the
    wire (as ``RateSample.wire_mbps``) of ``dst``'s downlink, timed from first byte to last."""
    server = topo.call(src, socket.create_server, (src.ip, 0))
    with server, topo.call(dst, socket.create_connection, server.getsockname(), 10) as client:
        server.settimeout(10)
        conn, _ = server.accept()
        sender = threading.Thread(target=lambda: conn.sendall(b"\0" * nbytes), daemon=True)
        sender.start()
        client.settimeout(30)
        got, first = 0, 0.0
        while got < nbytes and (data := client.recv(1 << 20)):
            first = first or time.monotonic()
            got += len(data)
        seconds = time.monotonic() - first
        sender.join(10)
        conn.close()
    assert got == nbytes
    return nbytes * 8 / seconds / 1e6 * 1514 / 1448


def test_hosts_sharing_a_nat_keep_their_own_link_rates(nat_prefix: str) -> None:
    nated = LinkShape(mbps=50.0, down_mbps=30.0)
    cfg = TopologyConfig(hosts=5, nat=NAT, shapes=(LinkShape(), nated, nated))
    with Topology(cfg) as topo:
        pub, a, b, _, pub2 = topo.hosts
        # two uplinks through one router at once: its outside link is no bottleneck (~1 s each)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            flows = [
                pool.submit(measure_rate, topo, s, d, 6_000_000) for s, d in [(a, pub), (b, pub2)]
            ]
            up = [f.result(timeout=60).wire_mbps for f in flows]
        down = download_mbps(topo, pub, a, 4_000_000)  # its downlink: tbf on the router's p1
    assert all(0.8 * 50.0 <= rate <= 1.1 * 50.0 for rate in up), up
    assert 0.8 * 30.0 <= down <= 1.1 * 30.0, down
    assert leftovers(nat_prefix) == []


def test_failure_inside_and_stale_cleanup_delete_the_routers_too(nat_prefix: str) -> None:
    with pytest.raises(RuntimeError, match="forced"):
        with Topology(TopologyConfig(hosts=5, nat=NAT)) as topo:
            assert all(r.ns in list_namespaces() for r in topo.routers.values())
            raise RuntimeError("forced failure inside the topology")
    assert leftovers(nat_prefix) == []
    killed = Topology(TopologyConfig(hosts=5, nat=NAT, delay_ms=5.0))
    try:
        killed.build()  # as if its owner were SIGKILLed now: no destroy()
        assert sorted(cleanup_stale(killed.prefix, include_live=True)) == sorted(
            killed.namespaces()
        )
    finally:
        killed.destroy()
    assert leftovers(nat_prefix) == []
