"""The virtual clock of :mod:`simulations.clock` on the compiled heap of
:mod:`simulations.netkernels`, shared with :class:`simulations.fastnet.FastNetwork`'s finishes.

Same interface, same order: events run by (time, scheduling order), cancelled ones never. The
heap holds only each event's time and sequence number; its callback waits in a dict until it
comes up. A finish that completes a transfer hands its callback to the network. Events sent
through :meth:`FastClock.line` wait in the kernels' delay lines instead of the heap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from simulations import netkernels as k
from simulations.clock import EventLoop, Every, Until
from simulations.netkernels import push_event, push_line

FIRST_FLOWS = 1_024  # flow slots to start with; doubled whenever they run out
FIRST_HEAP = 65_536  # heap entries to start with; doubled whenever room runs short
FIRST_LINE = 1_024  # entries a delay line holds to start with; doubled whenever one fills


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
        self.adopt(k.new_state(FIRST_FLOWS, FIRST_HEAP, FIRST_LINE))
        self._waiting: dict[int, tuple[Callable[..., Any], tuple] | None] = {}
        self.network: Completions | None = None

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> int:
        """Schedule ``fn(*args)`` at ``t`` (now, if ``t`` is past); the handle can cancel it."""
        self._seq = seq = self._seq + 1
        self._waiting[seq] = (fn, args)
        if self.heap_n > self.room:
            self.make_room()
        now = self.now
        self.heap_n = push_event(self.state, t if t > now else now, seq)
        return seq

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> int:
        """``at(now + delay, ...)`` in one call: how the simulator schedules nearly always."""
        self._seq = seq = self._seq + 1
        self._waiting[seq] = (fn, args)
        if self.heap_n > self.room:
            self.make_room()
        now = self.now
        self.heap_n = push_event(self.state, now + delay if delay > 0 else now, seq)
        return seq

    def line(self, n: int, t: float, fn: Callable[..., Any], *args: Any) -> int:
        """``at(t, ...)`` through delay line ``n`` (a FIFO beside the heap, for a stream whose
        times never go back); an event earlier than the line's last still goes to the heap."""
        self._seq = seq = self._seq + 1
        self._waiting[seq] = (fn, args)
        if self.heap_n > self.room:
            self.make_room()
        now = self.now
        heap_n = push_line(self.state, n, t if t > now else now, seq)
        if heap_n == k.FULL:
            self.adopt(k.longer_lines(self.state))
            heap_n = push_line(self.state, n, t if t > now else now, seq)
        self.heap_n = heap_n
        return seq

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
        waiting, step, stopped, clock_event = self._waiting, k.step, k.STOPPED, k.CLOCK_EVENT
        network = self.network
        ran, mark = 0, 20_000 if every is not None else max_events
        try:
            while ran < max_events and not until():
                came, ident, t, moved, finishes, self._seq, self.heap_n = step(
                    self.state, deadline, self._seq
                )
                ran += finishes
                if came == clock_event:
                    self.now = t
                    item = waiting.pop(ident)
                    if item is None:  # cancelled
                        continue
                    item[0](*item[1])
                    ran += 1
                elif came == stopped:
                    break
                else:
                    self.now = t
                    assert network is not None
                    network.completed(ident, moved)
                if ran >= mark and every is not None:
                    mark += 20_000
                    every()
        finally:
            self.events_run += ran
        return until()
