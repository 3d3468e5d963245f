"""A virtual clock: a heap of timed callbacks, run in time order (ties in scheduling order).

Nothing here sleeps: time jumps from one event to the next, so a simulated minute of a
1,000-peer swarm costs only the events it contains.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Clock:
    """Discrete-event loop. ``at(t, fn, *args)`` runs ``fn(*args)`` when the clock reaches ``t``."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: Callable[[], bool], deadline: float, max_events: int) -> bool:
        """Run events until ``until()`` holds (True), or time/event budget runs out (False)."""
        heap, pop = self._heap, heapq.heappop
        budget = max_events
        while heap and budget > 0:
            if until():
                return True
            t, _, fn, args = heap[0]
            if t > deadline:
                break
            pop(heap)
            self.now = t
            fn(*args)
            budget -= 1
        self.events_run += max_events - budget
        return until()

    def pending(self) -> int:
        return len(self._heap)
