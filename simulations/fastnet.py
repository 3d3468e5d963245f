"""The bandwidth model of :mod:`simulations.network`, compiled (:mod:`simulations.netkernels`).

The reference model spends half a 1,000-peer run re-rating flows in Python, and its clock's heap
fills with finish events that later rate changes cancel. Here the flows, their rates and their
finish events live in arrays that compiled code updates; the clock asks this network for its
next finish and hands it the floor when that comes first (:meth:`Clock.run` with a ``source``),
and only a finished flow's callback runs as Python. The output is the reference model's, event
for event. Slow start is not compiled: a scenario with ``slow_start`` uses the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import inf

from simulations import netkernels as k
from simulations.clock import Clock

FIRST_FLOWS = 1_024  # flow slots to start with; doubled whenever they run out


class Flow:
    """A transfer's handle: which slot it runs in, and the bytes it moved once it ended."""

    __slots__ = ("slot", "src", "dst", "on_done", "moved")

    def __init__(self, slot: int, src: int, dst: int, on_done: Callable[[], None]) -> None:
        self.slot, self.src, self.dst, self.on_done = slot, src, dst, on_done
        self.moved: float | None = None  # None while it runs


class FastNetwork:
    """:class:`simulations.network.Network`'s interface and results, without slow start."""

    def __init__(self, clock: Clock, uplink: list[float], downlink: list[float]) -> None:
        self.clock = clock
        self._state = k.new_state(uplink, downlink, FIRST_FLOWS)
        self._flows: list[Flow | None] = [None] * FIRST_FLOWS
        self._free = list(range(FIRST_FLOWS - 1, -1, -1))
        self.next_t, self.next_seq = inf, 0  # the next finish event: the clock reads it
        clock.source = self

    @property
    def bytes_sent(self) -> Sequence[float]:
        """Bytes each node sent (a view: it follows the run)."""
        return self._state[0][:, k.SENT]

    @property
    def bytes_received(self) -> Sequence[float]:
        return self._state[0][:, k.RECEIVED]

    def start(self, src: int, dst: int, nbytes: float, on_done: Callable[[], None]) -> Flow:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        flow = self._flows[slot] = Flow(slot, src, dst, on_done)
        clock = self.clock
        clock._seq, self.next_t, self.next_seq = k.start(
            self._state, slot, src, dst, float(nbytes), clock.now, clock._seq
        )
        return flow

    def cancel(self, t: Flow) -> bool:
        """Stop ``t`` if still running (True); the bytes it moved so far stay counted."""
        if t.moved is not None:
            return False
        clock = self.clock
        t.moved, clock._seq, self.next_t, self.next_seq = k.cancel(
            self._state, t.slot, clock.now, clock._seq
        )
        self._release(t)
        return True

    def progress(self, t: Flow) -> float:
        """Bytes ``t`` has moved so far (all of them once it finished)."""
        if t.moved is not None:
            return t.moved
        left, rate, since, moved = self._state[2][t.slot].tolist()  # k.REMAINING .. k.MOVED
        return moved + min(rate * (self.clock.now - since), left)

    def uploads(self, node: int) -> list[Flow]:
        """The transfers leaving ``node``, oldest first."""
        return [self._flows[s] for s in k.uploads(self._state, node)]  # type: ignore[misc]

    def idle_restart(self) -> None:
        """No windows to restart: connections are warm without slow start."""

    def fire(self, limit_t: float, limit_seq: int, deadline: float) -> int:
        """Run the finishes due before the clock's next event (and by ``deadline``), up to
        the first that completes a transfer, whose callback then runs; the events run."""
        clock = self.clock
        slot, events, now, moved, clock._seq, self.next_t, self.next_seq = k.fire(
            self._state, limit_t, limit_seq, deadline, clock._seq
        )
        if slot < 0:
            return events
        flow = self._flows[slot]
        assert flow is not None
        flow.moved = moved
        self._release(flow)
        clock.now = now
        try:
            flow.on_done()
        finally:
            clock._seq, self.next_t, self.next_seq = k.end_batch(self._state, now, clock._seq)
        return events

    def _release(self, t: Flow) -> None:
        self._flows[t.slot] = None
        self._free.append(t.slot)

    def _grow(self) -> None:
        n = len(self._flows)
        self._state = k.grown(self._state, 2 * n)
        self._flows.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))
