"""The virtual clock of :mod:`simulations.clock` on the compiled heap of
:mod:`simulations.netkernels`, shared with :class:`simulations.fastnet.FastNetwork`'s finishes.

Same interface, same order: events run by (time, scheduling order), cancelled ones never. The
heap holds only each event's time and sequence number; its callback waits in a dict until it
comes up. A finish that completes a transfer hands its callback to the network.

Events sent through :meth:`FastClock.line` (messages one latency from now, whose times never go
back) wait in delay lines, FIFOs of (time, seq) here, not in the heap. The clock knows the
heap's first entry (every kernel that changes the heap says what it is), so an event at a
line's head runs with no call into the kernels at all; the kernels' :func:`step` stops at the
lines' first entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from math import inf
from typing import Any, Protocol

from simulations import netkernels as k
from simulations.clock import EventLoop, Every, Until
from simulations.netkernels import push_event

FIRST_FLOWS = 1_024  # flow slots to start with; doubled whenever they run out
FIRST_HEAP = 65_536  # heap entries to start with; doubled whenever room runs short
LINES = 2  # delay lines: ``line`` numbers 0 and 1
NONE = (inf, 0)  # no entry: after every other (time, seq)


class Completions(Protocol):
    """Where a completed transfer's callback runs (the network that started it)."""

    def completed(self, slot: int, moved: float) -> None: ...


class FastClock(EventLoop):
    """Discrete-event loop. ``at(t, fn, *args)`` runs ``fn(*args)`` when the clock reaches ``t``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._seq = 0
        self.events_run = 0
        self.heap_n = 0  # entries in the heap, live or not
        self.top: tuple[float, int] = NONE  # the heap's first (time, seq); a stale one is earlier
        self.adopt(k.new_state(FIRST_FLOWS, FIRST_HEAP))
        self._waiting: dict[int, tuple[Callable[..., Any], tuple] | None] = {}
        self.lines: tuple[deque[tuple[float, int]], ...] = tuple(deque() for _ in range(LINES))
        self.network: Completions | None = None

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> int:
        """Schedule ``fn(*args)`` at ``t`` (now, if ``t`` is past); the handle can cancel it."""
        self._seq = seq = self._seq + 1
        self._waiting[seq] = (fn, args)
        now = self.now
        self._push(t if t > now else now, seq)
        return seq

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> int:
        """``at(now + delay, ...)`` in one call."""
        self._seq = seq = self._seq + 1
        self._waiting[seq] = (fn, args)
        now = self.now
        self._push(now + delay if delay > 0 else now, seq)
        return seq

    def line(self, n: int, t: float, fn: Callable[..., Any], *args: Any) -> int:
        """``at(t, ...)`` through delay line ``n``; an event earlier than the line's last goes
        to the heap (the order is the same either way)."""
        self._seq = seq = self._seq + 1
        self._waiting[seq] = (fn, args)
        now = self.now
        if t < now:
            t = now
        line = self.lines[n]
        if line and line[-1][0] > t:
            self._push(t, seq)
        else:
            line.append((t, seq))
        return seq

    def _push(self, t: float, seq: int) -> None:
        if self.heap_n > self.room:
            self.make_room()
        self.heap_n = push_event(self.state, t, seq)
        if t < self.top[0]:  # (a tie in time: the earlier seq is already on top)
            self.top = (t, seq)

    def cancel(self, entry: int) -> None:
        """The event ``entry`` will not run (no-op if it ran or was cancelled already)."""
        if entry in self._waiting:
            self._waiting[entry] = None

    def adopt(self, state: tuple) -> None:
        """Run on ``state`` (grown, or given nodes), with room for the next push."""
        self.state = state
        self.room = len(state[4]) - len(state[2]) - 1  # the longest heap that leaves room
        self.make_room()

    def make_room(self) -> None:
        """Room in the heap for one push and a finish for every flow (a re-rating's most).
        Callers on the hot path test ``heap_n > room`` first (a call saved per event)."""
        heap, flows = len(self.state[4]), len(self.state[2])
        while self.heap_n + flows + 1 > heap:
            heap *= 2
        if heap > len(self.state[4]):
            self.state = k.bigger_heap(self.state, heap)
            self.room = heap - flows - 1

    def _events(self, until: Until, deadline: float, max_events: int, every: Every) -> bool:
        waiting, step, clock_event, stopped = self._waiting, k.step, k.CLOCK_EVENT, k.STOPPED
        completed, (first, second) = k.COMPLETED, self.lines
        network = self.network
        ran, mark = 0, 20_000 if every is not None else max_events
        try:
            while ran < max_events and not until():
                head, line = (first[0], first) if first else (NONE, first)
                if second and second[0] < head:
                    head, line = second[0], second
                if not head < self.top:  # the heap's first comes first, or nothing waits
                    came, ident, t, moved, finishes, self._seq, self.heap_n, self.top = step(
                        self.state, deadline, self._seq, head
                    )
                    ran += finishes
                    if came == stopped:
                        break
                    if came == completed:
                        self.now = t
                        assert network is not None
                        network.completed(ident, moved)
                        continue
                    if came == clock_event:
                        line = None
                        head = (t, ident)
                    # else finishes ran up to the line's head, which comes first now
                if line is not None:  # a delay line's head: no call into the kernels
                    if head[0] > deadline:
                        break
                    line.popleft()
                self.now = head[0]
                item = waiting.pop(head[1])
                if item is None:  # cancelled
                    continue
                item[0](*item[1])
                ran += 1
                if ran >= mark and every is not None:
                    mark += 20_000
                    every()
        finally:
            self.events_run += ran
        return until()
