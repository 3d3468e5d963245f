"""The bandwidth model of :mod:`simulations.network`, compiled (:mod:`simulations.netkernels`).

The reference model spent half a 1,000-peer run re-rating flows in Python, and its clock's
heap filled with finish events that later rate changes cancel. Here the flows, their rates and
their finish events live in arrays that compiled code updates, on the heap of the
:class:`simulations.fastclock.FastClock` it runs on; only a completed transfer's callback runs
as Python. The output is the reference model's, event for event. Slow start is not compiled:
a scenario with ``slow_start`` uses the reference.
"""

from __future__ import annotations

from collections.abc import Callable

from simulations import netkernels as k
from simulations.fastclock import FastClock


class Flow:
    """A transfer's handle: which slot it runs in, and the bytes it moved once it ended."""

    __slots__ = ("slot", "src", "dst", "on_done", "moved")

    def __init__(self, slot: int, src: int, dst: int, on_done: Callable[[], None]) -> None:
        self.slot, self.src, self.dst, self.on_done = slot, src, dst, on_done
        self.moved: float | None = None  # None while it runs


class FastNetwork:
    """:class:`simulations.network.Network`'s interface and results, without slow start."""

    def __init__(self, clock: FastClock, uplink: list[float], downlink: list[float]) -> None:
        self.clock = clock
        clock.adopt(k.with_nodes(clock.state, uplink, downlink))
        clock.network = self
        flows = len(clock.state[2])
        self._flows: list[Flow | None] = [None] * flows
        self._free = list(range(flows - 1, -1, -1))

    @property
    def bytes_sent(self) -> list[float]:
        """Bytes each node sent so far (a copy: read it once, not once a node)."""
        return self.clock.state[0][:, k.SENT].tolist()

    @property
    def bytes_received(self) -> list[float]:
        return self.clock.state[0][:, k.RECEIVED].tolist()

    def start(self, src: int, dst: int, nbytes: float, on_done: Callable[[], None]) -> Flow:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        flow = self._flows[slot] = Flow(slot, src, dst, on_done)
        clock = self.clock
        if clock.heap_n > clock.room:
            clock.make_room()
        clock._seq, clock.heap_n, clock.top = k.start(
            clock.state, slot, src, dst, float(nbytes), clock.now, clock._seq
        )
        return flow

    def cancel(self, t: Flow) -> bool:
        """Stop ``t`` if still running (True); the bytes it moved so far stay counted."""
        if t.moved is not None:
            return False
        clock = self.clock
        clock.make_room()
        t.moved, clock._seq, clock.heap_n, clock.top = k.cancel(
            clock.state, t.slot, clock.now, clock._seq
        )
        self._release(t)
        return True

    def progress(self, t: Flow) -> float:
        """Bytes ``t`` has moved so far (all of them once it finished)."""
        if t.moved is not None:
            return t.moved
        left, rate, since, moved = self.clock.state[2][t.slot].tolist()  # k.REMAINING .. MOVED
        return moved + min(rate * (self.clock.now - since), left)

    def uploads(self, node: int) -> list[Flow]:
        """The transfers leaving ``node``, oldest first."""
        return [self._flows[s] for s in k.uploads(self.clock.state, node)]  # type: ignore[misc]

    def idle_restart(self) -> None:
        """No windows to restart: connections are warm without slow start."""

    def completed(self, slot: int, moved: float) -> None:
        """The clock ran the finish that completed the flow in ``slot`` (removed already): its
        callback runs, then its links are re-rated with whatever the callback started."""
        flow = self._flows[slot]
        assert flow is not None
        flow.moved = moved
        self._release(flow)
        clock = self.clock
        try:
            flow.on_done()
        finally:
            if clock.heap_n > clock.room:
                clock.make_room()
            clock._seq, clock.heap_n, clock.top = k.end_batch(clock.state, clock.now, clock._seq)

    def _release(self, t: Flow) -> None:
        self._flows[t.slot] = None
        self._free.append(t.slot)

    def _grow(self) -> None:
        n = len(self._flows)
        self.clock.adopt(k.more_flows(self.clock.state, 2 * n))
        self._flows.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))
