"""Stall clocks: when a chunk of a download has waited too long on the peers that claim it.

A have-map is a claim, not a delivery: a peer may claim a chunk and never serve it (no answer,
an error, half the bytes and then silence) and claim it again the next second. So a chunk's
clock runs from when it is due, not from the last claim: it is due once it is asked of a peer
claiming it, and its clock starts then; it starts again only on news that it may come now,

* a peer asked for it for the first time since it was due (a new source gets its full chance),
* a first claim after no peer claimed it (the same, for a chunk that had no source),
* more of its bytes than any request for it brought before (a slow transfer that keeps moving;
  the same half at every request is no progress),

and never on a claim from a peer that was asked for it already. A chunk whose clock runs past
the **stall limit** is stalled, unless the scheduler spares it (a request for it made before the
limit ran out is still in flight, so the peer's answer is still to come; or no peer claims it,
so it is an orphan, which the scheduler stalls only once nothing at all moves). The stall limit
is ``stall_timeout_s``, or ``factor`` times the longest a delivered chunk of this download
waited from being due, if longer: on slow, crowded links honest uploaders make chunks wait their
turn for longer than ``stall_timeout_s`` (simulated, 16 peers on 10 Mbit/s uplinks in 2 MiB
chunks: waits of up to 76 s, never over 2.1 times the longest before), while chunks that never
arrive do not count, so a peer that serves nothing cannot stretch it.

Cost: the scheduler asks after every event, so clocks are kept oldest first (a deque with
stale entries dropped once) and the earliest deadline is cached: O(1) amortised per event.

A stalled chunk's claimants, and the peers asked for it since it was due, lose standing for it
(``unserved``: their claims of it count no more, their other chunks still do), and the caller
carries that over to a later download of the same payload (:func:`carry_unserved`).

Sans-I/O: times are passed in; :class:`p2p_sync.protocol.swarm.Scheduler` owns one instance per
download.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping

NEVER = math.inf  # a deadline that never comes


class StallClocks:
    """The stall clocks of one download's due chunks, whom each was asked of since it was due
    (``tried``), and the peers without standing for a chunk (``unserved``)."""

    __slots__ = (
        "stall_timeout_s",
        "factor",
        "limit",
        "longest",
        "started",
        "tried",
        "unserved",
        "_order",
        "_last",
        "_unordered",
        "overtime",
        "_ended",
        "_moved",
        "_next",
        "_exact",
    )

    COMPACT_SLACK = 64  # stale queue entries beyond the live clocks' count before a compaction

    def __init__(
        self,
        stall_timeout_s: float,
        factor: float,
        unserved: Mapping[int, Iterable[str]] | None = None,
    ) -> None:
        self.stall_timeout_s, self.factor = stall_timeout_s, factor
        self.limit = stall_timeout_s  # the stall limit (``delivered`` stretches it)
        self.longest = 0.0  # the longest a delivered chunk waited from being due
        self.started: dict[int, float] = {}  # due chunks not past the limit: since when
        self.tried: dict[int, str | set[str]] = {}  # due chunks: the peers asked since (one: a str)
        self.unserved = {i: set(peers) for i, peers in (unserved or {}).items()}
        self._order: deque[tuple[float, int]] = deque()  # ``started``, oldest first
        self._last = -math.inf
        self._unordered = False  # a clock started before an older one: times went back
        self.overtime: dict[int, float] = {}  # due, past the limit, spared for now: since when
        self._ended: set[int] = set()  # of those, to look at again (a request ended...)
        self._moved: dict[int, int] = {}  # the most bytes of a chunk one request brought
        self._next = NEVER  # no clock runs past the limit before this
        self._exact = True  # and one does then (no clock started or stopped since)

    # ------------------------------------------------------------ events

    def asked(self, index: int, peer: str, now: float) -> None:
        """``index`` was asked of ``peer``: due from now if it was not, or if ``peer`` was
        never asked for it since it was due."""
        tried = self.tried.get(index)
        if tried is None:  # (a set of one is 216 bytes: the first peer is kept as itself)
            self.tried[index] = peer
            self.start(index, now)
            return
        if not _among(peer, tried) or not self.due(index):
            self.start(index, now)
        if isinstance(tried, set):
            tried.add(peer)
        elif tried != peer:
            self.tried[index] = {tried, peer}

    def claimed(self, index: int, peer: str, orphan: bool, now: float) -> None:
        """``peer`` claims ``index``, which it did not: a first claim of an ``orphan`` from a
        peer never asked for it restarts its clock; a claim from a peer that failed it makes
        a chunk past the limit looked at again (it may be stalled now)."""
        if not self.due(index):
            return
        if not _among(peer, self.tried.get(index)):
            if orphan:
                self.start(index, now)
        elif index in self.overtime:
            self._ended.add(index)

    def moved(self, index: int, nbytes: int, now: float) -> bool:
        """``nbytes`` of ``index`` came on a request in flight: progress (its clock starts
        again) only if further into it than any request got."""
        if nbytes <= self._moved.get(index, 0):
            return False
        self._moved[index] = nbytes
        self.start(index, now)
        return True

    def ended(self, index: int) -> None:
        """A request for ``index`` ended unanswered (or was cancelled): a chunk past the
        limit that this request spared is looked at again."""
        if index in self.overtime:
            self._ended.add(index)

    def delivered(self, index: int, now: float) -> None:
        """``index`` arrived: not due any more; the stall limit grows if it waited longest."""
        started = self.stop(index)
        self.tried.pop(index, None)
        self.unserved.pop(index, None)
        if started is not None and now - started > self.longest:
            self._stretch(now - started)

    def forget(self, index: int) -> set[str]:
        """``index`` was reported stalled: not due until asked again; whom it was asked of."""
        self.stop(index)
        tried = self.tried.pop(index, None)
        if tried is None:
            return set()
        return tried if isinstance(tried, set) else {tried}

    # ------------------------------------------------------------ clocks

    def due(self, index: int) -> bool:
        return index in self.started or index in self.overtime

    def start(self, index: int, now: float) -> None:
        """``index``'s clock (re)starts at ``now``."""
        self.overtime.pop(index, None)
        if now + self.limit < self._next:
            self._next = now + self.limit
        self._exact = False
        self.started[index] = now
        self._order.append((now, index))
        self._unordered |= now < self._last
        self._last = max(self._last, now)
        if len(self._order) > 2 * len(self.started) + self.COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries of ``_order`` (clocks restarted or stopped since): those
        :meth:`_oldest` and :meth:`_passed` would skip. Entries of the latest time stay: a
        clock restarted at that same time again would make a stale one current again."""
        started, last = self.started, self._last
        self._order = deque(e for e in self._order if e[0] == last or started.get(e[1]) == e[0])

    def stop(self, index: int) -> float | None:
        """``index`` is not due any more: when its clock started (None: it was not due)."""
        self._moved.pop(index, None)
        started = self.started.pop(index, None)
        if started is not None:
            self._exact = False
        return self.overtime.pop(index, started)

    def deadline(self) -> float:
        """When the oldest clock not past the limit runs past it (``NEVER``: none runs)."""
        if not self._exact:
            oldest = self._oldest()
            self._next = NEVER if oldest is None else oldest + self.limit
            self._exact = True
        return self._next

    def may_be_late(self, now: float) -> bool:
        """Whether :meth:`overdue` may find a chunk now (O(1): asked after every event)."""
        return bool(self._ended) or self._next <= now

    def overdue(self, now: float, spared: Callable[[int, float], bool]) -> set[int]:
        """The chunks past the stall limit that ``spared(index, deadline)`` does not spare;
        they are not due any more. Those it spares wait past the limit until looked at again
        (:meth:`ended`, :meth:`claimed`)."""
        limit, late = self.limit, set()
        if self._ended:
            late = {i for i in self._ended if not self._spared(i, spared)}
            self._ended.clear()
        oldest = self._oldest()
        if oldest is not None and oldest + limit <= now:  # as deadline() sums it
            for i in self._passed(now):
                started = self.started.pop(i)
                if spared(i, started + limit):
                    self.overtime[i] = started
                else:
                    late.add(i)
        for i in late:
            self.stop(i)
        oldest = self._oldest()
        self._next, self._exact = (NEVER if oldest is None else oldest + limit), True
        return late

    def _spared(self, index: int, spared: Callable[[int, float], bool]) -> bool:
        started = self.overtime.get(index)
        return started is None or spared(index, started + self.limit)

    def _passed(self, now: float) -> set[int]:
        """The chunks whose clocks ran past the limit by ``now`` (``started`` keeps them)."""
        started, limit = self.started, self.limit
        if self._unordered:
            return {i for i, t in started.items() if t + limit <= now}
        passed, order = set(), self._order
        while order and (started.get(order[0][1]) != order[0][0] or order[0][0] + limit <= now):
            t, i = order.popleft()
            if started.get(i) == t:
                passed.add(i)
        return passed

    def _oldest(self) -> float | None:
        """When the oldest clock not past the limit started (None: none runs)."""
        started, order = self.started, self._order
        if not started:
            order.clear()
            self._unordered, self._last = False, -math.inf
            return None
        if self._unordered:
            return min(started.values())
        while started.get(order[0][1]) != order[0][0]:
            order.popleft()
        return order[0][0]

    def _stretch(self, wait: float) -> None:
        """A chunk arrived ``wait`` after it was due, later than any before: the limit grows,
        and the chunks past the old one are timed again against it (a slow swarm only: in a
        fast one no chunk gets near ``stall_timeout_s``)."""
        self.longest = wait
        self.limit = max(self.stall_timeout_s, self.factor * wait)
        self._next, self._exact = -math.inf, False  # looked at again at the next event
        if self.overtime:
            self.started.update(self.overtime)
            self.overtime.clear()
            self._order = deque(sorted((t, i) for i, t in self.started.items()))
            self._unordered, self._last = False, self._order[-1][0]


def _among(peer: str, tried: str | set[str] | None) -> bool:
    """Whether ``peer`` is among ``tried`` (a set of peers, or one peer as itself)."""
    if tried is None:
        return False
    return peer in tried if isinstance(tried, set) else tried == peer


def carry_unserved(
    record: dict[int, set[str]], indices: Iterable[int], disowned: Mapping[int, Collection[str]]
) -> None:
    """Fold a stall (its chunks, and the peers each :class:`p2p_sync.protocol.swarm.DownloadStalled`
    ``disowned``) into ``record``, the ``unserved`` a later download of the same payload
    starts with (the caller's re-plan may come back to it when no other path is left): the
    peers that did not serve a chunk stay without standing for it, and lose it for more
    chunks as those stall too; a chunk that stalled with no peer left to disown (those with
    standing all gone, or none ever claimed it) gets every peer back, since its sources may
    have been slow rather than lying, and nobody else has it."""
    for i in indices:
        peers = disowned.get(i)
        if peers:
            record.setdefault(i, set()).update(peers)
        else:
            record.pop(i, None)
