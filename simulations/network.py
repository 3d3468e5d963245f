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
its flows that can still grow (a plain ``min(uplink / uploads, downlink / downloads)`` would
leave that share idle, and a swarm's random imbalance of the two counts is large).

Levels are recomputed for the two links a transfer starts or ends at (events come every
millisecond or so at each link of a busy swarm, so the levels track the exact max-min
allocation closely; a transfer that ends and those its callback starts, a slot's next chunk,
are re-rated together, so the other flows do not speed up and slow down again at once: a
third of the rate changes and heap entries of a 1 Gbit/s swarm), and a rate is never raised
beyond the room left at either end, so no link ever carries more than its capacity: decreases
are applied before increases, and a flow that finds no room at once gets it at the next event
of either of its links.

Latency is not modelled here: the swarm simulation adds the one-way delay to every message
and to the last byte of every transfer.

**TCP slow start** (``slow_start=True``; off, every connection is warm, as on hosts with
``net.ipv4.tcp_slow_start_after_idle = 0`` in a long-lived swarm): Linux restarts a connection
that sent nothing for longer than its retransmission timeout (``RTO``, ~200 ms + the round trip)
with a smaller congestion window, halved once per ``RTO`` of idleness down to the initial window
of 10 segments (``tcp_cwnd_restart``), and a new connection starts there. A sender then moves at
most a window per round trip, and the window grows by what was acknowledged: it doubles each
round trip while it is what limits the flow. Concurrent requests between two nodes go over
separate pooled connections, each with its own window. Here every ordered pair of nodes has one
aggregate window (``Window``: the sum over its connections): a transfer that finds all of the
pair's connections busy opens another, which adds an initial window; the pair's transfers share
``window / rtt`` equally, and the window grows, once a round trip while a transfer runs, by the
bytes the pair moved in the round trip before (every connection doubles). Once ``window / rtt``
is above both links' capacity it no longer binds and the pair stops ticking. Versions are a
training step apart, longer than any RTO: each starts with every idle connection restarted
(``idle_restart``). Not modelled: the ssthresh a restart keeps (above 3/4 of the old window
Linux grows one segment a round trip) and CUBIC's HyStart leaving slow start early on a
growing delay, so this is optimistic (docs/decisions: TCP slow start after idle); pacing, loss.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from math import inf

from simulations.clock import Clock, Entry

INITIAL_WINDOW = 10 * 1448  # bytes: Linux's initial window of 10 segments (RFC 6928)
RTO_MIN = 0.2  # s: Linux's lowest retransmission timeout; the timeout is ~this + the round trip


@dataclass(eq=False)  # identity, not value: transfers are dict keys
class Transfer:
    src: int
    dst: int
    remaining: float
    on_done: Callable[[], None]
    rate: float = 0.0
    since: float = 0.0
    event: Entry | None = None  # its pending finish
    sent: float = 0.0
    cap: float = inf  # its connection's window / round trip (slow start), bytes/s


@dataclass(eq=False)
class Window:
    """One ordered pair's congestion window (``slow_start``)."""

    cwnd: float = 0.0  # bytes, over all its connections (each brings INITIAL_WINDOW)
    conns: int = 0  # connections it opened: the most transfers it ever ran at once
    last: float = -inf  # when its last transfer ended (idle since, if none runs)
    flows: dict[Transfer, None] = field(default_factory=dict)  # the transfers running on it
    moved: float = 0.0  # bytes of ended transfers (with the running ones' ``sent``: growth)
    mark: float = 0.0  # bytes moved at the last tick
    ticking: bool = False


class Network:
    """Links of every node and the transfers in progress."""

    def __init__(
        self,
        clock: Clock,
        uplink: list[float],
        downlink: list[float],
        rtt: float = 0.0,
        slow_start: bool = False,
    ) -> None:
        self.clock = clock
        self.uplink, self.downlink = uplink, downlink
        self.rtt, self.rto = rtt, RTO_MIN + rtt
        # ordered pairs' windows; none without slow start (or a zero round trip: no window binds)
        self.windows: dict[tuple[int, int], Window] | None = {} if slow_start and rtt > 0 else None
        # dicts, not sets: insertion order keeps runs reproducible (sets order by address)
        self.out: list[dict[Transfer, None]] = [{} for _ in uplink]
        self.into: list[dict[Transfer, None]] = [{} for _ in uplink]
        self.bytes_sent = [0.0] * len(uplink)
        self.bytes_received = [0.0] * len(uplink)
        self.up_level = [inf] * len(uplink)
        self.down_level = [inf] * len(uplink)
        self.up_used = [0.0] * len(uplink)  # sum of the rates leaving / entering each node
        self.down_used = [0.0] * len(uplink)
        # uplinks and downlinks to re-rate once a finished transfer's callback returns
        self._batch: tuple[dict[int, None], dict[int, None]] | None = None

    def start(self, src: int, dst: int, nbytes: float, on_done: Callable[[], None]) -> Transfer:
        t = Transfer(src, dst, float(nbytes), on_done, since=self.clock.now)
        self.out[src][t] = None
        self.into[dst][t] = None
        if self.windows is not None:
            self._open(t)
        self._rerate(src, dst)  # t's rate goes from 0 to its share: "faster", so it is armed
        return t

    # ------------------------------------------------------------ slow start

    def _open(self, t: Transfer) -> None:
        """``t`` runs on its pair's window: restarted if the pair sat idle past an RTO, one
        more connection (an initial window more) if all the pair's are busy."""
        assert self.windows is not None
        w = self.windows.setdefault((t.src, t.dst), Window())
        if not w.flows:
            idle, floor = self.clock.now - w.last, w.conns * INITIAL_WINDOW
            while idle > self.rto and w.cwnd > floor:  # Linux's tcp_cwnd_restart
                w.cwnd = max(w.cwnd / 2, floor)
                idle -= self.rto
        w.flows[t] = None
        if len(w.flows) > w.conns:
            w.conns += 1
            w.cwnd += INITIAL_WINDOW
        self._recap(t.src, t.dst, w)
        if t.cap < inf and not w.ticking:
            w.ticking, w.mark = True, self._moved(w)
            self.clock.after(self.rtt, self._tick, t.src, t.dst)

    def idle_restart(self) -> None:
        """Every idle pair as after a long pause (the next version, a training step later):
        each of its connections restarts at the initial window (no-op without slow start)."""
        for w in (self.windows or {}).values():
            if not w.flows:
                w.cwnd = w.conns * INITIAL_WINDOW

    def _recap(self, src: int, dst: int, w: Window) -> None:
        """The pair's transfers share its window: each capped at its share per round trip
        (none once the whole window outruns both links)."""
        if not w.flows:
            return
        whole = w.cwnd / self.rtt
        cap = inf if whole >= min(self.uplink[src], self.downlink[dst]) else whole / len(w.flows)
        for t in w.flows:
            t.cap = cap

    def _moved(self, w: Window) -> float:
        for t in w.flows:
            self._settle(t)
        return w.moved + sum(t.sent for t in w.flows)

    def _tick(self, src: int, dst: int) -> None:
        """A round trip on a window that binds: it grows by what the pair moved in the last
        one (acknowledged now), and its transfers may go faster."""
        assert self.windows is not None
        w = self.windows[(src, dst)]
        moved = self._moved(w)
        w.cwnd += moved - w.mark
        w.mark = moved
        self._recap(src, dst, w)
        w.ticking = any(t.cap < inf for t in w.flows)
        if w.ticking:
            self.clock.after(self.rtt, self._tick, src, dst)
        if w.flows:
            self._rerate(src, dst)

    def _close(self, t: Transfer) -> None:
        assert self.windows is not None
        w = self.windows[(t.src, t.dst)]
        if t not in w.flows:
            return
        del w.flows[t]
        w.moved += t.sent
        w.last = self.clock.now
        self._recap(t.src, t.dst, w)  # the others share what it leaves

    def progress(self, t: Transfer) -> float:
        """Bytes ``t`` has moved so far (all of them once it finished)."""
        return t.sent + min(t.rate * (self.clock.now - t.since), t.remaining)

    def uploads(self, node: int) -> list[Transfer]:
        """The transfers leaving ``node``, oldest first."""
        return list(self.out[node])

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
        if self.windows is not None:
            self._close(t)
        self._disarm(t)
        self.up_used[t.src] = max(self.up_used[t.src] - t.rate, 0.0) if self.out[t.src] else 0.0
        self.down_used[t.dst] = (
            max(self.down_used[t.dst] - t.rate, 0.0) if self.into[t.dst] else 0.0
        )
        t.rate = 0.0
        self._rerate(t.src, t.dst)

    def _settle(self, t: Transfer) -> None:
        now = self.clock.now
        if t.since == now:  # nothing moved since: every sum below would add zero
            return
        moved = t.rate * (now - t.since)
        if moved > t.remaining:
            moved = t.remaining
        t.remaining -= moved
        t.sent += moved
        t.since = now
        self.bytes_sent[t.src] += moved
        self.bytes_received[t.dst] += moved

    def _rerate(self, src: int, dst: int) -> None:
        """New levels for ``src``'s uplink and ``dst``'s downlink, then new rates for the
        transfers crossing either: all decreases first, so the increases find their room.
        While a finished transfer's callback runs, the links are only noted, and re-rated
        once it returns (a chunk that ends and the next one its slot starts move the other
        flows once, not down and up again)."""
        if self._batch is not None:
            self._batch[0][src] = self._batch[1][dst] = None
            return
        self._rerate_links((src,), (dst,))

    def _rerate_links(self, srcs: Collection[int], dsts: Collection[int]) -> None:
        up, down, out, into = self.up_level, self.down_level, self.out, self.into
        for src in srcs:
            caps = [_lower(down[t.dst], t.cap) for t in out[src]]
            up[src] = _level(self.uplink[src], caps)
        for dst in dsts:
            caps = [_lower(up[t.src], t.cap) for t in into[dst]]
            down[dst] = _level(self.downlink[dst], caps)
        flows = dict.fromkeys(t for src in srcs for t in out[src])
        flows.update(dict.fromkeys(t for dst in dsts for t in into[dst]))
        raise_: list[tuple[Transfer, float]] = []
        for t in flows:
            want = _lower(_lower(up[t.src], down[t.dst]), t.cap)
            if want < t.rate:
                self._set_rate(t, want)
            elif want > t.rate:
                raise_.append((t, want))
        uplink, downlink, up_used, down_used = (
            self.uplink,
            self.downlink,
            self.up_used,
            self.down_used,
        )
        for t, w in raise_:
            room_up = uplink[t.src] - up_used[t.src] + t.rate
            room_down = downlink[t.dst] - down_used[t.dst] + t.rate
            rate = _lower(_lower(w, room_up), room_down)
            if rate > t.rate * (1 + 1e-9):
                self._set_rate(t, rate)

    def _set_rate(self, t: Transfer, rate: float) -> None:
        """Change ``t``'s rate. A slower rate pushes its finish later: the old event is left in
        place and, when it fires early, re-arms itself (cheaper than a heap entry per change).
        A faster rate needs a new, earlier event, and the old one is cancelled."""
        self._settle(t)
        self.up_used[t.src] += rate - t.rate
        self.down_used[t.dst] += rate - t.rate
        faster = rate > t.rate
        t.rate = rate
        if faster:
            self._disarm(t)
            t.event = self.clock.at(self.clock.now + t.remaining / rate, self._finish, t)

    def _disarm(self, t: Transfer) -> None:
        """``t``'s pending finish will not come (it ended, or finishes sooner now)."""
        if t.event is not None:
            self.clock.cancel(t.event)
            t.event = None

    def _finish(self, t: Transfer) -> None:
        t.event = None
        self._settle(t)
        if t.remaining > 1e-6 * max(t.sent, 1.0):  # slowed down since this event was set
            if t.rate > 0:  # at 0 it waits for room: the raise that gives it some re-arms it
                t.event = self.clock.at(self.clock.now + t.remaining / t.rate, self._finish, t)
            return
        t.remaining = 0.0
        self._batch = batch = ({}, {})
        try:
            self._remove(t)
            t.on_done()
        finally:
            self._batch = None
        self._rerate_links(batch[0], batch[1])


def _lower(a: float, b: float) -> float:
    """``min(a, b)`` (``a`` on a tie), without the builtin's call: the model's hottest line."""
    return a if a <= b else b


def _level(capacity: float, caps: list[float]) -> float:
    """The water level at which flows capped at ``caps`` fill ``capacity`` (inf: they cannot)."""
    left, k = capacity, len(caps)
    for cap in sorted(caps):
        if cap * k >= left:
            return left / k
        left -= cap
        k -= 1
    return inf
