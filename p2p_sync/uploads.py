"""Upload slots: which waiting chunk request an uploader serves next (sans-I/O).

An uploader serves at most ``slots`` chunks at once and lets ``queue_limit`` more wait; beyond
that a request is refused as busy (HTTP 503), and the requester asks elsewhere. *Which* waiting
request gets a freed slot matters as much as how many there are. First come, first served lets
one requester that pipelines deeply (it asks for as many chunks as its bandwidth-delay product
holds) take most slots of an uploader, and its own downlink, shared with everything else it
fetches, then caps every one of those transfers: measured in the simulator, the trainer kept
all 16 slots busy with transfers to 3 requesters whose downlinks were full, and its uplink ran at
55%. So a freed slot goes to the requester with the fewest uploads in progress here, ties to
the one served least recently (then to the oldest request), each requester's own requests in
order: round robin across requesters, as BitTorrent spreads its unchoke slots, and still
work-conserving (a lone requester gets every slot).

The node's data plane (``transport.dataplane``) and the simulator (``simulations.swarm_sim``)
both decide with this class, so what the simulator shows of uploads is true of the node.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class Admission(Enum):
    SERVE = "serve"  # a slot is free: start now
    QUEUED = "queued"  # wait for a slot (``finished`` hands it over)
    BUSY = "busy"  # every slot taken and the queue full: refuse


class UploadSlots(Generic[T]):
    """Slots and the waiting line of one uploader. ``T``: the caller's request handle."""

    def __init__(self, slots: int, queue_limit: int) -> None:
        if slots < 1 or queue_limit < 0:
            raise ValueError("slots must be >= 1 and queue_limit >= 0")
        self.slots, self.queue_limit = slots, queue_limit
        self.active: Counter[Hashable] = Counter()  # uploads in progress per requester
        self._waiting: dict[Hashable, deque[T]] = {}  # per requester, oldest first
        self._order: dict[T, tuple[int, Hashable]] = {}  # handle -> (arrival, requester)
        self._arrivals = 0
        self._grants = 0
        self._last_grant: dict[Hashable, int] = {}  # of requesters with uploads or requests here
        self.busy = 0  # uploads in progress, all requesters

    @property
    def queued(self) -> int:
        return len(self._order)

    def pending(self, requester: Hashable) -> bool:
        """``requester`` has an upload in progress here or a request waiting for one."""
        return requester in self.active or requester in self._waiting

    def request(self, requester: Hashable, handle: T) -> Admission:
        """A request arrives: serve it now, queue it, or refuse it."""
        if self.busy < self.slots and not self._order:
            self._grant(requester)
            return Admission.SERVE
        if self.queued >= self.queue_limit:
            return Admission.BUSY
        self._arrivals += 1
        self._order[handle] = (self._arrivals, requester)
        self._waiting.setdefault(requester, deque()).append(handle)
        return Admission.QUEUED

    def withdraw(self, handle: T) -> bool:
        """A waiting request gave up (timed out, cancelled): it leaves the line."""
        entry = self._order.pop(handle, None)
        if entry is None:
            return False
        line = self._waiting[entry[1]]
        line.remove(handle)
        if not line:
            del self._waiting[entry[1]]
            self._forget(entry[1])
        return True

    def finished(self, requester: Hashable) -> list[tuple[Hashable, T]]:
        """An upload to ``requester`` ended: the (requester, handle) pairs to start now."""
        if self.active[requester] <= 0:
            raise ValueError(f"no upload to {requester!r} in progress")
        self.active[requester] -= 1
        self.busy -= 1
        if not self.active[requester]:
            del self.active[requester]
            self._forget(requester)
        started = []
        while self._order and self.busy < self.slots:
            started.append(self._next())
        return started

    def _next(self) -> tuple[Hashable, T]:
        """The oldest request of the requester with the fewest uploads here, served least
        recently (a requester new here counts as served longest ago)."""
        active, order, waiting, last = self.active, self._order, self._waiting, self._last_grant
        requester = min(
            waiting, key=lambda r: (active[r], last.get(r, -1), order[waiting[r][0]][0])
        )
        line = waiting[requester]
        handle = line.popleft()
        if not line:
            del waiting[requester]
        del order[handle]
        self._grant(requester)
        return requester, handle

    def _grant(self, requester: Hashable) -> None:
        self.active[requester] += 1
        self.busy += 1
        self._grants += 1
        self._last_grant[requester] = self._grants

    def _forget(self, requester: Hashable) -> None:
        """Keep history only of requesters with uploads or requests here (bounded memory)."""
        if requester not in self.active and requester not in self._waiting:
            self._last_grant.pop(requester, None)

    def clear(self) -> list[tuple[Hashable, T]]:
        """The uploader stops: forget every upload; the waiting requests, oldest first."""
        waiting = sorted(self._order.items(), key=lambda kv: kv[1][0])
        self.active.clear()
        self._waiting.clear()
        self._order.clear()
        self._last_grant.clear()
        self.busy = 0
        return [(requester, handle) for handle, (_, requester) in waiting]
