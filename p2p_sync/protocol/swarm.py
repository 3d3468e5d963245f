"""The chunk scheduler: a sans-I/O state machine (events in, actions out, time passed in).

One :class:`Scheduler` drives the download of one payload (the chunks of one verified manifest)
from many peers at once. The node (asyncio + HTTP) and the simulator (virtual clock) feed it the
same events and carry out the same actions, so what the simulator shows is true of the node.

Events (inputs, past tense): :class:`PeerHad` (a peer's have-map, or part of it),
:class:`PeerPushes` (a peer will push these chunks unasked), :class:`PeerLost`,
:class:`ChunkVerified`, :class:`ChunkMoving` (bytes of a chunk in flight are arriving),
:class:`ChunkCorrupted` (bytes failed the signed hash),
:class:`ChunkFailed` (transport error, or the peer lacks the chunk it claimed),
:class:`PeerBusy` (the peer refused for lack of upload slots), :class:`TimerFired`.

Actions (outputs): :class:`RequestChunk`, :class:`CancelRequest`, :class:`PeerBanned`,
:class:`PushStopped`, :class:`DownloadCompleted`, :class:`DownloadStalled`.

Time: the scheduler never asks for a fixed tick. After each event, :meth:`Scheduler.next_timer`
says when it next needs a :class:`TimerFired` (the oldest request's timeout, the end of a busy
peer's back-off, a stall deadline), or ``None`` when only a peer's answer can move it on.

Policy:

* rarest-first: unrequested chunks are taken in order of how few usable peers hold them (ties
  broken by a seeded hash, so peers spread over different chunks);
* several sources at once, each with as many requests in flight as its bandwidth-delay product
  holds (its measured delivery rate x its round trip / the chunk size, rounded up, plus one;
  within [``min_requests_per_peer``, ``max_requests_per_peer``]; ``initial_requests_per_peer`` until
  measured), and at most ``max_requests_total`` in all. This is a TCP window, or BitTorrent's
  request queue, per source: a near source gets one request and one queued (a deep queue at an
  uploader delays every chunk it holds, and so every relay behind it), a fast distant one
  enough to cover the round trip, so its link never idles between chunks. The round trip comes
  from the first have-map answer (``PeerHad.rtt_s``) and from chunk replies (at least one);
  the delivery rate is measured between deliveries, so pipelining does not hide it;
* runs: the requests one step makes of one peer leave as one request (the driver's
  ``/chunks``). A run is as many chunks as the peer delivers in ``request_s`` at its measured
  rate (at most ``request_bytes``; one until measured): a fast source (loopback, a data
  centre) gets several 64 KiB chunks per request, so the per-request cost is paid once a
  run, while a source slower than a chunk per ``request_s`` (a share of a home uplink) is
  asked one chunk at a time as before. A peer keeps its bandwidth-delay product plus one run
  in flight, opens for more once a whole run has room, and is then asked until full; each
  chunk is still verified and relayed on its own (given ``chunk_bytes``, the manifest's chunk
  size; without it, one chunk a request);
* a chunk goes to the free holder with the best score per request we already have in flight
  there (spreading load beats chasing the fastest peer, whose queue then makes it slow; and a
  peer that timed out or crawls is not chosen just because it is idle);
* owed sources first: a free holder whose uplink few others can use (``PeerHad.owed``: it is
  behind NAT and we are public, so only public peers and its own LAN can fetch from it) is
  chosen before any other, unless it ever failed us. Its uplink idles otherwise, while a
  public uplink we leave free serves the NATed peers that can fetch from nobody else. Its
  depth still bounds what it is asked (a free peer has room below its bandwidth-delay product,
  so this fills that pipeline, not a queue);
* a request is cancelled and re-requested elsewhere once it is ``timeout_factor`` times older
  than this download's typical chunk time (an EWMA over verified chunks, queueing at the
  uploader included, and over cancelled requests, each a sample of at least its age: the
  back-off that keeps crowded uploaders from being asked everything twice), at least
  ``min_request_timeout_s`` and with no fixed ceiling (a large chunk on a slow, shared uplink
  may take a minute); a peer that crashed silently thus holds a chunk for a few typical chunk
  times, a fraction of a second on a fast swarm, not ``request_timeout_s``.
  Only if there is an elsewhere: a request to a chunk's only holder waits at least
  ``request_timeout_s``, since asking the same peer again can only make it upload the chunk
  twice (a TCP request is not lost; a late reply is on its way, or queued behind others; a
  starved CPU wakes to both the reply and the timer at once). Measured before this rule: a
  super-seeded trainer, whose handed-out chunks have no other holder, uploaded 2.2x the
  payload on a loaded CI runner;
* endgame: once every missing chunk is requested, the slowest get duplicate requests (up to
  ``endgame_sources`` per chunk); the first verified copy wins and the others are cancelled;
* per-peer score: an EWMA of measured throughput, divided by (1 + failures);
* a peer whose chunk fails its hash is banned at once (only the peer that served it: the
  scheduler knows exactly who sent which bytes). Timeouts and errors only lower a peer's score
  (and an error drops the chunk from its claimed have-map): a slow honest peer that is the
  last source of a chunk must stay usable, or the download could never finish.
* a busy peer (all its upload slots taken) is no failure: it keeps its have-map and is left
  alone for ``busy_backoff_s``.
* pushed chunks: a chunk a peer promised to push (a push-tree parent) is not requested while
  that push is on time (:mod:`p2p_sync.protocol.pushes` says when it is not: the pusher stopped, or
  it
  lags behind on that chunk); then it is requested like any other;
* stall: a chunk asked of a peer claiming it and not delivered within the stall limit
  (``stall_timeout_s``, longer on a swarm slow enough that honest chunks wait that long) is
  stalled, whatever is claimed meanwhile: a peer that claims a chunk and never serves it (no
  answer, an error, a refusal, half the bytes and then silence) cannot hold a download for
  ever by claiming it again (:mod:`p2p_sync.protocol.stalls` says when a chunk's clock starts again:
  a new source asked, its bytes moving). Unless a request for it made in time is still in
  flight (its answer is still to come), or no peer claims it: a missing chunk that no usable
  peer claims stalls only once nothing has moved for ``stall_timeout_s`` (sources appear as a
  swarm fills in, while other chunks keep arriving). A stall emits :class:`DownloadStalled`
  (each chunk once); the peers that claimed a stalled chunk, or were asked for it, lose
  standing for it (per peer and chunk: their claims of it count no more, their other chunks
  still do), and the caller gives up on this payload and re-plans (another artifact, an
  anchor) instead of waiting for ever, carrying the stall over
  (:func:`p2p_sync.protocol.stalls.carry_unserved`) if it comes back to it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import InitVar, dataclass, field

from p2p_sync.protocol.pushes import PushWait
from p2p_sync.protocol.stalls import NEVER, StallClocks

# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SwarmConfig:
    """Every limit of one download (``[download]`` in a node's config; a simulation scenario
    embeds the same table): the scheduler's, and its driver's (the last five)."""

    # Requests in flight per source follow its bandwidth-delay product (delivery rate x round
    # trip / chunk size, plus one), within these bounds; before the first measurement a source
    # gets ``initial_requests_per_peer``. All sources together: at most ``max_requests_total``.
    max_requests_per_peer: int = 32
    min_requests_per_peer: int = 1
    initial_requests_per_peer: int = 2
    max_requests_total: int = 256
    # One request asks a peer for what it delivers in ``request_s`` at its measured rate,
    # several chunks when it delivers one faster (a request costs ~0.7 ms of CPU at both
    # ends over HTTP; each chunk is still verified and relayed as soon as its bytes are in),
    # at most ``request_bytes`` (0: one chunk a request). A peer keeps its bandwidth-delay
    # product plus one such run in flight and is asked again once a whole run has room.
    # 34 MB in 64 KiB chunks to 2 rollouts on loopback (2 cores, medians): 5 ms 0.82 s, 10 ms 0.78,
    # 20 ms 0.85, a chunk a request 1.07; simulated, 1,000 peers at 1 Gbit/s and 20 ms:
    # 5 ms x1.549, 10 ms x1.578, 20 ms x1.565, a chunk a request x1.568 (within run-to-run noise).
    request_s: float = 0.01
    request_bytes: int = 1 << 20
    request_timeout_s: float = 10.0  # before any chunk time is measured; a sole holder's floor
    min_request_timeout_s: float = 0.25  # the floor of the adaptive timeout (round trips too)
    timeout_factor: float = 4.0
    endgame_sources: int = 2
    score_alpha: float = 0.3
    busy_backoff_s: float = 0.05
    # a chunk asked for and not served (no byte of it moving) by any peer claiming it for this
    # long (or timeout_factor x the longest a chunk of the download waited, if longer), or one
    # nobody holds while nothing arrives: give up on the payload and re-plan
    stall_timeout_s: float = 30.0
    seed: int = 0  # tie-break salt (a node draws a fresh one per download)
    have_poll_s: float = 0.2  # driver: how often the set of peers to follow is refreshed
    # driver: peers one download follows (have-maps, requests), the source's preferred first.
    # More only queue: each uploader then serves more requesters, and a receiver's minimum
    # of one request per source outgrows its downlink (simulated, 200 peers at 5 ms / 100
    # Mbit/s: 16 x1.51, 32 x1.30, 64 x1.58; 100 peers at 20 ms / 1 Gbit/s: 32 x1.52, 64 x1.55)
    max_sources: int = 32
    have_failures: int = 3  # driver: have-map errors in a row before a peer counts as lost
    max_attempts: int = 3  # driver: downloads of one payload when stored chunks rot on disk
    # driver: each chunk a seed handed us (its offer), pushed unasked to this many of the peers
    # following our have-map (0: none). Pull costs a relay hop three latencies (have-map news,
    # request, bytes); the seed hands each chunk to one rollout first, so its first hop from
    # there is the swarm's slowest. Only a chunk no other followed peer claims, and only
    # beside at most this many uploads (``p2p_sync.runtime.forwarding``). Simulated, 1,000 peers at
    # 20 ms
    # / 1 Gbit/s: x1.387 against x1.425 without (simulations/README.md, "forwarded")
    forward_seed_chunks: int = 4


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class PeerHad:
    """``peer`` holds (at least) these chunks. ``rtt_s``: how long a request to it took to be
    answered when the answer came at once (the first have-map): a round-trip sample."""

    peer: str
    indices: frozenset[int]
    rtt_s: float | None = None
    owed: bool = False  # few can fetch from ``peer`` (behind NAT, we are public): ask it first


@dataclass(frozen=True)
class PeerPushes:
    """``peer`` will push us these chunks as it gets them, unasked (a push-tree parent)."""

    peer: str
    indices: frozenset[int]


@dataclass(frozen=True)
class PeerLost:
    peer: str


@dataclass(frozen=True)
class ChunkVerified:
    peer: str
    index: int
    nbytes: int


@dataclass(frozen=True)
class ChunkMoving:
    """``nbytes`` of chunk ``index`` have arrived so far on the request to ``peer`` (still in
    flight): a slow transfer that keeps moving is progress. Only bytes further into the chunk
    than any earlier request got count (a peer that sends half of it and falls silent, at
    every request, does not keep the chunk alive)."""

    peer: str
    index: int
    nbytes: int


@dataclass(frozen=True)
class ChunkCorrupted:
    peer: str
    index: int


@dataclass(frozen=True)
class ChunkFailed:
    peer: str
    index: int


@dataclass(frozen=True)
class PeerBusy:
    peer: str
    index: int


@dataclass(frozen=True)
class TimerFired:
    pass


Event = (
    PeerHad
    | PeerPushes
    | PeerLost
    | ChunkVerified
    | ChunkMoving
    | ChunkCorrupted
    | ChunkFailed
    | PeerBusy
    | TimerFired
)

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class RequestChunk:
    peer: str
    index: int


@dataclass(frozen=True)
class CancelRequest:
    peer: str
    index: int


@dataclass(frozen=True)
class PeerBanned:
    peer: str
    reason: str


@dataclass(frozen=True)
class DownloadCompleted:
    pass


@dataclass(frozen=True)
class PushStopped:
    """``peer`` owed us pushed chunks and stopped pushing (or left, or was banned): they are
    requested like any other chunk now; the caller may ask another peer to push."""

    peer: str


@dataclass(frozen=True)
class DownloadStalled:
    """These missing chunks were not delivered within the stall limit of being asked for (or
    of their last progress), or have had no source while nothing moved for ``stall_timeout_s``.
    ``disowned``: the peers that lost standing for each of them with this stall (claimed it,
    or were asked for it, and did not deliver it); a chunk no peer had standing for is not
    named (see :func:`p2p_sync.protocol.stalls.carry_unserved`)."""

    indices: frozenset[int]
    disowned: dict[int, frozenset[str]] = field(default_factory=dict, compare=False)


Action = (
    RequestChunk | CancelRequest | PeerBanned | PushStopped | DownloadCompleted | DownloadStalled
)


@dataclass
class PeerStats:
    """What the scheduler knows of one peer's service."""

    throughput: float = 0.0  # EWMA of its delivery rate, bytes/s (see Scheduler._delivered)
    failures: int = 0
    verified: int = 0
    rtt: float | None = None  # smallest round trip seen (have-map answers, chunk replies)
    last_delivery: float = float("-inf")  # when its last chunk arrived

    def score(self) -> float:
        return (self.throughput + 1.0) / (1 + self.failures)

    def rtt_sample(self, rtt: float) -> None:
        self.rtt = rtt if self.rtt is None else min(self.rtt, rtt)

    def run(self, chunk_bytes: float, config: SwarmConfig) -> int:
        """Chunks to ask for in one request: what it delivers in ``request_s``, at most
        ``request_bytes`` (one until its rate is measured)."""
        most = int(config.request_bytes // chunk_bytes)
        if most <= 1 or not self.throughput:
            return 1
        return max(1, min(most, math.ceil(self.throughput * config.request_s / chunk_bytes)))

    def depth(self, chunk_bytes: float, config: SwarmConfig, run: int = 1) -> int:
        """Requests to keep in flight: its bandwidth-delay product in chunks, plus one run
        (``run`` chunks asked at once), so the next request is already there when a chunk
        leaves (one per source leaves the link idle for a round trip after every chunk, and
        the round trip sampled does not hold the uploader's own work per chunk; much more
        than the product only queues)."""
        want = config.initial_requests_per_peer + run - 1
        if self.rtt is not None and self.throughput:
            want = math.ceil(self.throughput * self.rtt / chunk_bytes) + run
        return min(config.max_requests_per_peer, max(config.min_requests_per_peer, want))


@dataclass
class Scheduler:
    """Download state of one payload of ``n_chunks`` chunks. ``unserved``: the peers whose
    claims of a chunk no longer count, by chunk (an earlier download of this payload stalled
    on it with them: :func:`p2p_sync.protocol.stalls.carry_unserved`); ``stalls.unserved`` after
    one."""

    n_chunks: int
    config: SwarmConfig = field(default_factory=SwarmConfig)
    have: Iterable[int] = ()
    chunk_bytes: int = 0  # the manifest's chunk size (0: unknown, one chunk a request)
    # kept in ``stalls``, not as a field: an object with over 29 attributes reads each slower
    unserved: InitVar[dict[int, set[str]] | None] = None

    def __post_init__(self, unserved: dict[int, set[str]] | None) -> None:
        self.missing: set[int] = set(range(self.n_chunks)) - set(self.have)
        self.holders: dict[int, set[str]] = {i: set() for i in self.missing}
        self.peer_chunks: dict[str, set[int]] = {}
        self.inflight: dict[int, dict[str, float]] = {}
        self._starts: dict[tuple[int, str], float] = {}  # the same requests, oldest first
        self._last_start = -math.inf
        self._unordered = False  # a request started before an older one: times went back
        self.peer_inflight: dict[str, set[int]] = {}
        self.banned: set[str] = set()
        self.stats: dict[str, PeerStats] = {}
        self.busy_until: dict[str, float] = {}
        self.owed: set[str] = set()  # peers whose uplink few others can use (PeerHad.owed)
        self._n_inflight = 0
        c = self.config
        self.pushes = PushWait(c.min_request_timeout_s, c.timeout_factor, c.score_alpha)
        self._chunk_time: float | None = None  # EWMA of request-to-verified seconds
        self._chunk_bytes = float(self.chunk_bytes or 1)  # mean size of those verified
        self._depths: dict[str, tuple[int, int]] = {}  # (depth, run), until inputs move
        self._open: set[str] = set()  # peers with fewer requests in flight than their depth
        self._samples = 0
        self._done_reported = False
        self._orphans: set[int] = set(self.missing)  # missing chunks no usable peer holds
        self._stuck_since: float | None = None  # orphans and no progress since then
        self._stall_reported = False
        missing = self.missing
        # due chunks: when each stalls; the peers without standing for a chunk (``unserved``)
        self.stalls = StallClocks(
            c.stall_timeout_s,
            c.timeout_factor,
            {i: p for i, p in (unserved or {}).items() if i in missing},
        )
        salt = self.config.seed.to_bytes(8, "little", signed=True)
        self._tiebreak = {
            i: hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8, salt=salt).digest()
            for i in self.missing
        }

    # ------------------------------------------------------------ queries

    @property
    def complete(self) -> bool:
        return not self.missing

    def requests_in_flight(self) -> int:
        return self._n_inflight

    def next_timer(self, now: float) -> float | None:
        """When the scheduler next needs a :class:`TimerFired`: the oldest request's timeout,
        the end of a busy peer's back-off, or a stall deadline (``None``: only news helps)."""
        times = [t for t in self.busy_until.values() if t > now]
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
        actions: list[Action] = []
        if isinstance(event, PeerHad):
            self._peer_had(event.peer, event.indices, event.rtt_s, event.owed, now)
            self.pushes.claimed(event.peer, event.indices, now)
        elif isinstance(event, PeerPushes):
            self._promised(event.peer, event.indices & self.missing, now)
        elif isinstance(event, PeerLost):
            actions += self._forget_peer(event.peer)
        elif isinstance(event, ChunkVerified):
            actions += self._verified(event, now)
        elif isinstance(event, ChunkCorrupted):
            actions += self._ban(event.peer, f"served chunk {event.index} failing its hash")
        elif isinstance(event, ChunkFailed):
            actions += self._failed(event.peer, event.index)
        elif isinstance(event, PeerBusy):
            if self._drop_request(event.peer, event.index) is not None:
                self.busy_until[event.peer] = now + self.config.busy_backoff_s
        elif isinstance(event, TimerFired):
            actions += self._timeouts(now)
        elif isinstance(event, ChunkMoving):  # the same requests stay in flight: nothing to do
            self._moving(event, now)
            return actions
        return actions + self._schedule(now) + self._stalled(now)

    def _peer_had(
        self,
        peer: str,
        indices: frozenset[int],
        rtt: float | None,
        owed: bool = False,
        now: float = 0.0,
    ) -> None:
        if peer in self.banned:
            return
        if owed:
            self.owed.add(peer)
        stats = self.stats.setdefault(peer, PeerStats())
        if rtt is not None:
            stats.rtt_sample(rtt)
            self._depths.pop(peer, None)
        self._recount(peer)
        known = self.peer_chunks.setdefault(peer, set())
        clocks = self.stalls
        unserved = clocks.unserved
        for i in indices:
            if i in self.holders and i not in known:
                if unserved and peer in unserved.get(i, ()):
                    continue  # it claimed this chunk before and did not serve it
                holders = self.holders[i]
                if (not holders and i in clocks.started) or i in clocks.overtime:
                    clocks.claimed(i, peer, not holders, now)  # else it changes no clock
                known.add(i)
                holders.add(peer)
                if i in self._orphans:
                    self._orphans.discard(i)
                    self._progress()  # a source appeared for a chunk that had none

    def _promised(self, pusher: str, indices: frozenset[int], now: float) -> None:
        """Wait for ``indices`` from ``pusher``; a chunk some peer already holds counts as
        claimed from now (else a promise made after the have-maps would never fall due)."""
        if pusher in self.banned:
            return
        self.pushes.expect(pusher, indices, now)
        for peer, chunks in self.peer_chunks.items():
            self.pushes.claimed(peer, chunks & indices, now)

    def _unhold(self, peer: str, index: int) -> None:
        """``peer`` no longer counts as holding ``index`` (it left, failed, was banned)."""
        holders = self.holders.get(index)
        if holders is None:
            return
        holders.discard(peer)
        if not holders:
            self._orphans.add(index)

    def _forget_peer(self, peer: str) -> list[Action]:
        for i in self.peer_chunks.pop(peer, set()):
            self._unhold(peer, i)
        cancelled: list[Action] = [PushStopped(peer)] if self.pushes.drop(peer) else []
        for i in list(self.peer_inflight.get(peer, ())):
            self._drop_request(peer, i)
            cancelled.append(CancelRequest(peer, i))
        self.peer_inflight.pop(peer, None)
        self._open.discard(peer)
        self.owed.discard(peer)
        return cancelled

    def _drop_request(self, peer: str, index: int) -> float | None:
        started = self.inflight.get(index, {}).pop(peer, None)
        if started is None:
            return None
        self.stalls.ended(index)  # past the limit: was this its last request in time?
        del self._starts[(index, peer)]
        if not self.inflight[index]:
            del self.inflight[index]
        self.peer_inflight[peer].discard(index)
        self._n_inflight -= 1
        self._recount(peer)
        return started

    def _verified(self, ev: ChunkVerified, now: float) -> list[Action]:
        started = self._drop_request(ev.peer, ev.index)
        stats = self.stats.setdefault(ev.peer, PeerStats())
        if started is not None:
            self._measure(ev, stats, started, now)
        stats.verified += 1
        self.pushes.arrived(ev.peer, ev.index, now)
        if ev.index not in self.missing:
            return []
        self.missing.discard(ev.index)
        self._orphans.discard(ev.index)
        self.stalls.delivered(ev.index, now)
        self._progress()
        for peer in self.holders.pop(ev.index, ()):  # have-maps keep only what is still missing
            self.peer_chunks[peer].discard(ev.index)
        losers = list(self.inflight.get(ev.index, {}))
        for peer in losers:  # endgame: the other copies are no longer needed
            self._drop_request(peer, ev.index)
        return [CancelRequest(p, ev.index) for p in losers]

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
        # forwarder) starts at 30% of it: a shallower pipeline there at first. Taking it whole
        # measured worse for the last peer (1,000 peers at 20 ms, seeds 1 / 2: x1.402 / 1.396
        # against 1.384 / 1.374; the median 0.01 better; simulations/README.md, "A download
        # that starts from the last one's measurements").
        stats.throughput = rate if not stats.verified else a * rate + (1 - a) * stats.throughput
        stats.last_delivery = now
        self._samples += 1
        stats.rtt_sample(took)
        self._depths.pop(ev.peer, None)
        mean = self._chunk_bytes + (ev.nbytes - self._chunk_bytes) / self._samples
        if mean == self._chunk_bytes:
            self._recount(ev.peer)
            return
        self._chunk_bytes = mean  # every depth is counted in chunks of this size
        self._depths.clear()
        for peer in self.stats:
            self._recount(peer)

    def _failed(self, peer: str, index: int) -> list[Action]:
        if self._drop_request(peer, index) is None:
            return []
        # A peer that cannot serve a chunk it claimed no longer counts as holding it.
        self.peer_chunks.get(peer, set()).discard(index)
        self._unhold(peer, index)
        self.stats.setdefault(peer, PeerStats()).failures += 1
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
                stalled = self._orphans | (stalled or set())
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
            chunks = self.peer_chunks.get(peer)
            if chunks is not None:
                chunks.discard(index)
            self._unhold(peer, index)
        return peers

    def _timeouts(self, now: float) -> list[Action]:
        actions: list[Action] = [PushStopped(peer) for peer in self.pushes.expire(now)]
        soft = self._timeout_limit()
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
            self.stats.setdefault(peer, PeerStats()).failures += 1
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
        depth, run = self._depth_run(peer)
        if len(self.peer_inflight.get(peer, ())) + min(run, depth) <= depth:
            self._open.add(peer)
        else:
            self._open.discard(peer)

    def _depth_run(self, peer: str) -> tuple[int, int]:
        """``peer``'s depth and run (``PeerStats.depth``, ``PeerStats.run``)."""
        cached = self._depths.get(peer)
        if cached is None:
            stats, size = self.stats[peer], self._chunk_bytes
            run = stats.run(size, self.config) if self.chunk_bytes else 1
            cached = self._depths[peer] = (stats.depth(size, self.config, run), run)
        return cached

    def _full(self, peer: str) -> bool:
        """No room left at ``peer``: a peer opens once a whole run has room (``_recount``)
        and is then asked until it is full, so its requests leave together (one request)."""
        return len(self.peer_inflight.get(peer, ())) >= self._depth_run(peer)[0]

    def _best_peer(self, index: int, free: set[str], exclude: Iterable[str] = ()) -> str | None:
        candidates = (self.holders.get(index, set()) & free).difference(exclude)
        if not candidates:
            return None
        load, stats, owed = self.peer_inflight, self.stats, self.owed
        return max(
            candidates,
            key=lambda p: (
                p in owed and not stats[p].failures,
                stats[p].score() / (1 + len(load.get(p, ()))),
                p,
            ),
        )

    def _free_peers(self, now: float) -> set[str]:
        busy = self.busy_until
        chunks = self.peer_chunks
        return {
            p
            for p in self._open
            if chunks.get(p) and busy.get(p, 0.0) <= now and p not in self.banned
        }

    def _request(self, peer: str, index: int, now: float) -> RequestChunk:
        self.stalls.asked(index, peer, now)
        self.inflight.setdefault(index, {})[peer] = now
        self._starts.pop((index, peer), None)
        self._starts[(index, peer)] = now
        self._unordered |= now < self._last_start
        self._last_start = now
        self.peer_inflight.setdefault(peer, set()).add(index)
        self._n_inflight += 1
        self._recount(peer)
        return RequestChunk(peer, index)

    def _schedule(self, now: float) -> list[Action]:
        if not self.missing:
            if self._done_reported:
                return []
            self._done_reported = True
            return [DownloadCompleted()]
        budget = self.config.max_requests_total - self._n_inflight
        if budget <= 0:
            return []
        free = self._free_peers(now)
        out: list[Action] = []
        if free and len(self.inflight) < len(self.missing):
            for i in self._rarest_first(free, budget):
                if budget <= 0 or not free:
                    return out
                lagging = self.pushes.lagged.get(i, "")  # its pusher: the last resort
                peer = self._best_peer(i, free, (lagging,)) or self._best_peer(i, free)
                if peer is not None:
                    out.append(self._request(peer, i, now))
                    budget -= 1
                    if self._full(peer):
                        free.discard(peer)
        if len(self.inflight) < len(self.missing):
            return out  # not endgame yet: some missing chunk still waits for a source
        return out + self._endgame(now, budget, free)

    def _rarest_first(self, free: set[str], budget: int) -> list[int]:
        """Missing, unrequested chunks some free peer holds, rarest first (have-maps hold only
        missing chunks, so this costs what the free peers offer, not the whole payload)."""
        cands: set[int] = set()
        for p in free:
            cands.update(self.peer_chunks[p])
        cands.difference_update(self.inflight)
        cands.difference_update(self.pushes.pusher)  # on their way unasked
        holders, tiebreak = self.holders, self._tiebreak

        def rarity(i: int) -> tuple[int, bytes]:
            return len(holders[i]), tiebreak[i]

        if budget == 1 and cands:
            return [min(cands, key=rarity)]
        return sorted(cands, key=rarity)

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
            peer = self._best_peer(i, free, exclude=self.inflight[i])
            if peer is not None:
                out.append(self._request(peer, i, now))
                budget -= 1
                if self._full(peer):
                    free.discard(peer)
        return out
