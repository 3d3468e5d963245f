"""How much the delay line (``simulations.delayline``) carries, what CPU it costs, and how exact
its delay is: N hosts each sending to the next at once (a ring: every uplink and downlink busy),
and TCP connect times (SYN -> SYN/ACK, one round trip: 2 x delay plus overhead) between two
more hosts, during the load and after it.

    python benchmarks/delayline.py --hosts 8 --mbps 100 --delay-ms 20 --mb 40

Needs root (see ``simulations.netns``). ``--delay-ms 0`` runs the kernel bridge instead.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.netns import (  # noqa: E402
    Host,
    LinkShape,
    RateSample,
    Topology,
    TopologyConfig,
    connect_times,
    measure_rate,
)


def cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``; system time includes the softirq work (tbf, veth,
    the receiving host's TCP) that the kernel does on the way out of our sends."""
    if pid is None:
        return 0.0, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def busy_cpus() -> float:
    """CPU seconds the whole machine has spent busy (all but idle and iowait), from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def ring(topo: Topology, nbytes: int, rtts: int) -> tuple[list[RateSample], float, list[float]]:
    """Every host but the last two sends ``nbytes`` to the next at once, while the last two
    time connects between them (their links idle: what is left is the delay line's own lag).
    Returns the samples, the wall time and the connect times (ms)."""
    hosts, (a, b) = topo.hosts[:-2], topo.hosts[-2:]
    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
        t0 = time.monotonic()
        futures = [
            pool.submit(measure_rate, topo, h, hosts[(h.index + 1) % len(hosts)], nbytes, 120.0)
            for h in hosts
        ]
        rtt = connect_ms(topo, a, b, rtts, until=futures[0].done)
        samples = [f.result() for f in futures]
    return samples, time.monotonic() - t0, rtt


def connect_ms(
    topo: Topology, src: Host, dst: Host, count: int, until: Callable[[], bool] | None = None
) -> list[float]:
    return [t * 1000 for t in connect_times(topo, src, dst, count, until)]


def summary(rtt: list[float]) -> str:
    if not rtt:
        return "no sample"
    return (
        f"min {min(rtt):.2f}, median {statistics.median(rtt):.2f}, max {max(rtt):.2f} ms "
        f"over {len(rtt)}"
    )


def report(topo: Topology, args: argparse.Namespace) -> None:
    pid = topo.delay_line.pid if topo.delay_line else None
    user0, sys0 = cpu_seconds(pid)
    machine0 = busy_cpus()
    samples, wall, busy = ring(topo, int(args.mb * 1e6), args.rtts)
    user1, sys1 = cpu_seconds(pid)
    machine = (busy_cpus() - machine0) / wall
    wire = [s.wire_mbps for s in samples]
    print(
        f"{args.hosts} flows at {args.mbps:g} Mbit/s, delay {args.delay_ms:g} ms: aggregate "
        f"{sum(wire):.0f} of {args.hosts * args.mbps:g} Mbit/s on the wire (per flow "
        f"{min(wire):.1f}..{max(wire):.1f}) over {wall:.1f} s; delay line CPU "
        f"{(user1 - user0) / wall:.0%} user + {(sys1 - sys0) / wall:.0%} system; machine "
        f"{machine:.2f} of {os.cpu_count()} CPUs busy"
    )
    idle = connect_ms(topo, topo.hosts[-2], topo.hosts[-1], args.rtts)
    print(f"connect = 1 RTT ({2 * args.delay_ms:g} ms asked), idle: {summary(idle)}")
    print(f"connect = 1 RTT, while the flows run (idle links): {summary(busy)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--mbps", type=float, default=100.0)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--mb", type=float, default=40.0, help="MB each host sends")
    ap.add_argument("--rtts", type=int, default=50)
    args = ap.parse_args()
    shape = LinkShape(args.mbps)
    cfg = TopologyConfig(hosts=args.hosts + 2, shape=shape, delay_ms=args.delay_ms)
    with Topology(cfg) as topo:
        report(topo, args)
    if topo.delay_line_exit:
        print(topo.delay_line_exit[1].strip())


if __name__ == "__main__":
    main()
