"""The bandwidth model: a fluid model of concurrent transfers over per-node links.

Every node has an uplink and a downlink capacity (bytes/s); the core between them is never the
bottleneck (true of volunteers on home links and of datacenter hosts alike). A transfer from
``src`` to ``dst`` moves at

    rate = min(uplink(src) / uploads(src), downlink(dst) / downloads(dst))

that is, each link is shared equally among the transfers crossing it (TCP's long-run fairness
among flows of one host), and a flow goes at the pace of its tighter link. Rates are
recomputed whenever a transfer starts or ends at either end. Unlike max-min fairness, share a
flow cannot use on one link is not handed to the others, so the model is slightly pessimistic
when links are uneven and exact when they are uniform (the analytic cases in the tests).

Latency is not modelled here: the swarm simulation adds the one-way delay to every message
and to the last byte of every transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from simulations.clock import Clock


@dataclass(eq=False)  # identity, not value: transfers are dict keys
class Transfer:
    src: int
    dst: int
    remaining: float
    on_done: Callable[[], None]
    rate: float = 0.0
    since: float = 0.0
    gen: int = 0
    sent: float = 0.0


class Network:
    """Links of every node and the transfers in progress."""

    def __init__(self, clock: Clock, uplink: list[float], downlink: list[float]) -> None:
        self.clock = clock
        self.uplink, self.downlink = uplink, downlink
        # dicts, not sets: insertion order keeps runs reproducible (sets order by address)
        self.out: list[dict[Transfer, None]] = [{} for _ in uplink]
        self.into: list[dict[Transfer, None]] = [{} for _ in uplink]
        self.bytes_sent = [0.0] * len(uplink)
        self.bytes_received = [0.0] * len(uplink)

    def start(self, src: int, dst: int, nbytes: float, on_done: Callable[[], None]) -> Transfer:
        t = Transfer(src, dst, float(nbytes), on_done, since=self.clock.now)
        self.out[src][t] = None
        self.into[dst][t] = None
        self._rerate(src, dst)  # t's rate goes from 0 to its share: "faster", so it is armed
        return t

    def cancel(self, t: Transfer) -> None:
        """Stop ``t`` (if still running); the bytes it moved so far stay counted."""
        if t not in self.out[t.src]:
            return
        self._settle(t)
        self._remove(t)

    def _remove(self, t: Transfer) -> None:
        self.out[t.src].pop(t, None)
        self.into[t.dst].pop(t, None)
        t.gen += 1  # its pending finish event is stale now
        self._rerate(t.src, t.dst)

    def _settle(self, t: Transfer) -> None:
        moved = min(t.rate * (self.clock.now - t.since), t.remaining)
        t.remaining -= moved
        t.sent += moved
        t.since = self.clock.now
        self.bytes_sent[t.src] += moved
        self.bytes_received[t.dst] += moved

    def _rerate(self, src: int, dst: int) -> None:
        """New shares for every transfer at ``src``'s uplink or ``dst``'s downlink.

        A transfer keeps one finish event in the clock. A slower rate pushes its finish later:
        the old event is left in place and, when it fires early, re-arms itself (cheaper than
        a heap entry per change). A faster rate needs a new, earlier event.
        """
        now, up, down, out, into = self.clock.now, self.uplink, self.downlink, self.out, self.into
        for t in (*out[src], *into[dst]):
            rate = min(up[t.src] / len(out[t.src]), down[t.dst] / len(into[t.dst]))
            if rate == t.rate:
                continue
            faster = rate > t.rate
            self._settle(t)
            t.rate = rate
            if faster:
                t.gen += 1
                self.clock.at(now + t.remaining / rate, self._finish, t, t.gen)

    def _finish(self, t: Transfer, gen: int) -> None:
        if gen != t.gen:
            return
        self._settle(t)
        if t.remaining > 1e-6 * max(t.sent, 1.0):  # slowed down since this event was set
            self.clock.at(self.clock.now + t.remaining / t.rate, self._finish, t, gen)
            return
        t.remaining = 0.0
        self._remove(t)
        t.on_done()
