"""A shaped LAN of Linux network namespaces, for running real nodes over emulated links.

Why namespaces: the emulated tier runs real node processes over links slower than
loopback, so the swarm's scheduling meets real TCP, queueing and bandwidth limits. netem is not
available on our machines, but ``tc tbf`` (a token bucket) is: it caps a link's rate, which is
what the Kumar-Ross lower bound is about. A propagation delay (``TopologyConfig.delay_ms``) comes
from ``simulations.delayline``, a userspace switch that holds every frame for that long; it then
replaces the bridge (netem would do it in the kernel, but we have none).

Layout (every object lives inside a namespace this module creates, so nothing touches the
host's own interfaces, addresses or routes, and deleting the namespaces deletes everything)::

    <prefix>-sw  : bridge br0, ports b0..b{N-1}    (tbf on b{i}: host i's downlink)
    <prefix>-h{i}: eth0 = veth peer of b{i}, IP <subnet>.{i+1}/24 (tbf on eth0: its uplink),
                   MAC 02:00:00:00:xx:yy (xx:yy = i+1)

With ``delay_ms > 0`` there is no br0: the delay line, a process in ``<prefix>-sw``, forwards
between the ports (by the hosts' and routers' fixed MACs), each frame ``delay_ms`` after it arrived.

NAT (``TopologyConfig.nat``: volunteers behind home routers or carrier NAT). Host i with
``nat[i] = k > 0`` sits behind NAT router k, shared by every host of group k (one home LAN)::

    <prefix>-nat{k}: wan0 = veth peer of switch port r{k}, joined like a host's (bridge or
                     delay line), IP <subnet>.{j+1}/24 (j: its first host, whose public address
                     it takes), MAC 02:00:00:01:xx:yy (xx:yy = k); no tbf: unshaped, so hosts
                     sharing a router keep their own rates, as public hosts do
                     lan0 = bridge 192.168.{k}.1/24, ports p{i} (tbf on p{i}: host i's downlink)
                     ip_forward=1; nftables: masquerade out of wan0; from wan0 only
                     established/related pass (forward and input): nothing dials in, and an
                     unsolicited SYN is dropped silently (no RST), as home routers do
    <prefix>-h{i}:   eth0 = veth peer of p{i}, IP 192.168.{k}.{n+2}/24 (n: its place in the
                     group), default route via .1 (tbf on eth0: its uplink)

Public hosts get no route to 192.168.x: as on the internet, they cannot reach a NATed host's
private address, only answer connections it opened (``Host.public_ip`` is what they see).
Hosts on one LAN reach each other directly (private addresses, no NAT), still through their own
tbfs: a home LAN is no faster than its members' links. Masquerade keeps a free source port and
reuses a mapping towards any destination (endpoint-independent mapping) while its conntrack
entry lives, and filters by endpoint, so a TCP simultaneous open (hole punch) gets through.

The test process stays in the root namespace and reaches a host through ``Topology.call``:
a worker thread that has entered that host's namespace (``setns``) opens the sockets, so control
traffic (e.g. GET /status) goes over the host's own loopback and never competes with the
shaped data plane. Child processes run inside a host with ``Topology.exec_argv(host) + argv``.

Cleanup: ``Topology`` is a context manager whose exit kills what still runs in its namespaces
and deletes them, whatever happened inside. Namespace names carry the creating pid, so
``cleanup_stale()`` can remove what a killed run left behind without touching a live run's.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 ``ip`` and ``tc``, and the tbf qdisc.
NAT also needs nftables' ``nft`` and the kernel's nf_tables nat (``probe_nat``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from simulations.errors import NetnsError  # noqa: F401 (re-exported)

T = TypeVar("T")

PREFIX_ROOT = "p2psync-emu-"  # every namespace this module creates starts with it
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"
_ROOT = Path(__file__).resolve().parents[1]  # holds the simulations package


@dataclass(frozen=True)
class LinkShape:
    """tbf settings of one host's link (uplink and downlink are shaped separately).

    ``burst_bytes`` is the token bucket: it must hold at least one MTU-sized packet plus what
    accrues in one timer tick (rate / HZ), or the link runs below its rate. ``latency_ms`` is
    tbf's ``latency``, i.e. its queue limit: the longest a packet may wait in the shaper's
    queue (too small drops TCP bursts, too large adds bufferbloat to every round trip). It is
    not a propagation delay: an idle link adds none; that is ``TopologyConfig.delay_ms``.
    """

    mbps: float = 100.0  # uplink rate, Mbit/s (10^6 bit/s, counted on Ethernet frames)
    down_mbps: float | None = None  # downlink rate; None: same as the uplink
    burst_bytes: int = 64 * 1024
    latency_ms: float = 20.0  # tbf queue limit (max queueing delay), not a propagation delay

    @property
    def down(self) -> float:
        return self.mbps if self.down_mbps is None else self.down_mbps


@dataclass(frozen=True)
class TopologyConfig:
    """What to build. ``shapes`` overrides ``shape`` per host (index i: host i)."""

    hosts: int = 8
    shape: LinkShape = LinkShape()
    shapes: tuple[LinkShape, ...] = ()
    # "10.a.b" (a /24). Topologies never share a bridge or a route, so equal subnets in
    # parallel runs are harmless; a random one just keeps logs of parallel runs apart.
    subnet: str | None = None
    prefix: str | None = None  # namespace name prefix; None: PREFIX_ROOT + pid + random
    cmd_timeout_s: float = 15.0  # one ip/tc command
    max_hosts: int = 250
    # One-way propagation delay (ms) between any two hosts, like the simulator's latency_ms: a
    # round trip takes 2 * delay_ms plus queueing. 0: a kernel bridge joins the hosts; > 0: the
    # userspace delay line (simulations.delayline) does, holding each frame delay_ms.
    delay_ms: float = 0.0
    delay_line_timeout_s: float = 15.0  # the delay line to bind its ports; then to exit
    # nat[i]: host i's NAT group; 0: public, k in 1..255: behind NAT router k (192.168.k.0/24),
    # shared by every host of group k. Hosts beyond len(nat) are public.
    nat: tuple[int, ...] = ()
    # hosts (public ones, behind the delay line) that ``Topology.cut_off`` cuts off: an outage
    cut_hosts: tuple[int, ...] = ()

    def shape_of(self, index: int) -> LinkShape:
        return self.shapes[index] if index < len(self.shapes) else self.shape

    def nat_of(self, index: int) -> int:
        return self.nat[index] if index < len(self.nat) else 0


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address, MAC (of its eth0) and link shape; behind a
    NAT (``nat > 0``), ``ip`` is its private address and ``public_ip`` its router's."""

    index: int
    ns: str
    ip: str  # its own address (private, 192.168.k.x, behind a NAT)
    shape: LinkShape
    mac: str
    nat: int = 0  # NAT group: 0 public, k > 0 behind router k
    nat_ip: str | None = None  # the NAT router's outside address; None when public

    @property
    def public_ip(self) -> str:
        """The address the outside sees: a peer's accept() reports it, and only there do
        connections this host opened come back to."""
        return self.nat_ip or self.ip


@dataclass(frozen=True)
class NatRouter:
    """Home router of NAT group ``group``: its namespace, outside address (on the public subnet,
    shared by its hosts), outside MAC, switch port, and the hosts behind it."""

    group: int
    ns: str
    ip: str  # outside (wan0), what the outside sees of every host behind it
    mac: str  # of wan0
    port: str  # its switch port
    hosts: tuple[int, ...]  # indices of the hosts behind it

    @property
    def lan(self) -> str:
        """The inside /24's first three octets; the router is .1."""
        return f"192.168.{self.group}"


def mac_of(index: int) -> str:
    """Host ``index``'s MAC: locally administered, unicast, ``02:00:00:00:xx:yy`` = index + 1."""
    n = index + 1
    return f"02:00:00:00:{n >> 8:02x}:{n & 0xFF:02x}"


def nat_mac_of(group: int, lan: bool = False) -> str:
    """NAT router ``group``'s outside MAC, ``02:00:00:01:xx:yy`` (xx:yy = group), or with
    ``lan`` its inside bridge's ``02:00:00:02:xx:yy``: apart from every ``mac_of(host)``, so
    the delay line's static table tells them apart."""
    return f"02:00:00:{2 if lan else 1:02x}:{group >> 8:02x}:{group & 0xFF:02x}"


def _run(argv: list[str], timeout: float, stdin: str | None = None) -> str:
    """Run one ip/tc/nft command; a failure raises NetnsError naming the command, in one line."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetnsError(f"{argv[0]}: not installed (needs iproute2)") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(argv)}` timed out after {timeout}s") from None
    if done.returncode != 0:
        why = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        raise NetnsError(f"`{' '.join(argv)}` failed: {why}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], 15.0)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs in ``ns`` (our node processes), so deleting it frees it."""
    try:
        pids = _run(["ip", "netns", "pids", ns], 15.0).split()
    except NetnsError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_namespace(ns: str) -> None:
    """Kill its processes and delete it; deleting a namespace deletes its veths and bridge."""
    _kill_inside(ns)
    if ns in list_namespaces():
        _run(["ip", "netns", "delete", ns], 15.0)


def _owner_alive(ns: str, prefix: str) -> bool:
    pid = ns[len(prefix) :].split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = PREFIX_ROOT, include_live: bool = False) -> list[str]:
    """Delete namespaces named ``prefix*`` whose creating process is gone (all of them when
    ``include_live``); returns their names. For leftovers of a run that was SIGKILLed."""
    gone = []
    for ns in list_namespaces():
        if ns.startswith(prefix) and (include_live or not _owner_alive(ns, PREFIX_ROOT)):
            delete_namespace(ns)
            gone.append(ns)
    return gone


def _enter_netns(ns: str) -> None:
    """Move the calling thread (only it) into namespace ``ns``."""
    fd = os.open(f"{_NETNS_DIR}/{ns}", os.O_RDONLY)
    try:
        setns = getattr(os, "setns", None)  # Python >= 3.12
        if setns is not None:
            setns(fd, _CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"setns({ns}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


# What ip/tc print when the machine lacks a part (not root, no iproute2, a kernel without
# netns, veth or tbf); any other failure of the probe is a bug, and is raised, not skipped.
_ABSENT = (
    "not installed",
    "Operation not permitted",
    "Permission denied",
    "not supported",
    "Unknown device type",
    "qdisc kind is unknown",
)


def _probe_in_scratch(steps: Callable[[str], None], absent: tuple[str, ...]) -> str | None:
    """Run ``steps(ns)`` in a namespace made for it and deleted after: None when they work, a
    reason when they fail as a machine lacking a part fails (``absent``); any other failure
    is a bug, raised."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    ns = f"{PREFIX_ROOT}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", ns], 15.0)
        steps(ns)
    except NetnsError as exc:
        if not any(part in str(exc) for part in absent):
            raise
        return f"this machine lacks a part: {exc}"
    finally:
        try:
            delete_namespace(ns)
        except NetnsError:
            pass
    return None


def probe() -> str | None:
    """What this machine lacks to build a topology (root, iproute2, netns/veth/tbf in its
    kernel), or None when it can (creates and deletes a namespace with a tbf-shaped veth).
    Raises :class:`NetnsError` when the probe fails for any other reason."""

    def steps(ns: str) -> None:
        veth = ["link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"]
        _run(["ip", "-n", ns, *veth], 15.0)
        tbf = ["tbf", "rate", "1mbit", "burst", "16kb", "latency", "20ms"]
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", *tbf], 15.0)

    return _probe_in_scratch(steps, _ABSENT)


# A home router's firewall (loaded into a NAT router's namespace with ``nft -f -``): its hosts'
# connections leave masqueraded as wan0's address; from outside only replies come in. Input
# drops too, silently: a SYN to the router's own address gets no RST, so a TCP hole punch whose
# SYN arrives before the other side's has opened the mapping is lost, not refused.
NAT_RULESET = """
table ip p2psync_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade
    }
    chain forward {
        type filter hook forward priority filter; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state established,related accept
        iifname "wan0" drop
    }
}
"""
# What nft prints when the kernel lacks nf_tables or its nat/conntrack parts (or we lack the
# capability); anything else (a syntax error: our own bug) is raised by probe_nat.
_NFT_ABSENT = (*_ABSENT, "No such file or directory")


def probe_nat() -> str | None:
    """What this machine lacks to build NAT routers (root, ``nft``, nf_tables nat in its kernel),
    or None when it can: loads the routers' own ruleset into a scratch namespace. Asked only
    when a test needs NAT, so machines without nftables still run the rest of the tier."""
    if shutil.which("nft") is None and os.geteuid() == 0:
        return "nft: not installed (needs nftables: apt-get install nftables)"

    def steps(ns: str) -> None:
        _run([*_exec_prefix(ns), "nft", "-f", "-"], 15.0, stdin=NAT_RULESET)

    return _probe_in_scratch(steps, _NFT_ABSENT)


def _set_sysctl(ns: str, key: str, value: str, timeout: float) -> None:
    """Write sysctl ``key`` (e.g. ``net/ipv4/ip_forward``) inside ``ns``, from a thread that
    entered it: /proc/sys/net belongs to the opener's namespace, and no procps is needed."""

    def write() -> None:
        _enter_netns(ns)
        Path("/proc/sys", key).write_text(value)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the thread ends with its namespace
        pool.submit(write).result(timeout=timeout)


def _exec_prefix(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


# ---------------------------------------------------------------- the delay line's process


def _spawn_delay_line(argv: list[str]) -> subprocess.Popen[bytes]:
    """Start ``simulations.delayline`` (argv: the full command); it imports from this tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        argv,
        cwd=_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # stopped by Topology.destroy, not by a ^C meant for us
    )


def _await_ready(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for the ``ready`` line; NetnsError if it dies, says something else or is late."""
    assert proc.stdout is not None
    deadline, out = time.monotonic() + timeout, b""
    for _ in range(64):  # "ready\n" takes one read or a few
        if out.endswith(b"\n"):
            break
        left = deadline - time.monotonic()
        readable = select.select([proc.stdout], [], [], max(0.0, left))[0]
        if not readable:
            raise NetnsError(f"the delay line did not get ready within {timeout:g}s")
        chunk = os.read(proc.stdout.fileno(), 64)
        if not chunk:
            raise NetnsError("the delay line exited on start")
        out += chunk
    if out != b"ready\n":
        raise NetnsError(f"the delay line said {out[:80]!r} instead of ready")


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, str]:
    """SIGTERM, then SIGKILL after ``timeout``; returns (exit status, its stderr)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode(errors="replace")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def _check_nat(cfg: TopologyConfig) -> None:
    """ValueError naming the entry when ``cfg.nat`` is not a list of groups, one per host."""
    if len(cfg.nat) > cfg.hosts:
        raise ValueError(f"nat has {len(cfg.nat)} entries for {cfg.hosts} hosts")
    for i, group in enumerate(cfg.nat):
        if not isinstance(group, int) or not 0 <= group <= 255:
            raise ValueError(f"nat[{i}] must be a NAT group 0..255 (0: public), not {group!r}")


def _routers(cfg: TopologyConfig, prefix: str, subnet: str) -> dict[int, NatRouter]:
    """One router per NAT group in use; it takes its first host's public address slot
    (``<subnet>.{j+1}``), which that host, being behind it, leaves free: no collisions."""
    members: dict[int, list[int]] = {}
    for i in range(cfg.hosts):
        if cfg.nat_of(i):
            members.setdefault(cfg.nat_of(i), []).append(i)
    return {
        k: NatRouter(
            k, f"{prefix}-nat{k}", f"{subnet}.{idx[0] + 1}", nat_mac_of(k), f"r{k}", tuple(idx)
        )
        for k, idx in sorted(members.items())
    }


def _host(
    cfg: TopologyConfig, i: int, prefix: str, subnet: str, routers: dict[int, NatRouter]
) -> Host:
    """Host ``i``: public at ``<subnet>.{i+1}``, or behind its group's router at
    ``192.168.k.{n+2}`` (n: its place among the router's hosts; .1 is the router)."""
    ns, shape, group = f"{prefix}-h{i}", cfg.shape_of(i), cfg.nat_of(i)
    if not group:
        return Host(i, ns, f"{subnet}.{i + 1}", shape, mac_of(i))
    router = routers[group]
    ip = f"{router.lan}.{router.hosts.index(i) + 2}"
    return Host(i, ns, ip, shape, mac_of(i), nat=group, nat_ip=router.ip)


@dataclass
class Topology:
    """N host namespaces on one bridge (or behind the delay line, with ``delay_ms``), each link
    shaped with tbf; with ``nat``, some behind NAT routers (``routers``: group -> NatRouter).
    Use as a context manager."""

    cfg: TopologyConfig = field(default_factory=TopologyConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.cfg.hosts <= self.cfg.max_hosts:
            raise ValueError(f"hosts must be 1..{self.cfg.max_hosts}, not {self.cfg.hosts}")
        self.prefix = self.cfg.prefix or f"{PREFIX_ROOT}{os.getpid()}-{secrets.token_hex(3)}"
        subnet = self.cfg.subnet or f"10.{64 + secrets.randbelow(187)}.{1 + secrets.randbelow(250)}"
        self.switch = f"{self.prefix}-sw"
        _check_nat(self.cfg)
        self.routers = _routers(self.cfg, self.prefix, subnet)
        self.hosts = [
            _host(self.cfg, i, self.prefix, subnet, self.routers) for i in range(self.cfg.hosts)
        ]
        if not 0 <= self.cfg.delay_ms <= 60_000:
            raise ValueError(f"delay_ms must be within 0..60000, not {self.cfg.delay_ms}")
        for i in self.cfg.cut_hosts:  # the delay line holds their ports
            if not (self.cfg.delay_ms and 0 <= i < self.cfg.hosts and not self.cfg.nat_of(i)):
                raise ValueError(f"cut_hosts: host {i} is not a public host behind a delay line")
        self.delay_line: subprocess.Popen[bytes] | None = None
        # (exit status, stderr: its counters) of the delay line once stopped
        self.delay_line_exit: tuple[int, str] | None = None
        self._created: list[str] = []
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ build / destroy

    def __enter__(self) -> Topology:
        try:
            self.build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _ip(self, *args: str) -> str:
        return _run(["ip", *args], self.cfg.cmd_timeout_s)

    def _add_ns(self, ns: str) -> None:
        self._ip("netns", "add", ns)
        self._created.append(ns)
        self._ip("-n", ns, "link", "set", "lo", "up")

    def _tbf(self, ns: str, dev: str, mbps: float, shape: LinkShape) -> None:
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{mbps * 1000:.0f}kbit",
                "burst",
                str(shape.burst_bytes),
                "latency",
                f"{shape.latency_ms}ms",
            ],
            self.cfg.cmd_timeout_s,
        )

    def build(self) -> None:
        """Create the switch namespace with its bridge (none with a delay), then the NAT
        routers (their LANs must exist before their hosts join), then each host and its shaped
        link; with a delay, start the delay line on the ports last."""
        self._add_ns(self.switch)
        if not self.cfg.delay_ms:
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
        for router in self.routers.values():
            self._add_router(router)
        for host in self.hosts:
            self._add_host(host)
        if self.cfg.delay_ms:
            self._start_delay_line()

    def _start_delay_line(self) -> None:
        """Start the delay line in the switch namespace; NetnsError if it does not get ready."""
        self.delay_line = _spawn_delay_line(self._delay_line_argv())
        try:
            _await_ready(self.delay_line, self.cfg.delay_line_timeout_s)
        except NetnsError as exc:
            self._stop_delay_line()
            status, err = self.delay_line_exit or (None, "")
            raise NetnsError(f"{exc} (exit status {status}): {_last_line(err)}") from None

    def _delay_line_argv(self) -> list[str]:
        ports = [arg for h in self.hosts if not h.nat for arg in ("--port", f"b{h.index}={h.mac}")]
        ports += [arg for r in self.routers.values() for arg in ("--port", f"{r.port}={r.mac}")]
        ports += [arg for i in self.cfg.cut_hosts for arg in ("--cut", f"b{i}")]
        return [
            *_exec_prefix(self.switch),
            sys.executable,
            "-m",
            "simulations.delayline",
            "--delay-ms",
            repr(float(self.cfg.delay_ms)),
            *ports,
        ]

    def cut_off(self, on: bool) -> None:
        """Cut the ``cut_hosts`` off the network (``on``: every frame from or to them is
        lost, silently) or join them again (the delay line's SIGUSR1 / SIGUSR2)."""
        if self.delay_line is None or self.delay_line.poll() is not None:
            raise NetnsError("no delay line runs: an outage needs delay_ms > 0")
        self.delay_line.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def _veth(self, ns: str, dev: str, mac: str, peer_ns: str, peer: str) -> None:
        """A veth pair, both ends created directly inside their namespaces: never in the root
        namespace (so nothing there is touched, even for a moment)."""
        self._ip(
            "link",
            "add",
            "name",
            dev,
            "address",
            mac,
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            peer_ns,
        )

    def _add_host(self, host: Host) -> None:
        """Host namespace, eth0 (uplink tbf), and its port (downlink tbf): on the switch, or on
        its router's LAN bridge (then a default route via the router)."""
        router = self.router_of(host)
        peer_ns, port = (router.ns, f"p{host.index}") if router else (self.switch, f"b{host.index}")
        self._add_ns(host.ns)
        self._veth(host.ns, "eth0", host.mac, peer_ns, port)
        self._ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        self._ip("-n", host.ns, "link", "set", "eth0", "up")
        if router is None:
            self._add_port(port)
        else:
            self._ip("-n", peer_ns, "link", "set", port, "master", "lan0")
            self._ip("-n", peer_ns, "link", "set", port, "up")
            self._ip("-n", host.ns, "route", "add", "default", "via", f"{router.lan}.1")
        self._tbf(host.ns, "eth0", host.shape.mbps, host.shape)  # uplink
        self._tbf(peer_ns, port, host.shape.down, host.shape)  # downlink

    def _add_router(self, router: NatRouter) -> None:
        """NAT router namespace: wan0 on a switch port like a host's eth0, but unshaped (each
        host behind it is shaped on its own link, so sharing a router costs no rate), the LAN
        bridge lan0, forwarding on, and the home router's firewall (``NAT_RULESET``)."""
        self._add_ns(router.ns)
        self._veth(router.ns, "wan0", router.mac, self.switch, router.port)
        self._ip("-n", router.ns, "addr", "add", f"{router.ip}/24", "dev", "wan0")
        self._ip("-n", router.ns, "link", "set", "wan0", "up")
        self._add_port(router.port)
        lan_mac = nat_mac_of(router.group, lan=True)
        self._ip("-n", router.ns, "link", "add", "lan0", "address", lan_mac, "type", "bridge")
        self._ip("-n", router.ns, "addr", "add", f"{router.lan}.1/24", "dev", "lan0")
        self._ip("-n", router.ns, "link", "set", "lan0", "up")
        _set_sysctl(router.ns, "net/ipv4/ip_forward", "1", self.cfg.cmd_timeout_s)
        nft = [*_exec_prefix(router.ns), "nft", "-f", "-"]
        _run(nft, self.cfg.cmd_timeout_s, stdin=NAT_RULESET)

    def _add_port(self, port: str) -> None:
        """Join switch port ``port`` to the bridge, or ready it for the delay line."""
        if self.cfg.delay_ms:
            # the delay line reads every frame; the switch's own stack stays silent (no IPv6
            # link-local address, so no router solicitations or MLD reports of its own)
            self._ip("-n", self.switch, "link", "set", port, "promisc", "on", "addrgenmode", "none")
        else:
            self._ip("-n", self.switch, "link", "set", port, "master", "br0")
        self._ip("-n", self.switch, "link", "set", port, "up")

    def destroy(self) -> None:
        """Stop the worker threads, kill what runs inside, delete every namespace created.

        Safe to call twice; the first error is re-raised after trying every namespace."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        first = self._stop_delay_line()
        for ns in reversed(self._created):
            try:
                delete_namespace(ns)
            except NetnsError as exc:
                first = first or exc
        self._created.clear()
        if first is not None:
            raise first

    def _stop_delay_line(self) -> NetnsError | None:
        """Stop the delay line before its namespace goes; an error if it had crashed."""
        proc, self.delay_line = self.delay_line, None
        if proc is None:
            return None
        self.delay_line_exit = _stop(proc, self.cfg.delay_line_timeout_s)
        status, err = self.delay_line_exit
        if status > 0:  # it exited by itself, with an error (< 0: killed by a signal)
            return NetnsError(f"the delay line failed (exit status {status}): {_last_line(err)}")
        return None

    def namespaces(self) -> list[str]:
        return [self.switch, *(h.ns for h in self.hosts), *(r.ns for r in self.routers.values())]

    def router_of(self, host: Host) -> NatRouter | None:
        """The NAT router ``host`` sits behind; None for a public host."""
        return self.routers.get(host.nat)

    # ------------------------------------------------------------ running things inside

    def exec_argv(self, host: Host | NatRouter) -> list[str]:
        """Prefix that runs a command inside ``host``: ``exec_argv(h) + ["python", ...]``."""
        return _exec_prefix(host.ns)

    def run(self, host: Host | NatRouter, argv: list[str], timeout: float = 30.0) -> str:
        """Run a command inside ``host`` and return its stdout (NetnsError on failure)."""
        return _run(self.exec_argv(host) + argv, timeout)

    def call(
        self, host: Host | NatRouter, fn: Callable[..., T], *args: Any, timeout: float = 30.0
    ) -> T:
        """Call ``fn(*args)`` on a thread inside ``host``'s namespace: sockets it opens belong
        to that namespace (and stay there when used from other threads afterwards)."""
        with self._lock:
            pool = self._pools.get(host.ns)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=host.ns, initializer=_enter_netns, initargs=(host.ns,)
                )
                self._pools[host.ns] = pool
        return pool.submit(fn, *args).result(timeout=timeout)


# ---------------------------------------------------------------- shaping check


@dataclass(frozen=True)
class RateSample:
    """One measured TCP transfer between two hosts."""

    nbytes: int
    seconds: float
    configured_mbps: float  # min(sender uplink, receiver downlink)

    @property
    def goodput_mbps(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6

    @property
    def wire_mbps(self) -> float:
        """Goodput scaled to what tbf counts: 1448 B of TCP payload ride in a 1514 B frame."""
        return self.goodput_mbps * 1514 / 1448


def measure_rate(
    topo: Topology, src: Host, dst: Host, nbytes: int, timeout: float = 60.0
) -> RateSample:
    """Send ``nbytes`` over TCP from ``src`` to ``dst`` and time it at the receiver (from the
    first byte to the last, so connection set-up and the bucket's initial burst barely count)."""

    def listen() -> socket.socket:
        s = socket.socket()
        s.bind((dst.ip, 0))
        s.listen(1)
        return s

    def connect(port: int) -> socket.socket:
        return socket.create_connection((dst.ip, port), timeout=timeout)

    server = topo.call(dst, listen)
    result: dict[str, float] = {}

    def receive() -> None:
        server.settimeout(timeout)
        conn, _ = server.accept()
        conn.settimeout(timeout)
        got, first = 0, None
        with conn:
            while got < nbytes:
                data = conn.recv(1 << 20)
                if not data:
                    break
                first = first or time.monotonic()
                got += len(data)
        result.update(got=got, seconds=time.monotonic() - (first or time.monotonic()))

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    try:
        sender = topo.call(src, connect, server.getsockname()[1])
        with sender:
            block = b"\0" * (1 << 20)
            for offset in range(0, nbytes, len(block)):
                sender.sendall(block[: min(len(block), nbytes - offset)])
        receiver.join(timeout)
    finally:
        server.close()
    if result.get("got") != nbytes:
        raise NetnsError(f"rate probe {src.ip} -> {dst.ip}: got {result.get('got')} of {nbytes} B")
    return RateSample(nbytes, result["seconds"], min(src.shape.mbps, dst.shape.down))


def connect_times(
    topo: Topology, src: Host, dst: Host, count: int, until: Callable[[], bool] | None = None
) -> list[float]:
    """Up to ``count`` TCP connect times (s) from ``src`` to ``dst``: SYN out, SYN/ACK back,
    one round trip (2 x ``delay_ms`` plus queueing). One connect first, untimed, resolves
    ``dst``'s MAC (ARP). Stops early once ``until()`` is true."""
    server = topo.call(dst, socket.create_server, (dst.ip, 0))

    def once() -> float:
        t0 = time.monotonic()
        socket.create_connection(server.getsockname(), timeout=10).close()
        return time.monotonic() - t0

    with server:
        topo.call(src, once)
        return [topo.call(src, once) for _ in range(count) if until is None or not until()]
