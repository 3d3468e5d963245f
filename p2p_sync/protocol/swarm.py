"""The chunk scheduler: a sans-I/O state machine (events in, actions out, time passed in).

One :class:`Scheduler` drives the download of one payload (the chunks of one verified manifest)
from many peers at once. The node (asyncio + HTTP) and the simulator (virtual clock) feed it the
same events and carry out the same actions, so what the simulator shows is true of the node.

Events (inputs, past tense: have-maps, promised pushes, lost peers, chunks verified, arriving,
corrupted or failed, busy peers, timers) and actions (outputs: requests, cancels, bans, stopped
pushes, completion, stalls) are the records of :mod:`p2p_sync.protocol.schedule_events`.

Time: the scheduler never asks for a fixed tick. After each event, :meth:`Scheduler.next_timer`
says when it next needs a :class:`TimerFired` (the oldest request's timeout, the end of a busy
peer's back-off, a stall deadline), or ``None`` when only a peer's answer can move it on.

The policy (rarest first, windows and runs per source, owed sources first, timeouts, endgame,
scores and bans, pushed chunks, stalls) and why each rule is there: ``docs/scheduler.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, KeysView, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import InitVar, dataclass, field
from itertools import filterfalse

from p2p_sync.protocol.chunktables import NOBODY, indices, orphans, shared, shrink, still_missing
from p2p_sync.protocol.peerstats import Depths, PeerStats, best
from p2p_sync.protocol.pushes import PushWait
from p2p_sync.protocol.rarity import ChunkOrder
from p2p_sync.protocol.schedule_events import (
    Action,
    CancelRequest,
    ChunkCorrupted,
    ChunkFailed,
    ChunkMoving,
    ChunkVerified,
    DownloadCompleted,
    DownloadStalled,
    Event,
    PeerBanned,
    PeerBusy,
    PeerHad,
    PeerLost,
    PeerPushes,
    PushStopped,
    RequestChunk,
    TimerFired,
)
from p2p_sync.protocol.stalls import NEVER, StallClocks
from p2p_sync.protocol.swarmconfig import SwarmConfig


@dataclass
class Scheduler:
    """Download state of one payload of ``n_chunks`` chunks. ``unserved``: the peers whose
    claims of a chunk no longer count, by chunk (an earlier download of this payload stalled
    on it with them: :func:`p2p_sync.protocol.stalls.carry_unserved`); ``stalls.unserved`` after
    one."""

    n_chunks: int
    config: SwarmConfig = field(default_factory=SwarmConfig)
    have: InitVar[Iterable[int]] = ()  # read once: a caller's live set is not held on to
    chunk_bytes: int = 0  # the manifest's chunk size (0: unknown, one chunk a request)
    # kept in ``stalls``, not as a field: an object with over 29 attributes reads each slower
    unserved: InitVar[dict[int, set[str]] | None] = None

    def __post_init__(self, have: Iterable[int], unserved: dict[int, set[str]] | None) -> None:
        missing = set(indices(self.n_chunks)) - set(have)
        self.holders: dict[int, AbstractSet[str]] = dict.fromkeys(missing, NOBODY)  # unclaimed
        self._compact_at = len(missing) * 2 // 3  # ``_compact`` when this few are missing
        self.peer_chunks: dict[str, set[int]] = {}
        self._avail: dict[str, set[int]] = {}  # the same claims less those in flight
        self.inflight: dict[int, dict[str, float]] = {}
        self._starts: dict[tuple[int, str], float] = {}  # the same requests, oldest first
        self._last_start = -math.inf
        self._unordered = False  # a request started before an older one: times went back
        self.peer_inflight: dict[str, set[int]] = {}
        self.banned: set[str] = set()
        self.stats: dict[str, PeerStats] = {}
        self.busy_until: dict[str, float] = {}
        self.owed: set[str] = set()  # peers whose uplink few others can use (PeerHad.owed)
        self._n_inflight, self._samples = 0, 0
        c = self.config
        self.pushes = PushWait(c.min_request_timeout_s, c.timeout_factor, c.score_alpha)
        self._chunk_time: float | None = None  # EWMA of request-to-verified seconds
        self._chunk_bytes = float(self.chunk_bytes or 1)  # mean size of those verified
        self._depths = Depths(c, self._chunk_bytes, bool(self.chunk_bytes))  # until inputs move
        self._open: set[str] = set()  # peers with fewer requests in flight than their depth
        self._done_reported = False
        self._orphans = len(missing)  # how many missing chunks no usable peer holds
        self._stuck_since: float | None = None  # orphans and no progress since then
        self._stall_reported = False
        # due chunks: when each stalls; the peers without standing for a chunk (``unserved``)
        kept = {i: p for i, p in (unserved or {}).items() if i in missing}
        self.stalls = StallClocks(c.stall_timeout_s, c.timeout_factor, kept)
        self._order = ChunkOrder(missing, c.seed)

    # ------------------------------------------------------------ queries

    @property
    def complete(self) -> bool:
        return not self.holders

    @property
    def missing(self) -> KeysView[int]:
        """The chunks still missing: ``holders``' keys (a set of its own cost 64 KB at 1,525)."""
        return self.holders.keys()

    def requests_in_flight(self) -> int:
        return self._n_inflight

    def next_timer(self, now: float) -> float | None:
        """When the scheduler next needs a :class:`TimerFired`: the oldest request's timeout,
        the end of a busy peer's back-off, or a stall deadline (``None``: only news helps)."""
        busy = self.busy_until
        if busy:  # an ended back-off never binds again (time only moves on): dropped here
            for peer in [p for p, t in busy.items() if t <= now]:
                del busy[peer]
        times = list(busy.values())
        if self.inflight:
            times.append(self._first_timeout())
        if self._orphans and not self._stall_reported:
            stuck = now if self._stuck_since is None else self._stuck_since
            times.append(stuck + self.config.stall_timeout_s)
        due = self.stalls.deadline()
        if due != NEVER:
            times.append(due)
        times += self.pushes.deadlines()
        return min(times, default=None)

    # ------------------------------------------------------------ events

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event, then schedule; returns the actions to carry out."""
        actions = self._apply(event, now)
        if isinstance(event, ChunkMoving):  # the same requests stay in flight: nothing to do
            return actions
        return actions + self._schedule(now) + self._stalled(now)

    def handle_many(self, events: Sequence[Event], now: float) -> list[Action]:
        """Apply events that arrived together (a driver's queue drained at once), then
        schedule once: the decision sees all of them, and is paid for once. One event is
        :meth:`handle`'s."""
        if len(events) == 1:
            return self.handle(events[0], now)
        actions: list[Action] = []
        for event in events:
            actions += self._apply(event, now)
        return actions + self._schedule(now) + self._stalled(now)

    def _apply(self, event: Event, now: float) -> list[Action]:
        """What one event changes, and the actions that follow at once (cancels, bans).
        The most frequent events are looked for first."""
        if isinstance(event, ChunkVerified):
            return self._verified(event, now)
        if isinstance(event, PeerHad):
            self._peer_had(event.peer, event.indices, event.rtt_s, event.owed, now)
            self.pushes.claimed(event.peer, event.indices, now)
        elif isinstance(event, TimerFired):
            return self._timeouts(now)
        elif isinstance(event, ChunkMoving):
            self._moving(event, now)
        elif isinstance(event, PeerPushes):
            self._promised(event.peer, still_missing(event.indices, self.holders), now)
        elif isinstance(event, PeerLost):
            return self._forget_peer(event.peer)
        elif isinstance(event, ChunkCorrupted):
            return self._ban(event.peer, f"served chunk {event.index} failing its hash")
        elif isinstance(event, ChunkFailed):
            return self._failed(event.peer, event.index)
        elif isinstance(event, PeerBusy):
            if self._drop_request(event.peer, event.index) is not None:
                self.busy_until[event.peer] = now + self.config.busy_backoff_s
        return []

    def _peer_had(
        self,
        peer: str,
        indices: frozenset[int],
        rtt: float | None,
        owed: bool = False,
        now: float = 0.0,
    ) -> None:
        """``peer`` holds ``indices``: those still missing count, unless it failed them."""
        if peer in self.banned:
            return
        known = self.peer_chunks.get(peer)
        self._heard(peer, rtt, owed, known is None)
        if known is None:
            known = self.peer_chunks[peer] = set()
        clocks, by_chunk, fresh = self.stalls, self.holders, dict[int, None]()  # new claims
        unserved, started, overtime = clocks.unserved, clocks.started, clocks.overtime
        # missing and not known, in ``indices``' order (the stall clocks'), skipped in C
        for i in filterfalse(known.__contains__, filter(by_chunk.__contains__, indices)):
            holders = by_chunk[i]
            if unserved and peer in unserved.get(i, ()):
                continue  # it claimed this chunk before and did not serve it
            if (not holders and i in started) or i in overtime:
                clocks.claimed(i, peer, not holders, now)  # else it changes no clock
            fresh[i] = None
            if holders:
                holders.add(peer)  # type: ignore[attr-defined]  (only NOBODY is not a set)
            else:
                self._first_holder(i, peer)
        known.update(fresh)  # at once, not one by one: half the table (``chunktables``)
        idle = set(filterfalse(self.inflight.__contains__, fresh))  # not all of ``inflight``
        self._avail.setdefault(peer, set()).update(idle)

    def _first_holder(self, index: int, peer: str) -> None:
        """``peer`` is the only holder of missing ``index``: a set of its own (not the shared
        ``NOBODY``), and a source for a chunk that had none."""
        self.holders[index] = {peer}
        self._orphans -= 1
        self._progress()

    def _heard(self, peer: str, rtt: float | None, owed: bool, first: bool) -> None:
        """A have-map answer came from ``peer`` (``first``: the first since it was met or
        lost): note whether we owe it (``PeerHad.owed``) and the round trip it took. Its room
        is counted anew only if either is new: every other change recounts it already."""
        if owed:
            self.owed.add(peer)
        stats = self._stats_of(peer)
        if rtt is not None:
            stats.rtt_sample(rtt)
            self._depths.forget(peer)
        elif not first:
            return
        self._recount(peer)

    def _stats_of(self, peer: str) -> PeerStats:
        stats = self.stats.get(peer)
        if stats is None:  # (not ``setdefault``: that builds a PeerStats on every event)
            stats = self.stats[peer] = PeerStats()
        return stats

    def _promised(self, pusher: str, indices: frozenset[int], now: float) -> None:
        """Wait for ``indices`` from ``pusher``; a chunk some peer already holds counts as
        claimed from now (else a promise made after the have-maps would never fall due)."""
        if pusher in self.banned:
            return
        self.pushes.expect(pusher, indices, now)
        for peer, chunks in self.peer_chunks.items():
            self.pushes.claimed(peer, chunks & indices, now)

    def _compact(self) -> None:
        """A third of the chunks missing at the last call arrived: rebuild the tables keyed
        by them (``chunktables.shrink``)."""
        self._compact_at = len(self.holders) * 2 // 3
        self.holders = shrink(self.holders, self.peer_chunks, self._avail)

    def _unhold(self, peer: str, index: int) -> None:
        """``peer`` no longer counts as holding ``index`` (it left, failed, was banned)."""
        holders = self.holders.get(index)
        if not holders or peer not in holders:
            return  # not missing, or an orphan already, or not one of them
        holders.discard(peer)  # type: ignore[attr-defined]  (not NOBODY: not empty)
        if not holders:
            self._orphans += 1

    def _unclaim(self, peer: str, index: int) -> None:
        """``peer``'s claim of ``index`` no longer counts (it failed it, or stalled it)."""
        chunks = self.peer_chunks.get(peer)
        if chunks is not None:
            chunks.discard(index)
            self._avail[peer].discard(index)
        self._unhold(peer, index)

    def _forget_peer(self, peer: str) -> list[Action]:
        for i in self.peer_chunks.pop(peer, set()):
            self._unhold(peer, i)
        self._avail.pop(peer, None)
        cancelled: list[Action] = [PushStopped(peer)] if self.pushes.drop(peer) else []
        for i in list(self.peer_inflight.get(peer, ())):
            self._drop_request(peer, i)
            cancelled.append(CancelRequest(peer, i))
        self.peer_inflight.pop(peer, None)
        self._open.discard(peer)
        self.owed.discard(peer)
        return cancelled

    def _drop_request(self, peer: str, index: int) -> float | None:
        asked = self.inflight.get(index)
        started = None if asked is None else asked.pop(peer, None)
        if started is None:
            return None
        self.stalls.ended(index)  # past the limit: was this its last request in time?
        del self._starts[(index, peer)]
        if not asked:  # its last request: its holders may be asked for it again
            del self.inflight[index]
            avail = self._avail
            for holder in self.holders.get(index, ()):
                avail[holder].add(index)
        self.peer_inflight[peer].discard(index)
        self._n_inflight -= 1
        self._recount(peer)
        return started

    def _verified(self, ev: ChunkVerified, now: float) -> list[Action]:
        """A chunk arrived: learn from it, and forget it (its claims, its other requests).
        Its holders go first, so that dropping its requests gives it back to none of them."""
        peer, index = ev.peer, ev.index
        holders = self.holders.pop(index, None)  # None: not missing (a second copy)
        in_avail = index not in self.inflight  # then each holder's ``_avail`` holds it
        started = self._drop_request(peer, index)
        stats = self._stats_of(peer)
        if started is not None:
            self._measure(ev, stats, started, now)
        stats.verified += 1
        self.pushes.arrived(peer, index, now)
        if holders is None:
            return []
        if not holders:
            self._orphans -= 1
        self.stalls.delivered(index, now)
        self._progress()
        chunks, avail = self.peer_chunks, self._avail
        for holder in holders:  # have-maps keep only what is still missing
            chunks[holder].discard(index)
        if in_avail:
            for holder in holders:
                avail[holder].discard(index)
        if len(self.holders) <= self._compact_at:
            self._compact()
        losers = list(self.inflight.get(index, ()))
        for loser in losers:  # endgame: the other copies are no longer needed
            self._drop_request(loser, index)
        return [CancelRequest(p, index) for p in losers]

    def _measure(self, ev: ChunkVerified, stats: PeerStats, started: float, now: float) -> None:
        """Learn from one verified reply: the typical chunk time (for time-outs), the peer's
        delivery rate (bytes over the time since its previous delivery or since the request,
        whichever is later: pipelined requests do not make a peer look slow) and its round
        trip (a reply takes at least one), hence how many requests to keep there."""
        a, took = self.config.score_alpha, max(now - started, 1e-6)
        ct = self._chunk_time
        self._chunk_time = took if ct is None else a * took + (1 - a) * ct
        rate = ev.nbytes / max(now - max(started, stats.last_delivery), 1e-6)
        # After chunks that came unasked (pushed or forwarded: verified, nothing to time) the
        # first timed rate enters the EWMA from zero, so a pushing source (the trainer, a
        # forwarder) starts at 30% of it: a shallower pipeline there at first (taking it whole
        # measured worse for the last peer: docs/decisions/2026-11-27-where-the-time-goes.md).
        stats.throughput = rate if not stats.verified else a * rate + (1 - a) * stats.throughput
        stats.last_delivery = now
        self._samples += 1
        stats.rtt_sample(took)
        self._depths.forget(ev.peer)
        mean = self._chunk_bytes + (ev.nbytes - self._chunk_bytes) / self._samples
        if mean == self._chunk_bytes:
            self._recount(ev.peer)
            return
        self._chunk_bytes = mean  # every depth is counted in chunks of this size
        for peer in self._depths.resize(mean, self.stats):
            self._recount(peer)

    def _failed(self, peer: str, index: int) -> list[Action]:
        if self._drop_request(peer, index) is None:
            return []
        self._unclaim(peer, index)  # it cannot serve a chunk it claimed: it holds it no more
        self._stats_of(peer).failures += 1
        return []

    def _ban(self, peer: str, reason: str) -> list[Action]:
        if peer in self.banned:
            return []
        self.banned.add(peer)
        return [*self._forget_peer(peer), PeerBanned(peer, reason)]

    def _timeout_limit(self) -> float:
        """How old a request may grow: ``timeout_factor`` typical chunk times, at least
        ``min_request_timeout_s``; ``request_timeout_s`` before anything was measured. Not
        capped above: a 4 MiB chunk shared 16 ways on a 10 Mbit/s uplink takes ~54 s, and a
        fixed cap cancelled every such transfer near its end (simulated, 16 peers on 10
        Mbit/s, 200 MB in 1 MiB chunks: never converged, 14 GB sent for nothing). The
        transports cut only transfers that stop moving (``HttpLimits.request_timeout_s``)."""
        c = self.config
        if self._chunk_time is None:
            return c.request_timeout_s
        return max(c.min_request_timeout_s, c.timeout_factor * self._chunk_time)

    def _first_timeout(self) -> float:
        """The earliest ``started + _patience`` over the requests in flight (``_timeouts``
        fires on that sum), without summing every request after every event: requests are
        kept oldest first, and the hard limit is never below the soft one, so the oldest
        request on a chunk someone else holds ends the search."""
        soft = self._timeout_limit()
        hard = max(soft, self.config.request_timeout_s)
        if self._unordered:
            return min(s + self._patience(p, i, soft) for (i, p), s in self._starts.items())
        holders, oldest_hard = self.holders, math.inf
        for (i, peer), started in self._starts.items():
            h = holders.get(i, ())
            if len(h) > (peer in h):
                return min(started + soft, oldest_hard + hard)
            oldest_hard = min(oldest_hard, started)
        return oldest_hard + hard

    def _patience(self, peer: str, index: int, soft: float) -> float:
        """How long the request for ``index`` at ``peer`` may run: ``soft`` (the adaptive
        limit) if another peer holds the chunk, else the hard ``request_timeout_s``."""
        holders = self.holders.get(index, ())
        if len(holders) > (peer in holders):
            return soft
        return max(soft, self.config.request_timeout_s)

    def _moving(self, ev: ChunkMoving, now: float) -> None:
        """Bytes of a chunk in flight: progress if further into it than any request got."""
        if ev.peer not in self.inflight.get(ev.index, ()):
            return  # not asked of it (or given up on): nothing to time
        if self.stalls.moved(ev.index, ev.nbytes, now):
            self._progress()

    def _spared(self, index: int, deadline: float) -> bool:
        """Whether ``index``, past its stall limit (``deadline``), is not stalled yet: a
        request for it made before the deadline is still in flight (its answer is still to
        come: the line at a busy uploader, a slow link; one that timed out, failed or was
        refused is no answer), or no peer claims it (an orphan stalls only once nothing at
        all moves, as a swarm fills in)."""
        if not self.holders.get(index):
            return True
        return any(t < deadline for t in self.inflight.get(index, {}).values())

    def _progress(self) -> None:
        """A chunk verified or moving, or an orphan found a source: the orphans' stall clock
        starts again."""
        self._stuck_since = None
        self._stall_reported = False

    def _stalled(self, now: float) -> list[Action]:
        """Report the chunks stalled now: those due and not delivered within the stall limit
        whatever was claimed meanwhile, and once per quiet spell those with no source when
        nothing has moved for ``stall_timeout_s`` (chunks without a source are normal while a
        swarm fills in, as long as other chunks keep arriving). O(1) amortised except when
        it fires."""
        clocks = self.stalls
        stalled = clocks.overdue(now, self._spared) if clocks.may_be_late(now) else None
        if self._orphans and not self._stall_reported:
            if self._stuck_since is None:
                self._stuck_since = now
            if self._stuck_since + self.config.stall_timeout_s <= now:  # as next_timer() sums
                stalled = orphans(self.holders) | (stalled or set())
        if not stalled:
            return []
        self._stall_reported = True  # the orphans among them too: once per quiet spell
        out: list[Action] = []
        disowned = {i: self._disown(i, out) for i in stalled}
        out.append(DownloadStalled(frozenset(stalled), {i: p for i, p in disowned.items() if p}))
        return out

    def _disown(self, index: int, out: list[Action]) -> frozenset[str]:
        """A stalled chunk: the peers that claim it, or were asked for it and did not deliver
        it, lose standing for it (``unserved``): their claims of it count no more, and a
        request for it still at one of them is cancelled (into ``out``). Returns them."""
        tried = self.stalls.forget(index)  # reported once: due again only when asked again
        peers = frozenset(tried | self.holders.get(index, set()))
        if peers:
            self.stalls.unserved.setdefault(index, set()).update(peers)
        for peer in peers:
            if self._drop_request(peer, index) is not None:
                out.append(CancelRequest(peer, index))
            self._unclaim(peer, index)
        return peers

    def _timeouts(self, now: float) -> list[Action]:
        actions: list[Action] = [PushStopped(peer) for peer in self.pushes.expire(now)]
        soft = self._timeout_limit()
        if not self._unordered and next(iter(self._starts.values()), now) + soft > now:
            return actions  # the oldest request is within even the soft limit: all are
        expired = [
            (peer, i)
            for i, peers in self.inflight.items()
            for peer, started in peers.items()
            if started + self._patience(peer, i, soft) <= now  # the sum next_timer() wakes at
        ]
        for peer, i in expired:
            started = self._drop_request(peer, i) if peer not in self.banned else None
            if started is None:
                continue
            actions.append(CancelRequest(peer, i))
            self._stats_of(peer).failures += 1
            self._censored(now - started)
        return actions

    def _censored(self, age: float) -> None:
        """A request cancelled at ``age`` took at least that long: a sample for the typical
        chunk time, as a verified chunk is. Without it only the chunks that beat the timeout
        were measured, so a crowded uploader's queue (a chunk shared 16 ways, or a large one on
        a slow link) never raised the limit and every request waiting there was cancelled in
        turn and asked again elsewhere: a congestion collapse (simulated, 32 peers on 100
        Mbit/s, 20 MB in 1 MiB chunks: never converged, the trainer uploaded 41x the
        payload). Each timeout now moves the limit towards ``timeout_factor`` x its age,
        TCP's back-off on a retransmission timeout; verified chunks bring it down again."""
        if self._chunk_time is not None:
            a = self.config.score_alpha
            self._chunk_time = a * age + (1 - a) * self._chunk_time

    # ------------------------------------------------------------ scheduling

    def _recount(self, peer: str) -> None:
        """Whether ``peer`` has room for another run of requests, kept in ``_open`` as its
        requests and depth change: scheduling after every event then looks only at peers
        with room (a busy download has few), not at every peer followed."""
        depth, run = self._depths.pairs.get(peer) or self._depth_run(peer)  # (hit inlined)
        if len(self.peer_inflight.get(peer, ())) + (run if run < depth else depth) <= depth:
            self._open.add(peer)
        else:
            self._open.discard(peer)

    def _depth_run(self, peer: str) -> tuple[int, int]:
        """``peer``'s depth and run (``PeerStats.depth_run``)."""
        return self._depths.of(peer, self.stats[peer])

    def _full(self, peer: str) -> bool:
        """No room left at ``peer``: a peer opens once a whole run has room (``_recount``)
        and is then asked until it is full, so its requests leave together (one request)."""
        return len(self.peer_inflight.get(peer, ())) >= self._depth_run(peer)[0]

    def _source(self, index: int, free: set[str], lagging: str) -> str | None:
        """The free peer to ask for ``index``: the best holder but ``lagging`` (its pusher,
        which lagged on it: the last resort), or ``lagging`` if it is the only one."""
        candidates = self.holders[index] & free
        if lagging in candidates and len(candidates) > 1:
            return best(candidates - {lagging}, self.stats, self.peer_inflight, self.owed)
        return best(candidates, self.stats, self.peer_inflight, self.owed)

    def _free_peers(self, now: float) -> set[str]:
        busy, chunks, banned = self.busy_until, self.peer_chunks, self.banned
        if not busy:  # (the usual case: no lookup per peer)
            return {p for p in self._open if chunks.get(p) and p not in banned}
        return {
            p for p in self._open if chunks.get(p) and busy.get(p, 0.0) <= now and p not in banned
        }

    def _request(self, peer: str, index: int, now: float) -> RequestChunk:
        index = shared(index)  # (computed by the order: kept, and sent on, as the shared one)
        self.stalls.asked(index, peer, now)
        asked = self.inflight.get(index)
        if asked is None:  # its first request: none of its holders is to be asked for it
            asked = self.inflight[index] = {}
            avail = self._avail
            for holder in self.holders.get(index, ()):
                avail[holder].discard(index)
        asked[peer] = now
        self._starts.pop((index, peer), None)
        self._starts[(index, peer)] = now
        self._unordered |= now < self._last_start
        self._last_start = now
        self.peer_inflight.setdefault(peer, set()).add(index)
        self._n_inflight += 1
        self._recount(peer)
        return RequestChunk(peer, index)

    def _schedule(self, now: float) -> list[Action]:
        if not self.holders:
            if self._done_reported:
                return []
            self._done_reported = True
            return [DownloadCompleted()]
        budget = self.config.max_requests_total - self._n_inflight
        if budget <= 0:
            return []
        free = self._free_peers(now)
        out: list[Action] = []
        if free and len(self.inflight) < len(self.holders):
            lagged = self.pushes.lagged
            for i in self._rarest_first(free, budget):
                if budget <= 0 or not free:
                    return out
                peer = self._source(i, free, lagged.get(i, ""))
                if peer is not None:
                    out.append(self._request(peer, i, now))
                    budget -= 1
                    if self._full(peer):
                        free.discard(peer)
        if len(self.inflight) < len(self.holders):
            return out  # not endgame yet: some missing chunk still waits for a source
        return out + self._endgame(now, budget, free)

    def _rarest_first(self, free: set[str], budget: int) -> list[int]:
        """Missing, unrequested chunks some free peer holds, rarest first (from the free
        peers' ``_avail``, their claims not in flight: this costs what they offer to ask, a
        few chunks in a busy download, not all they hold nor the whole payload)."""
        avail = self._avail
        cands = set().union(*[avail[p] for p in free])
        if self.pushes.pusher:
            cands.difference_update(self.pushes.pusher)  # on their way unasked
        return self._order.rarest(cands, self.holders, budget)

    def _endgame(self, now: float, budget: int, free: set[str]) -> list[Action]:
        out: list[Action] = []
        if budget <= 0 or not free:
            return out  # asked after every event of the endgame: skip the sort when no room
        oldest_first = sorted(self.inflight, key=lambda i: min(self.inflight[i].values()))
        for i in oldest_first:
            if budget <= 0 or not free:
                break
            if len(self.inflight[i]) >= self.config.endgame_sources:
                continue
            cands = (self.holders.get(i, set()) & free).difference(self.inflight[i])
            peer = best(cands, self.stats, self.peer_inflight, self.owed)
            if peer is not None:
                out.append(self._request(peer, i, now))
                budget -= 1
                if self._full(peer):
                    free.discard(peer)
        return out
