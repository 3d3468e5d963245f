"""The delay line's forwarding and timing (``simulations.delayline``), without root.

Its ports here are datagram socket pairs instead of AF_PACKET sockets on veths (a datagram keeps
its boundaries, like a frame): one end is the switch's port, the other the host behind it. The
delay over real namespaces is checked in ``tests/processes/test_emulated.py``.
"""

from __future__ import annotations

import errno
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from simulations.delayline import VNET_HDR_LEN, DelayLine, Port, parse_port

MACS = [bytes.fromhex(f"0200000000{i + 1:02x}") for i in range(3)]
VNET = bytes(VNET_HDR_LEN)  # a virtio_net_hdr of a plain frame: all zero


def frame(dst: bytes, src: bytes, payload: bytes = b"x" * 50) -> bytes:
    return VNET + dst + src + b"\x08\x00" + payload


@pytest.fixture()
def wired() -> Iterator[tuple[DelayLine, list[socket.socket]]]:
    """A 3-port delay line (50 ms) and the host end of each port."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in MACS]
    for port_end, host_end in pairs:
        port_end.setblocking(False)
        host_end.setblocking(False)
    ports = [Port(f"b{i}", mac) for i, mac in enumerate(MACS)]
    yield DelayLine(ports, [p for p, _ in pairs], 0.05), [h for _, h in pairs]
    for pair in pairs:
        for s in pair:
            s.close()


def received(host: socket.socket) -> list[bytes]:
    out = []
    for _ in range(100):
        try:
            out.append(host.recv(1 << 17))
        except BlockingIOError:
            break
    return out


def test_unicast_goes_to_its_port_only_after_the_delay(wired) -> None:
    line, hosts = wired
    sent = frame(MACS[2], MACS[0])
    hosts[0].send(sent)
    t0 = time.monotonic()
    line.receive(line.socks[0])
    due = line.queue[0][0]
    assert t0 + 0.05 <= due <= time.monotonic() + 0.05
    line.flush(due - 1e-3)  # not yet
    assert [received(h) for h in hosts] == [[], [], []]
    line.flush(due)
    assert [received(h) for h in hosts] == [[], [], [sent]]  # vnet header passed through
    assert (line.counters.frames, line.counters.sent, line.counters.drops) == (1, 1, 0)
    assert line.counters.bytes == len(sent) - VNET_HDR_LEN


@pytest.mark.parametrize(
    "dst",
    [b"\xff" * 6, bytes.fromhex("333300000001"), bytes.fromhex("0200000000ff")],
    ids=["broadcast", "multicast", "unknown"],
)
def test_group_and_unknown_destinations_go_to_every_other_port(wired, dst: bytes) -> None:
    line, hosts = wired
    sent = frame(dst, MACS[1])
    hosts[1].send(sent)
    line.receive(line.socks[1])
    line.flush(line.queue[0][0])
    assert [received(h) for h in hosts] == [[sent], [], [sent]]


def test_frames_leave_in_arrival_order_and_a_frame_for_its_own_port_is_dropped(wired) -> None:
    line, hosts = wired
    frames = [frame(MACS[1], MACS[0], bytes([i]) * 60) for i in range(5)]
    for f in frames:
        hosts[0].send(f)
    hosts[2].send(frame(MACS[2], MACS[2]))  # addressed to the host it came from
    line.receive(line.socks[0])
    line.receive(line.socks[2])
    line.flush(time.monotonic() + 1)
    assert received(hosts[1]) == frames
    assert received(hosts[2]) == [] and received(hosts[0]) == []
    assert line.timeout(time.monotonic()) is None  # nothing in flight


def test_a_full_port_queue_drops_the_frame_and_counts_it(wired) -> None:
    line, hosts = wired
    big = frame(MACS[1], MACS[0], b"y" * 60_000)
    line.queue.extend((0.0, (line.socks[1],), big) for _ in range(200))  # 12 MB, due now
    line.flush(time.monotonic())  # the host end reads nothing: its buffer fills, sends fail
    c = line.counters
    assert c.drops > 0 and c.sent + c.drops == 200 and not line.queue
    assert len(received(hosts[1])) == c.sent


class GonePort:
    """A port whose interface was deleted: every call fails as AF_PACKET then does."""

    def recv(self, size: int) -> bytes:
        raise OSError(errno.ENETDOWN, "Network is down")

    send = recv


def test_a_port_that_went_away_drops_its_frames_without_stopping_the_line(wired) -> None:
    line, hosts = wired
    gone = GonePort()
    line.receive(gone)
    sent = frame(MACS[1], MACS[0])
    line.queue.extend([(0.0, (gone,), sent), (0.0, (line.socks[1],), sent)])
    line.flush(time.monotonic())
    assert received(hosts[1]) == [sent]
    assert (line.counters.sent, line.counters.drops) == (1, 1)


def test_a_cut_port_loses_every_frame_both_ways_until_joined_again(wired) -> None:
    """SIGUSR1 cuts b1's host off: what it sends, what is sent to it, and what was on its way
    to it when the cut began are dropped; SIGUSR2 joins it again. Other ports carry on."""
    line, hosts = wired
    line.cuttable = frozenset({"b1"})
    to_1, from_1, to_2 = frame(MACS[1], MACS[0]), frame(MACS[0], MACS[1]), frame(MACS[2], MACS[0])
    hosts[0].send(to_1)
    line.receive(line.socks[0])  # on its way when the cut begins
    assert not line.signalled(bytes([signal.SIGUSR1]))
    hosts[0].send(to_1)
    hosts[0].send(to_2)
    hosts[1].send(from_1)
    hosts[1].send(frame(b"\xff" * 6, MACS[1]))  # a broadcast from the cut host
    line.receive(line.socks[0])
    line.receive(line.socks[1])
    line.flush(time.monotonic() + 1)
    assert [received(h) for h in hosts] == [[], [], [to_2]]
    assert line.counters.cut == 4 and line.counters.drops == 0
    assert not line.signalled(bytes([signal.SIGUSR2]))
    hosts[0].send(to_1)
    hosts[1].send(from_1)
    line.receive(line.socks[0])
    line.receive(line.socks[1])
    line.flush(time.monotonic() + 1)
    assert [received(h) for h in hosts] == [[from_1], [to_1], []]
    assert line.signalled(bytes([signal.SIGUSR1, signal.SIGTERM]))  # cut, then told to stop


def test_cutting_a_port_it_does_not_have_is_a_usage_error() -> None:
    argv = ["--delay-ms", "20", "--port", "b0=02:00:00:00:00:01", "--cut", "b7"]
    done = subprocess.run(
        [sys.executable, "-m", "simulations.delayline", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done
    assert done.stderr.strip().splitlines()[-1].endswith("error: --cut: no port b7")


@pytest.mark.parametrize(
    "arg", ["b0", "b0=02:00:00:00:01", "=02:00:00:00:00:01", "b0=zz:00:00:00:00:01"]
)
def test_a_bad_port_is_a_one_line_usage_error(arg: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "simulations.delayline", "--delay-ms", "20", "--port", arg],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith(
        f"error: argument --port: {arg!r} is not NAME=MAC (e.g. b0=02:00:00:00:00:01)"
    )


def test_parse_port() -> None:
    assert parse_port("b12=02:00:00:00:0A:ff") == Port("b12", bytes.fromhex("020000000aff"))
