"""The bandwidth model: a fluid model of concurrent transfers over per-node links.

Every node has an uplink and a downlink capacity (bytes/s); the core between them is never the
bottleneck (true of volunteers on home links and of datacenter hosts alike). Rates approximate
**max-min fairness**, the allocation TCP's congestion control converges to: each link has a
fair-share *level*, the water level at which its flows fill it, where a flow whose other end
allows it less than the level takes only that much::

    sum over flows f at link l of min(level(l), level(other end of f)) = capacity(l)

(a link whose flows cannot fill it has level infinity), and a flow goes at
``min(level(uplink of src), level(downlink of dst))``. So share a flow cannot use at its
tighter end is handed to the other flows at its looser end, as TCP hands a host's idle uplink to
its flows that can still grow. An earlier version of this model gave every flow
``min(uplink / uploads, downlink / downloads)`` and left that share idle: with ~15 flows per
link in a swarm, the random imbalance of the two counts cost ~25% of all upload capacity.

Levels are recomputed for the two links a transfer starts or ends at (events come every
millisecond or so at each link of a busy swarm, so the levels track the exact max-min
allocation closely), and a rate is never raised beyond the room left at either end, so no link
ever carries more than its capacity: decreases are applied before increases, and a flow that
finds no room at once gets it at the next event of either of its links.

Latency is not modelled here: the swarm simulation adds the one-way delay to every message
and to the last byte of every transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import inf

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
        self.up_level = [inf] * len(uplink)
        self.down_level = [inf] * len(uplink)
        self.up_used = [0.0] * len(uplink)  # sum of the rates leaving / entering each node
        self.down_used = [0.0] * len(uplink)

    def start(self, src: int, dst: int, nbytes: float, on_done: Callable[[], None]) -> Transfer:
        t = Transfer(src, dst, float(nbytes), on_done, since=self.clock.now)
        self.out[src][t] = None
        self.into[dst][t] = None
        self._rerate(src, dst)  # t's rate goes from 0 to its share: "faster", so it is armed
        return t

    def cancel(self, t: Transfer) -> bool:
        """Stop ``t`` if still running (True); the bytes it moved so far stay counted."""
        if t not in self.out[t.src]:
            return False
        self._settle(t)
        self._remove(t)
        return True

    def _remove(self, t: Transfer) -> None:
        self.out[t.src].pop(t, None)
        self.into[t.dst].pop(t, None)
        t.gen += 1  # its pending finish event is stale now
        self.up_used[t.src] = max(self.up_used[t.src] - t.rate, 0.0) if self.out[t.src] else 0.0
        self.down_used[t.dst] = (
            max(self.down_used[t.dst] - t.rate, 0.0) if self.into[t.dst] else 0.0
        )
        t.rate = 0.0
        self._rerate(t.src, t.dst)

    def _settle(self, t: Transfer) -> None:
        moved = min(t.rate * (self.clock.now - t.since), t.remaining)
        t.remaining -= moved
        t.sent += moved
        t.since = self.clock.now
        self.bytes_sent[t.src] += moved
        self.bytes_received[t.dst] += moved

    def _rerate(self, src: int, dst: int) -> None:
        """New levels for ``src``'s uplink and ``dst``'s downlink, then new rates for the
        transfers crossing either: all decreases first, so the increases find their room."""
        out, into = self.out[src], self.into[dst]
        self.up_level[src] = _level(self.uplink[src], [self.down_level[t.dst] for t in out])
        self.down_level[dst] = _level(self.downlink[dst], [self.up_level[t.src] for t in into])
        flows = tuple(dict.fromkeys((*out, *into)))  # a src -> dst flow is in both: once
        want = [min(self.up_level[t.src], self.down_level[t.dst]) for t in flows]
        for t, w in zip(flows, want, strict=True):
            if w < t.rate:
                self._set_rate(t, w)
        for t, w in zip(flows, want, strict=True):
            if w > t.rate:
                room_up = self.uplink[t.src] - self.up_used[t.src] + t.rate
                room_down = self.downlink[t.dst] - self.down_used[t.dst] + t.rate
                rate = min(w, room_up, room_down)
                if rate > t.rate * (1 + 1e-9):
                    self._set_rate(t, rate)

    def _set_rate(self, t: Transfer, rate: float) -> None:
        """Change ``t``'s rate. A slower rate pushes its finish later: the old event is left in
        place and, when it fires early, re-arms itself (cheaper than a heap entry per change).
        A faster rate needs a new, earlier event."""
        faster = rate > t.rate
        self._settle(t)
        self.up_used[t.src] += rate - t.rate
        self.down_used[t.dst] += rate - t.rate
        t.rate = rate
        if faster:
            t.gen += 1
            self.clock.at(self.clock.now + t.remaining / rate, self._finish, t, t.gen)

    def _finish(self, t: Transfer, gen: int) -> None:
        if gen != t.gen:
            return
        self._settle(t)
        if t.remaining > 1e-6 * max(t.sent, 1.0):  # slowed down since this event was set
            if t.rate > 0:  # at 0 it waits for room: the raise that gives it some re-arms it
                self.clock.at(self.clock.now + t.remaining / t.rate, self._finish, t, gen)
            return
        t.remaining = 0.0
        self._remove(t)
        t.on_done()


def _level(capacity: float, caps: list[float]) -> float:
    """The water level at which flows capped at ``caps`` fill ``capacity`` (inf: they cannot)."""
    left, k = capacity, len(caps)
    for cap in sorted(caps):
        if cap * k >= left:
            return left / k
        left -= cap
        k -= 1
    return inf
