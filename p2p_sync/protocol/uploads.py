"""Upload slots: which waiting chunk request an uploader serves next (sans-I/O).

An uploader serves at most ``slots`` chunks at once and lets ``queue_limit`` more wait; beyond
that a request is refused as busy (HTTP 503), and the requester asks elsewhere. *Which* waiting
request gets a freed slot matters as much as how many there are. First come, first served lets
one requester that pipelines deeply (it asks for as many chunks as its bandwidth-delay product
holds) take most slots of an uploader, and its own downlink, shared with everything else it
fetches, then caps every one of those transfers: measured in the simulator, the trainer kept
all 16 slots busy with transfers to 3 requesters whose downlinks were full, and its uplink ran at
55%. So a freed slot goes to the requester with the fewest uploads in progress here, ties to
the one asking for the freshest chunk, then to the one served least recently (then to the
oldest request): round robin across requesters, as BitTorrent spreads its unchoke slots, and
still work-conserving (a lone requester gets every slot).

Freshest: each request comes with a ``rank``, how often the uploader already uploaded the
chunk it asks for (its first). A chunk uploaded here fewer times is rarer in the swarm: it
just arrived, and every peer that lacks it waits on the few that hold it, while a chunk
uploaded many times has other holders. A chunk crosses the swarm in a few relay hops, and each
hop waited in an uploader's line behind older chunks (simulated, 100 peers at 20 ms: a median
hop waited 25 ms there, of ~97 ms); served freshest first, the last peer finished 1.142 ->
1.117 s. Within one requester, its freshest request goes first too (ties: oldest first).

The node's data plane (``transport.dataplane``) and the simulator (``simulations.swarm_sim``)
both decide with this class, so what the simulator shows of uploads is true of the node.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable
from enum import Enum
from typing import Any, Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class Admission(Enum):
    SERVE = "serve"  # a slot is free: start now
    QUEUED = "queued"  # wait for a slot (``finished`` hands it over)
    BUSY = "busy"  # every slot taken and the queue full: refuse


class UploadSlots(Generic[T]):
    """Slots and the waiting line of one uploader. ``T``: the caller's request handle."""

    STALE_SLACK = 64  # heap entries beyond 4 per waiting requester before it drops stale ones

    def __init__(self, slots: int, queue_limit: int) -> None:
        if slots < 1 or queue_limit < 0:
            raise ValueError("slots must be >= 1 and queue_limit >= 0")
        self.slots, self.queue_limit = slots, queue_limit
        self.active: Counter[Hashable] = Counter()  # uploads in progress per requester
        self._waiting: dict[Hashable, list[T]] = {}  # per requester, oldest first
        # waiting handle -> (rank, arrival, requester): its first two, its place in line
        self._order: dict[T, tuple[int, int, Hashable]] = {}
        self._arrivals = 0
        self._grants = 0
        self._last_grant: dict[Hashable, int] = {}  # of requesters with uploads or requests here
        self.busy = 0  # uploads in progress, all requesters
        # each waiting requester's key (``_next``) in a heap: (key, version, requester, its
        # best request); an entry is current while its version is the requester's in
        # ``_version`` (a key changes as the requester's uploads, grants and line do)
        self._heap: list[tuple[tuple[int, int, int, int], int, Any, Any]] = []
        self._version: dict[Hashable, int] = {}
        self._versions = 0

    @property
    def queued(self) -> int:
        return len(self._order)

    def pending(self, requester: Hashable) -> bool:
        """``requester`` has an upload in progress here or a request waiting for one."""
        return requester in self.active or requester in self._waiting

    def request(self, requester: Hashable, handle: T, rank: int = 0) -> Admission:
        """A request arrives: serve it now, queue it, or refuse it. ``rank``: uploads here
        of the chunk it asks for (fewer go first)."""
        if self.busy < self.slots and not self._order:
            self._grant(requester)
            return Admission.SERVE
        if self.queued >= self.queue_limit:
            return Admission.BUSY
        self._arrivals += 1
        self._order[handle] = (rank, self._arrivals, requester)
        self._waiting.setdefault(requester, []).append(handle)
        self._rekey(requester)
        return Admission.QUEUED

    def withdraw(self, handle: T) -> bool:
        """A waiting request gave up (timed out, cancelled): it leaves the line."""
        entry = self._order.pop(handle, None)
        if entry is None:
            return False
        requester = entry[2]
        line = self._waiting[requester]
        line.remove(handle)
        if not line:
            del self._waiting[requester]
            self._forget(requester)
        self._rekey(requester)
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
        self._rekey(requester)
        started = []
        while self._order and self.busy < self.slots:
            started.append(self._next())
        return started

    def _next(self) -> tuple[Hashable, T]:
        """The freshest request (then the oldest) of the requester with the fewest uploads
        here, then with the freshest request, then served least recently (a requester new
        here counts as served longest ago). Keys are unique (each names its request's
        arrival), so the heap's least is the one a scan of every requester would pick."""
        heap, version = self._heap, self._version
        while True:
            _, v, requester, handle = heapq.heappop(heap)
            if version.get(requester) == v:
                break
        line = self._waiting[requester]
        line.remove(handle)
        if not line:
            del self._waiting[requester]
        del self._order[handle]
        self._grant(requester)
        self._rekey(requester)
        return requester, handle

    def _rekey(self, requester: Hashable) -> None:
        """``requester``'s key changed (or it left the line): push its new one."""
        line = self._waiting.get(requester)
        if not line:
            self._version.pop(requester, None)
            return
        order = self._order
        best = line[0] if len(line) == 1 else min(line, key=order.__getitem__)
        rank, arrival, _ = order[best]
        key = (self.active.get(requester, 0), rank, self._last_grant.get(requester, -1), arrival)
        self._versions += 1
        self._version[requester] = self._versions
        heapq.heappush(self._heap, (key, self._versions, requester, best))
        if len(self._heap) > 4 * len(self._version) + self.STALE_SLACK:  # drop stale entries
            self._heap = [e for e in self._heap if self._version.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

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
        waiting = sorted(self._order.items(), key=lambda kv: kv[1][1])
        self.active.clear()
        self._waiting.clear()
        self._order.clear()
        self._last_grant.clear()
        self._heap.clear()
        self._version.clear()
        self.busy = 0
        return [(requester, handle) for handle, (_, _, requester) in waiting]
