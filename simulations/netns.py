"""A shaped LAN of Linux network namespaces, for running real nodes over emulated links.

Why namespaces: the emulated tier of issue 6 runs real node processes over links slower than
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
between the ports (by the hosts' fixed MACs), each frame ``delay_ms`` after it arrived.

The test process stays in the root namespace and reaches a host through ``Topology.call``:
a worker thread that has entered that host's namespace (``setns``) opens the sockets, so control
traffic (e.g. GET /status) goes over the host's own loopback and never competes with the
shaped data plane. Child processes run inside a host with ``Topology.exec_argv(host) + argv``.

Cleanup: ``Topology`` is a context manager whose exit kills what still runs in its namespaces
and deletes them, whatever happened inside. Namespace names carry the creating pid, so
``cleanup_stale()`` can remove what a killed run left behind without touching a live run's.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 ``ip`` and ``tc``, and the tbf qdisc.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import secrets
import select
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

from p2p_sync.errors import NetnsError  # noqa: F401 (re-exported)

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

    def shape_of(self, index: int) -> LinkShape:
        return self.shapes[index] if index < len(self.shapes) else self.shape


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address, MAC (of its eth0) and link shape."""

    index: int
    ns: str
    ip: str
    shape: LinkShape
    mac: str


def mac_of(index: int) -> str:
    """Host ``index``'s MAC: locally administered, unicast, ``02:00:00:00:xx:yy`` = index + 1."""
    n = index + 1
    return f"02:00:00:00:{n >> 8:02x}:{n & 0xFF:02x}"


def _run(argv: list[str], timeout: float) -> str:
    """Run one ip/tc command; a failure raises NetnsError naming the command, in one line."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
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


def probe() -> str | None:
    """What this machine lacks to build a topology (root, iproute2, netns/veth/tbf in its
    kernel), or None when it can (creates and deletes a namespace with a tbf-shaped veth).
    Raises :class:`NetnsError` when the probe fails for any other reason."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    ns = f"{PREFIX_ROOT}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", ns], 15.0)
        veth = ["link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"]
        _run(["ip", "-n", ns, *veth], 15.0)
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                "pa",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "16kb",
                "latency",
                "20ms",
            ],
            15.0,
        )
    except NetnsError as exc:
        if not any(part in str(exc) for part in _ABSENT):
            raise
        return f"this machine lacks a part: {exc}"
    finally:
        try:
            delete_namespace(ns)
        except NetnsError:
            pass
    return None


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


@dataclass
class Topology:
    """N host namespaces on one bridge (or behind the delay line, with ``delay_ms``), each link
    shaped with tbf. Use as a context manager."""

    cfg: TopologyConfig = field(default_factory=TopologyConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.cfg.hosts <= self.cfg.max_hosts:
            raise ValueError(f"hosts must be 1..{self.cfg.max_hosts}, not {self.cfg.hosts}")
        self.prefix = self.cfg.prefix or f"{PREFIX_ROOT}{os.getpid()}-{secrets.token_hex(3)}"
        subnet = self.cfg.subnet or f"10.{64 + secrets.randbelow(187)}.{1 + secrets.randbelow(250)}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [
            Host(i, f"{self.prefix}-h{i}", f"{subnet}.{i + 1}", self.cfg.shape_of(i), mac_of(i))
            for i in range(self.cfg.hosts)
        ]
        if not 0 <= self.cfg.delay_ms <= 60_000:
            raise ValueError(f"delay_ms must be within 0..60000, not {self.cfg.delay_ms}")
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
        """Create the switch namespace with its bridge (none with a delay), then each host and
        its shaped link; with a delay, start the delay line on the ports last."""
        self._add_ns(self.switch)
        if not self.cfg.delay_ms:
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
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
        ports = [arg for h in self.hosts for arg in ("--port", f"b{h.index}={h.mac}")]
        return [
            *_exec_prefix(self.switch),
            sys.executable,
            "-m",
            "simulations.delayline",
            "--delay-ms",
            repr(float(self.cfg.delay_ms)),
            *ports,
        ]

    def _add_host(self, host: Host) -> None:
        port = f"b{host.index}"
        self._add_ns(host.ns)
        # both ends are created directly inside their namespaces: never in the root namespace
        self._ip(
            "link",
            "add",
            "name",
            "eth0",
            "address",
            host.mac,
            "netns",
            host.ns,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.switch,
        )
        self._ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        self._ip("-n", host.ns, "link", "set", "eth0", "up")
        self._add_port(port)
        self._tbf(host.ns, "eth0", host.shape.mbps, host.shape)  # uplink
        self._tbf(self.switch, port, host.shape.down, host.shape)  # downlink

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
        return [self.switch, *(h.ns for h in self.hosts)]

    # ------------------------------------------------------------ running things inside

    def exec_argv(self, host: Host) -> list[str]:
        """Prefix that runs a command inside ``host``: ``exec_argv(h) + ["python", ...]``."""
        return _exec_prefix(host.ns)

    def run(self, host: Host, argv: list[str], timeout: float = 30.0) -> str:
        """Run a command inside ``host`` and return its stdout (NetnsError on failure)."""
        return _run(self.exec_argv(host) + argv, timeout)

    def call(self, host: Host, fn: Callable[..., T], *args: Any, timeout: float = 30.0) -> T:
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
