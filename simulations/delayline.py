"""A userspace L2 switch that delays every frame by a fixed time: propagation delay without netem.

Why: the emulated tier (``simulations.netns``) needs a one-way delay between hosts (a WAN's
20 ms), but the kernels we run on have no netem (nor fq or etf), only rate shapers such as tbf.
So when a topology asks for a delay, this process replaces the switch namespace's bridge.

How: one ``AF_PACKET``/``SOCK_RAW`` socket per switch port (``b{i}``, the veth peer of host i's
eth0). Each socket has ``PACKET_VNET_HDR`` on, so a TSO/GSO frame of up to 64 KiB comes through
whole, preceded by a 10-byte ``virtio_net_hdr`` that is sent on unchanged (the kernel segments
it later, as it would for a bridged frame), and ``PACKET_IGNORE_OUTGOING``, so the socket does
not read back its own sends. A frame received at time t goes out at t + delay on the port that
owns its destination MAC (a static table: ``Topology`` sets every host's MAC), or on every other
port when the destination is broadcast, multicast or unknown. The delay is constant, so one FIFO
deque holds the frames in flight in due order. The port's tbf (the host's downlink) still shapes
what this process sends; when its queue is full the send fails (ENOBUFS/EAGAIN) and the frame
is dropped and counted, as a router would; so is a frame for a port that went down (a host
namespace deleted before the switch's). The loop sleeps in epoll until a frame arrives or,
through ``select`` (microseconds; epoll_wait rounds up to whole milliseconds), until the head
of the deque is due; it never sends a frame early. It runs at nice -10 (``set_nice``).

    python -m simulations.delayline --delay-ms 20 --port b0=02:00:00:00:00:01 --port b1=...

It prints ``ready`` on stdout once every port is bound, runs until SIGTERM or SIGINT, and then
prints its counters on stderr. Needs CAP_NET_RAW in the namespace that holds the ports.

Outages (``--cut NAME``, any number): SIGUSR1 cuts those ports' hosts off and SIGUSR2 joins them
again. While cut, a frame from or to such a port is dropped (counted ``cut``), also one that
was in flight when the cut began and falls due during it: a Wi-Fi or home-line blip as the
hosts see it (silence, no reset; TCP retransmits into it), whose time the emulation driver
picks (``simulations.emulated``, ``--outage-s``).
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import re
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
ETH_P_ALL = 0x0003
VNET_HDR_LEN = 10  # struct virtio_net_hdr, ahead of the Ethernet header
MAX_FRAME = VNET_HDR_LEN + 14 + 65536  # a 64 KiB GSO frame; one byte more means truncated
READS_PER_WAKE = 64  # frames read from one port per wake-up, so no port starves the others
SOCKET_BUFFER = 8 << 20  # rx: bursts while we sleep; tx: let the tbf queue, not us, drop
_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
# a port whose interface went down or away (its host's namespace is being deleted)
_GONE = (errno.ENETDOWN, errno.ENXIO, errno.ENODEV)
_DROPPED = (errno.ENOBUFS, errno.EAGAIN, *_GONE)  # a full port queue, or no port at all


@dataclass(frozen=True)
class Port:
    """A switch port: its interface and the MAC of the one host behind it."""

    name: str
    mac: bytes


@dataclass
class Counters:
    """What went through (frames and bytes as received, without the vnet header)."""

    frames: int = 0
    bytes: int = 0
    sent: int = 0  # frame copies sent (a flooded frame counts once per out port)
    drops: int = 0  # sends refused by a full port queue
    truncated: int = 0  # frames larger than MAX_FRAME (dropped)
    rx_dropped: int = 0  # frames the kernel dropped because our receive buffer was full
    cut: int = 0  # frames (and flooded copies) dropped at a port that was cut off
    wakeups: int = 0  # turns of the event loop

    def line(self) -> str:
        return "delayline: " + " ".join(f"{k}={v}" for k, v in vars(self).items())


def parse_port(text: str) -> Port:
    """``NAME=MAC`` (argparse type): ``b0=02:00:00:00:00:01``."""
    name, sep, mac = text.partition("=")
    if not sep or not name or len(name) > 15 or not _MAC.match(mac):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=MAC (e.g. b0=02:00:00:00:00:01)")
    return Port(name, bytes.fromhex(mac.replace(":", "")))


def open_port(name: str) -> socket.socket:
    """A non-blocking raw socket on interface ``name`` carrying whole GSO frames."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # receives nothing until bound
    try:
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        for opt, forced in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):
            try:
                sock.setsockopt(socket.SOL_SOCKET, forced, SOCKET_BUFFER)  # *BUFFORCE (root)
            except PermissionError:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        sock.bind((name, ETH_P_ALL))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def rx_dropped(sock: socket.socket) -> int:
    """Frames the kernel dropped on this socket (PACKET_STATISTICS; reading resets it)."""
    _, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return drops


@dataclass
class DelayLine:
    """The switch: forwarding table, frames in flight, counters; socks[i] serves ports[i]."""

    ports: list[Port]
    socks: list[socket.socket]
    delay_s: float
    counters: Counters = field(default_factory=Counters)
    cuttable: frozenset[str] = frozenset()  # ports ``cut_off`` cuts (``--cut``)

    def __post_init__(self) -> None:
        self.table = {p.mac: s for p, s in zip(self.ports, self.socks, strict=True)}
        self.flood = {s.fileno(): tuple(o for o in self.socks if o is not s) for s in self.socks}
        self.by_fd = {s.fileno(): s for s in self.socks}
        self.cut: frozenset[socket.socket] = frozenset()  # ports cut off now
        # (due time, out sockets, frame); due times never decrease, so the head is next
        self.queue: collections.deque[tuple[float, tuple[socket.socket, ...], bytes]] = (
            collections.deque()
        )

    def route(self, ingress: socket.socket, frame: bytes) -> tuple[socket.socket, ...]:
        """Out sockets of ``frame``: its destination's port, or every other port."""
        dst = frame[VNET_HDR_LEN : VNET_HDR_LEN + 6]
        out = self.table.get(dst) if not dst[0] & 1 else None  # bit 0: group address
        if out is None:
            return self.flood[ingress.fileno()]
        return () if out is ingress else (out,)

    def receive(self, sock: socket.socket) -> None:
        """Queue what ``sock`` holds (at most READS_PER_WAKE frames), each due ``delay_s``
        after it was read: never early, and due times stay in read order."""
        c, clock, delay = self.counters, time.monotonic, self.delay_s
        for _ in range(READS_PER_WAKE):
            try:
                frame = sock.recv(MAX_FRAME + 1)
            except BlockingIOError:
                return
            except OSError as exc:  # reported once; the socket then stays quiet
                if exc.errno not in _GONE:
                    raise
                return
            if len(frame) > MAX_FRAME:
                c.truncated += 1
                continue
            if sock in self.cut:
                c.cut += 1
                continue
            c.frames += 1
            c.bytes += len(frame) - VNET_HDR_LEN
            self.queue.append((clock() + delay, self.route(sock, frame), frame))

    def flush(self, now: float) -> None:
        """Send every frame that is due; a full port queue (or a port gone) drops it."""
        queue, c = self.queue, self.counters
        while queue and queue[0][0] <= now:
            _, outs, frame = queue.popleft()
            for sock in outs:
                if sock in self.cut:
                    c.cut += 1
                    continue
                try:
                    sock.send(frame)
                    c.sent += 1
                except OSError as exc:
                    if exc.errno not in _DROPPED:
                        raise
                    c.drops += 1

    def timeout(self, now: float) -> float | None:
        """Seconds until the head is due (None: nothing queued, wait for frames)."""
        return max(0.0, self.queue[0][0] - now) if self.queue else None

    def cut_off(self, on: bool) -> None:
        """Cut the ``cuttable`` ports' hosts off (``on``), or join them again."""
        self.cut = frozenset(
            s for p, s in zip(self.ports, self.socks, strict=True) if on and p.name in self.cuttable
        )

    def signalled(self, signums: bytes) -> bool:
        """Act on the signals ``signal.set_wakeup_fd`` wrote: whether to stop."""
        for signum in signums:
            if signum in (signal.SIGUSR1, signal.SIGUSR2):
                self.cut_off(signum == signal.SIGUSR1)
            else:
                return True  # SIGTERM, SIGINT
        return False

    def run(self, wake: socket.socket) -> None:
        """Forward until SIGTERM or SIGINT reaches ``wake``; SIGUSR1 / SIGUSR2 cut the
        ``cuttable`` ports off and join them again."""
        with select.epoll() as poller:
            for fd in [*self.by_fd, wake.fileno()]:
                poller.register(fd, select.EPOLLIN)
            while True:
                self.counters.wakeups += 1
                for fd, _ in wait(poller, self.timeout(time.monotonic())):
                    if fd != wake.fileno():
                        self.receive(self.by_fd[fd])
                    elif self.signalled(wake.recv(64)):
                        return
                self.flush(time.monotonic())

    def stats(self) -> Counters:
        """The counters, with the kernel's receive-buffer drops of every port added."""
        self.counters.rx_dropped += sum(rx_dropped(s) for s in self.socks)
        return self.counters


def wait(poller: select.epoll, timeout: float | None) -> list[tuple[int, int]]:
    """``poller.poll`` with a microsecond timeout: epoll_wait counts whole milliseconds (Python
    rounds up, adding 0.5 ms per hop on average), select does not, and an epoll fd is readable
    when any of its fds is."""
    if timeout != 0.0 and not select.select([poller], [], [], timeout)[0]:
        return []
    return poller.poll(0)


def stop_on_signals() -> tuple[socket.socket, socket.socket]:
    """A socket pair whose first end turns readable on SIGTERM, SIGINT, SIGUSR1 or SIGUSR2,
    each writing its number (``signal.set_wakeup_fd``); keep both open while it matters."""
    rd, wr = socket.socketpair()
    for s in (rd, wr):
        s.setblocking(False)
    signal.set_wakeup_fd(wr.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)  # the C handler writes to wr; nothing else to do
    return rd, wr


def set_nice(nice: int) -> None:
    """Run ahead of the hosts' processes, as the kernel's bridge does (it forwards in softirq,
    before any process runs). At nice 0, on a 2-core machine busy with 8 nodes, frames waited
    in our sockets and a swarm behind a 1 ms delay line was 1.3-1.7x slower than behind the
    bridge; at -10, no slower."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        print(f"delayline: warning: cannot set nice {nice}: {exc.strerror}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m simulations.delayline", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay, >= 0")
    ap.add_argument("--port", type=parse_port, action="append", required=True, metavar="NAME=MAC")
    ap.add_argument("--nice", type=int, default=-10, help="scheduling priority (default -10)")
    ap.add_argument(
        "--cut", action="append", default=[], metavar="NAME", help="a port SIGUSR1 cuts off"
    )
    args = ap.parse_args(argv)
    unknown = set(args.cut) - {p.name for p in args.port}
    if unknown:
        ap.error(f"--cut: no port {sorted(unknown)[0]}")
    if not 0 <= args.delay_ms <= 60_000:
        ap.error(f"--delay-ms must be within 0..60000, not {args.delay_ms:g}")
    if len({p.name for p in args.port}) != len(args.port):
        ap.error("--port: an interface is given twice")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_nice(args.nice)
    wake, _wr = stop_on_signals()  # before binding: a SIGTERM right after "ready" is not lost
    socks = []
    try:
        for port in args.port:
            socks.append(open_port(port.name))
    except OSError as exc:
        print(f"delayline: error: port {port.name}: {exc.strerror}", file=sys.stderr)
        return 1
    line = DelayLine(args.port, socks, args.delay_ms / 1000, cuttable=frozenset(args.cut))
    print("ready", flush=True)
    try:
        line.run(wake)
    finally:
        print(line.stats().line(), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
