"""A virtual clock: a heap of timed callbacks, run in time order (ties in scheduling order).

Nothing here sleeps: time jumps from one event to the next, so a simulated minute of a
1,000-peer swarm costs only the events it contains. An event can be cancelled (a transfer's
finish, moved earlier when its rate rises): it stays in the heap, marked, and the heap drops
the marked entries once they are a quarter of it, so they cost neither a pop nor a call
(at half, most of them were popped one by one first: twice the pops at 100 peers).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import compress
from operator import itemgetter
from typing import Any

from simulations.hugepages import HugePages

# A run allocates millions of short-lived objects (events, request keys, sets) and hardly any
# cycles (a request's run and its transfer point at each other until the transfer ends, which
# clears the link). Python's default thresholds spent ~12% of the CI scenario in the collector;
# thresholds of (100,000, 50, 100) still cost ~2% at 300 peers, and at 10,000 peers each full
# collection walks tens of millions of live objects for seconds. So the cyclic collector is
# off while events run (peak RSS the same to 0.1% at 300 peers) and back on after.
COMPACT_AT = 4_096  # a heap this long with a quarter of it cancelled is rebuilt without them

Entry = list[Any]  # [time, seq, callback or None once cancelled, args]
Until = Callable[[], bool]  # a run's stop condition
Every = Callable[[], None] | None  # a run's progress display
CALLBACK = itemgetter(2)


@contextmanager
def collector_off() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees nearly all)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class EventLoop:
    """What the clocks share (this one, and the compiled :class:`simulations.fastclock.FastClock`):
    ``after`` and ``run``; each keeps its own heap, ``at`` and loop (``_events``)."""

    now: float

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Any:
        return self.at(self.now + delay, fn, *args)

    def line(self, n: int, t: float, fn: Callable[..., Any], *args: Any) -> Any:
        """``at(t, fn, *args)`` for stream ``n`` of a few (0 and 1) whose times seldom go back:
        messages on the swarm's one latency, the windows that gather them. The order is
        ``at``'s; the compiled clock keeps such events in FIFOs beside its heap."""
        return self.at(t, fn, *args)

    def run(self, until: Until, deadline: float, max_events: int, every: Every = None) -> bool:
        """Run events until ``until()`` holds (True), or time/event budget runs out (False).

        ``every`` is called every 20,000 events (progress display). The heap is backed by
        huge pages meanwhile (:mod:`simulations.hugepages`).
        """
        with collector_off(), HugePages():
            return self._events(until, deadline, max_events, every)

    def _events(self, until: Until, deadline: float, max_events: int, every: Every) -> bool:
        raise NotImplementedError


class Clock(EventLoop):
    """Discrete-event loop. ``at(t, fn, *args)`` runs ``fn(*args)`` when the clock reaches ``t``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[Entry] = []
        self._seq = 0
        self._cancelled = 0  # marked entries still in the heap
        self.events_run = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> Entry:
        """Schedule ``fn(*args)`` at ``t`` (now, if ``t`` is past); the entry can be cancelled."""
        self._seq += 1
        entry = [t if t > self.now else self.now, self._seq, fn, args]
        heapq.heappush(self._heap, entry)
        return entry

    def cancel(self, entry: Entry) -> None:
        """The event of ``entry`` will not run (no-op if it ran or was cancelled already)."""
        if entry[2] is not None:
            entry[2] = None
            self._cancelled += 1
            if self._cancelled > COMPACT_AT and 4 * self._cancelled > len(self._heap):
                self._compact()

    def _compact(self) -> None:
        """Drop the cancelled entries (in place: the run loop holds the list). The order of
        the others is their (time, seq), so the events run exactly as before."""
        heap = self._heap
        heap[:] = compress(heap, map(CALLBACK, heap))  # a callback is truthy, a cancelled None
        heapq.heapify(self._heap)
        self._cancelled = 0

    def _events(self, until: Until, deadline: float, max_events: int, every: Every) -> bool:
        heap, pop = self._heap, heapq.heappop
        ran = 0
        try:
            while heap and ran < max_events and not until():
                entry = heap[0]
                t, _, fn, args = entry
                if t > deadline:
                    break
                pop(heap)
                if fn is None:
                    self._cancelled -= 1
                    continue
                entry[2] = None  # ran: cancelling it now is a no-op
                self.now = t
                fn(*args)
                ran += 1
                if every is not None and ran % 20_000 == 0:
                    every()
        finally:
            self.events_run += ran
        return until()
