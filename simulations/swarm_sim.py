"""The swarm on a virtual clock: the real scheduler, planner and seeder, over a modelled network.

Every rollout's download is a :class:`p2p_sync.protocol.swarm.Scheduler` fed the events the node's
driver (``node/fetch.py``) would feed it; the trainer's have-map answers come from
:class:`p2p_sync.protocol.seeding.SuperSeeder`, as in ``node/trainer.py``; each download is chosen
by
:func:`p2p_sync.protocol.versions.plan`. What is modelled instead of run: the wire (``network.py``:
shared links plus a one-way latency on every message and on the last byte of every transfer)
and the node's messaging, as follows.

* Announcements: a version reaches a peer one latency per overlay hop after it is published
  (announcements are relayed by every node), plus one round trip to fetch the manifest; the
  peer asks its have-map questions when it hears the digest, during that round trip
  (``p2p_sync.runtime.early``), and its download starts with their answers and takes their feeds
  over. The
  trainer's followers (rollouts that follow it: they fetched from it before, the steady state
  of a running swarm) get its announcement pushed instead, carrying the manifest inline and
  the chunks the trainer hands each one (``p2p_sync.runtime.learning``: its first have-map answer
  without
  a question): a transfer of ``MANIFEST_BYTES_PER_CHUNK`` bytes per chunk (packed) over the
  trainer's uplink, then one latency, and the follower requests its chunks at once, but for
  the first few of them: those follow the manifest on the same connection (the node's framed
  announcement), one after another, each landing a latency after its last byte left, and the
  download waits for them (``PeerPushes``) instead of asking. How many: the node's rule
  (``seeding.chunks_behind``: a round trip's worth of the trainer's uplink, one chunk per
  follower first, at most ``push_chunks`` each) with the round trip and rate its trainer
  measured in the versions before (a running swarm).
* Have-maps: a downloading peer subscribes to each neighbour's have-map for the artifact (the
  node's have feed, ``GET /have?feed=1``); the answer comes after a round trip, and from then
  on the neighbour pushes each newly verified chunk, coalesced while a push is on its way (one
  latency), as the feed writes each answer on the open response. The news a follower gets
  within one decision window (``Scenario.decision_window_ms``, 1 ms), and the chunks that
  land there in that window, are taken in one scheduling decision at its end, as the node's
  driver takes the events that queued up while its loop was busy
  (``Scheduler.handle_many``); a chunk is kept and announced as it lands. One decision per
  item made the scheduler most of a run's cost.
* Requests: the chunks one scheduler step asks of one public peer go in one request (a run:
  ``SwarmConfig.request_bytes``, the node's ``/chunks``), which arrives after one latency. The
  serving node serves the run up to the first chunk it lacks (that one is ``ChunkFailed``; the
  requester asks for the rest again, a round trip later); its
  :class:`p2p_sync.protocol.uploads.UploadSlots` (the data plane's own) serve the run, queue it for
  a
  slot, or refuse it as busy (``PeerBusy``). Its chunks stream over the network model one
  after another on one slot, and the receiver checks each as it lands (``ChunkVerified`` or,
  from a corrupt peer, ``ChunkCorrupted``). A chunk cancelled while its bytes flow still flows
  (the node's connection carries the rest of the run); the run ends once nothing in it is
  wanted.
* Private swarms (``private``): the HTTP data plane runs over mutual TLS. TCP's round trip is
  paid open or private alike and is left out of both (as everywhere here); TLS 1.3's full
  handshake is one more round trip before an ordered pair's first HTTP message over a new
  connection (a request, a have feed, an early question, the trainer's announcement, a
  forwarded chunk); what the pair sends before the handshake completes waits for it
  (parallel connections handshake in parallel). A node keeps its TLS connections a training
  step and more (``warm_connections``): every pair that follows the other (the trainer and
  its followers too) starts a version handshaken, as do pairs that met in earlier versions,
  until one of the two leaves; without it every pair handshakes again each version. Messages
  to and from NATed peers go over libp2p, which runs Noise in open swarms too: no change there.
* Churn, adversaries: see ``scenario.py``.
* Where the time went (:class:`Lag`, the report's ``lag_s``): each honest peer's completion
  beyond the payload at its downlink's rate, split at its first chunk and at the moment the
  swarm first held every chunk. Measured this way, a swarm whose links all match the
  trainer's (the 1,000-peer scenarios) can never make up time it lost: no peer fetches
  faster than the trainer publishes, so a late start stays a backlog to the end.
* Push trees (``push_tree``, a dissemination the node does not run yet): see ``pushtree.py``.
  Each rollout subscribes to its parent of every stripe (one latency), which then streams it
  the stripe's chunks, one at a time, as it gets them; the download is told with
  :class:`p2p_sync.protocol.swarm.PeerPushes` and pulls whatever the stream fails to bring.

Overlay: a near-regular random graph in which every rollout has ``min(max_peers,
download.max_sources)`` neighbours (a node's peer list fills up through peer exchange, and a
download follows ``max_sources`` of them, in a random order of its own); the trainer serves
``trainer_peers`` random rollouts.

NAT (``nat_fraction``): a NATed rollout cannot be dialed, so it dials ``min(max_peers,
max_sources)`` public rollouts itself (the public ones are wired among themselves first, as
above). A connection carries requests both ways (libp2p streams on the connection the NATed
peer opened), so an edge is used in both directions whoever opened it. Two NATed peers connect
only if both are "punchable" (``punch_fraction`` of the NATed ones: behind NATs that DCUtR hole
punching gets through): such peers, once wired to public ones, fill their lists up to the same
``want`` with each other, over direct connections (a long-running swarm: they met through a
relay and punched earlier). Relaying traffic through a public peer is not modelled (it would
cost the relay its uplink and downlink both), so other NAT-NAT pairs exchange nothing. A public
rollout accepts inbound connections until it has ``max_peers`` neighbours (its peer list's
bound, the node's ``directory.max_peers``): beyond that a NATed peer dials another one, and
when every public peer is full it makes do with fewer. A rollout with more neighbours than
``max_sources`` follows (subscribes to, fetches from) ``max_sources`` of them plus the trainer,
as the node's download driver does, its NATed neighbours first (``_follows`` says why: this is
what the NAT-aware node must do too); the others still follow it. A rollout that the overlay
left with no neighbour at all (``nat_fraction = 1``: only the trainer is reachable) connects to
the trainer, on top of ``trainer_peers``. ``served`` counts the chunks each (uploader,
requester) pair started, so tests can check that no NAT-NAT pair ever carried one.
"""

from __future__ import annotations

import random
import sys
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from p2p_sync.protocol import sourcing
from p2p_sync.protocol.schedule_events import (
    Action,
    CancelRequest,
    ChunkCorrupted,
    ChunkFailed,
    ChunkMoving,
    ChunkVerified,
    DownloadCompleted,
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
from p2p_sync.protocol.seeding import SuperSeeder, chunks_behind
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.uploads import Admission, UploadSlots
from p2p_sync.protocol.versions import PATCH, Artifact, PeerState, plan
from p2p_sync.transport.limits import HttpLimits
from simulations.clock import Clock
from simulations.fastclock import FastClock
from simulations.fastnet import FastNetwork, Flow
from simulations.network import Network, Transfer
from simulations.pushtree import TreeLayout
from simulations.scenario import Scenario

TRAINER = 0
HONEST, CORRUPT, STALL, LIAR = "honest", "corrupt", "stall", "liar"
HAVE_WAIT_S = HttpLimits().have_wait_s  # a have feed quiet this long ends (asked again)
# a signed manifest as pushed (packed in the framed announcement, transport.dataplane.
# pack_manifests): 34 B a chunk (measured: 26,131 B for 763 chunks, 51,696 B for 1,526; the
# JSON text: 72 B a chunk; the earlier base64 form in the JSON: 46 B)
MANIFEST_BYTES_PER_CHUNK = 34
MBPS = 1e6 / 8  # bytes/s in one Mbit/s
V = TypeVar("V")


@dataclass(eq=False)
class Run:
    """Chunks one request asks of one peer, served one after another on one upload slot (the
    node's ``/chunks``; a run of one is ``/chunk``)."""

    requester: int
    source: int
    indices: list[int]  # not served yet, in the order asked
    gen: int  # the requester's download generation
    current: int | None = None  # the chunk whose bytes flow now
    transfer: Transfer | Flow | None = None  # and its transfer


@dataclass
class Peer:
    idx: int
    role: str
    uplink: float
    downlink: float
    slots: UploadSlots[Run]  # its uploads
    uploaded: Counter[tuple[str, int]] = field(default_factory=Counter)  # chunks it uploaded
    neighbors: set[int] = field(default_factory=set)
    nat: bool = False  # behind NAT: reachable only over connections it opened itself
    punchable: bool = False  # behind NAT, and hole punching gets through it
    follows: set[int] = field(default_factory=set)  # the neighbours its downloads follow
    online: bool = True
    silent_crash: bool = False
    state: PeerState = field(default_factory=PeerState)
    have: dict[str, set[int]] = field(default_factory=dict)
    sched: Scheduler | None = None
    artifact: Artifact | None = None
    requests: dict[tuple[int, int], Transfer | Flow | None] = field(default_factory=dict)
    runs: dict[tuple[int, int], Run] = field(default_factory=dict)  # each request's run
    subscribers: set[int] = field(default_factory=set)
    quiet: set[int] = field(default_factory=set)  # subscribers no news from it is on its way to
    news: dict[str, list[int]] = field(default_factory=dict)  # chunks it announced, in order
    banned: set[int] = field(default_factory=set)
    generation: int = 0  # bumped whenever a download starts or dies: stale events are dropped
    timer_at: float | None = None  # when the scheduler's next TimerFired is due
    metering: bool = False  # a look at its transfers' bytes is due (``SwarmSim._meter``)
    done_at: float | None = None
    pushed: bool = False  # the trainer pushed this version's news and its offer to it
    pushing: frozenset[int] = frozenset()  # and sent these chunks behind it
    # have feeds asked while the manifest of ``early_art`` came (``p2p_sync.runtime.early``):
    # answers
    # kept until the download starts (None: none kept now), and whom they asked
    early: dict[int, set[int]] | None = None
    early_art: Artifact | None = None
    early_asked: set[int] = field(default_factory=set)
    # where its time went this version (``Lag``): when its first new chunk landed, the
    # bytes of new chunks it holds, and those it held when the swarm first held every chunk
    first_at: float | None = None
    got_bytes: float = 0.0
    got_at_full: float = 0.0
    # this version's time offline before it finished (churn), and when it last left
    away: float = 0.0
    left_at: float | None = None


@dataclass(frozen=True)
class Lag:
    """Where one honest peer's time went in a version, beyond ``F / d`` (the payload at its
    downlink's rate, what it would take were its downlink never idle): seconds its downlink
    did not carry a new chunk of the version, in three phases split by the moment its first
    new chunk landed and the moment the honest swarm first held every chunk (the trainer's
    last fresh chunk at its first holder). ``start`` is everything before its first chunk
    (the announcement, manifest, have-maps, request and first byte); ``filling`` is lost
    while chunks were still coming from the trainer (no new chunk it could fetch in reach,
    downtime, duplicates, corrupt bytes, a downlink shared with a churned source's cut
    transfers); ``tail`` is lost after that (the last chunks spreading, the endgame). The
    three add up to its completion time minus ``F / d`` exactly."""

    start: float
    filling: float
    tail: float


@dataclass
class VersionResult:
    version: int
    lower_bound_s: float
    star_time_s: float
    completion_s: list[float]
    converged: int
    honest: int
    trainer_upload_bytes: float
    received_bytes: float
    useful_bytes: float
    churned: int
    stayed_online_last_s: float  # last honest peer among those that did not churn
    own_bound_ratio: float  # worst honest peer against its own bound (``own_bound``; inf: not all)
    nat_bound_s: float  # the lower bound once NATed peers can fetch only from public ones
    last_nat_s: float  # last honest NATed peer (nan: none)
    last_public_s: float  # last honest public rollout (nan: none)
    full_s: float = float("nan")  # when the honest swarm first held every chunk (nan: never)
    lags: list[Lag] = field(default_factory=list)  # per converged honest peer, in finish order


@dataclass
class Ban:
    by: int
    peer: int
    role: str
    reason: str


class SwarmSim:
    """One scenario's swarm. :meth:`run_version` publishes and distributes one version."""

    def __init__(
        self,
        scenario: Scenario,
        progress: Callable[[int, int, int, float], None] | None = None,
        reference_network: bool = False,
    ) -> None:
        self.sc = scenario
        self.chunk_bytes = scenario.chunk_bytes  # read for every chunk: worked out once
        self.seed_keys: dict[str, tuple[tuple[str, int], ...]] = {}  # ``_seed_keys``
        self.rng = random.Random(scenario.seed)
        # the compiled clock and bandwidth model, unless asked for the reference or slow start
        # needs it (the two give the same events, bit for bit)
        compiled = not (reference_network or scenario.slow_start)
        self.clock: Clock | FastClock = FastClock() if compiled else Clock()
        self.lat = scenario.latency_ms / 1000
        self.window = scenario.decision_window_s  # news and chunks: one decision a window
        # private swarms: when each ordered pair's TLS handshake completes (or completed)
        self.handshaken: dict[tuple[int, int], float] = {}
        self.peers = self._make_peers()
        self.net = self._network()
        self._wire_overlay()
        self._warm_connections()
        self.depth = self._depths()
        self.seeder = SuperSeeder.of(scenario)
        self.artifacts: list[Artifact] = []
        self.pending_have: dict[tuple[int, int], set[int]] = {}
        # (announcer, follower): the news on its way, the announcer's log from (artifact, index)
        self.news_from: dict[tuple[int, int], tuple[str, int]] = {}
        # (follower, when): whose news, and the chunks that landed (with the generation)
        self.inbox: dict[tuple[int, float], list[int | tuple[int, Event]]] = {}
        self.served: dict[tuple[int, int], int] = {}  # (uploader, requester): chunks started
        self.requests_sent = 0  # requests (runs of chunks) sent by every rollout
        self.chunks_requested = 0  # the chunks they named
        self.bans: list[Ban] = []
        self.results: list[VersionResult] = []
        self.progress = progress
        self.honest = [p for p in self.peers[1:] if p.role == HONEST]
        self._remaining = 0
        self.tree: TreeLayout | None = None  # push_tree: this version's layout
        self.tree_children: dict[tuple[int, int], set[int]] = {}  # (parent, stripe) -> kids
        self.streams: dict[tuple[int, int], dict[int, None]] = {}  # (parent, child): to push
        self.pushing: set[tuple[int, int]] = set()  # streams with a chunk on the wire
        self.pushed_chunks = 0  # verified chunks that reached an honest rollout pushed
        self.sent_behind = 0  # chunks the trainer sent behind its announcements
        # (forwarder, receiver) -> chunks forwarded, named in the next have news as pushed
        self.promised: dict[tuple[int, int], set[int]] = {}
        self.published_at = 0.0
        self._unheld: set[int] = set()  # this version's chunks no honest rollout holds yet
        self.full_at: float | None = None  # when the last of them landed (``Lag``)

    # ------------------------------------------------------------ set-up

    def _make_peers(self) -> list[Peer]:
        """The trainer (index 0) and the rollouts, with roles, links and NAT drawn from the
        seed (NAT last, and only when asked for, so scenarios without it draw as before)."""
        sc, rng, n = self.sc, self.rng, self.sc.peers
        slots = list(range(n))
        adversaries = ((CORRUPT, sc.corrupt_fraction), (STALL, sc.stall_fraction))
        roles = _spread(rng, slots, (*adversaries, (LIAR, sc.liar_fraction)), HONEST)
        classes = tuple(((c.uplink_mbps, c.downlink_mbps), c.fraction) for c in sc.links)
        links = _spread(rng, slots, classes, (sc.uplink_mbps, sc.downlink_mbps))
        nat = [False] * n
        if sc.nat_fraction > 0:
            nat = _spread(rng, slots, ((True, sc.nat_fraction),), False)
        punch = [False] * n
        if sc.punch_fraction > 0:  # only then: scenarios without it draw as before
            nated = [i for i in range(n) if nat[i]]
            draw = _spread(rng, list(range(len(nated))), ((True, sc.punch_fraction),), False)
            for i, ok in zip(nated, draw):
                punch[i] = ok
        queue = sc.upload_queue
        trainer_slots = UploadSlots(sc.trainer_uploads, queue)
        trainer = Peer(TRAINER, "trainer", sc.trainer_uplink_mbps * MBPS, 1e12, trainer_slots)
        state0 = PeerState(0, "s0")
        trainer.state = state0
        rollouts = [
            Peer(
                i + 1,
                roles[i],
                links[i][0] * MBPS,
                links[i][1] * MBPS,
                UploadSlots(sc.max_concurrent_uploads, queue),
                nat=nat[i],
                punchable=punch[i],
                state=state0,
            )
            for i in range(n)
        ]
        return [trainer, *rollouts]

    def _network(self) -> Network | FastNetwork:
        up, down = [p.uplink for p in self.peers], [p.downlink for p in self.peers]
        if isinstance(self.clock, FastClock):
            return FastNetwork(self.clock, up, down)
        return Network(self.clock, up, down, 2 * self.lat, self.sc.slow_start)

    def _wire_overlay(self) -> None:
        """Public rollouts among themselves, then NATed ones onto public ones, then the
        trainer's (see the module docstring); then whom each rollout follows."""
        sc, rng, n = self.sc, self.rng, len(self.peers)
        want = min(sc.max_peers, sc.download.max_sources, n - 2)
        public = [p.idx for p in self.peers[1:] if not p.nat]
        self._wire_public(public, min(want, len(public) - 1))
        nat = [p.idx for p in self.peers[1:] if p.nat]
        if nat:
            self._wire_nat(nat, public, min(want, len(public)), max(sc.max_peers, want))
        # punched connections fill the lists of punchable NATed peers that public ones left short
        short = [p.idx for p in self.peers[1:] if p.punchable and len(p.neighbors) < want]
        self._wire_public(short, want)
        for q in rng.sample(range(1, n), min(self.sc.trainer_peers, n - 1)):
            self._connect(TRAINER, q)
        for p in self.peers[1:]:
            if not p.neighbors:  # nobody else reachable: its source still is
                self._connect(TRAINER, p.idx)
        for p in self.peers[1:]:
            p.follows = self._follows(p, want)

    def _connect(self, a: int, b: int) -> None:
        self.peers[a].neighbors.add(b)
        self.peers[b].neighbors.add(a)

    def _wire_public(self, members: list[int], want: int) -> None:
        """A near-regular random graph of degree ``want`` on ``members`` (a node learns peers
        through peer exchange until its list is full, so every node ends up with a full list)."""
        rng = self.rng
        open_ = members[:]  # rollouts with room for another neighbour
        order = open_[:]
        rng.shuffle(order)
        for p_idx in order:
            p = self.peers[p_idx]
            for _ in range(4 * want):  # bounded: a few unlucky draws leave a node one short
                if len(p.neighbors) >= want or len(open_) < 2:
                    break
                k = rng.randrange(len(open_))
                q_idx = open_[k]
                q = self.peers[q_idx]
                if q_idx == p_idx or q_idx in p.neighbors:
                    continue
                self._connect(p_idx, q_idx)
                if len(q.neighbors) >= want:
                    open_[k] = open_[-1]
                    open_.pop()
            if p_idx in open_ and len(p.neighbors) >= want:
                open_.remove(p_idx)

    def _wire_nat(self, nat: list[int], public: list[int], want: int, accept: int) -> None:
        """NATed rollouts dial public rollouts that still accept a connection (fewer than
        ``accept`` neighbours), one each per round in a random order, until each has ``want``:
        when public peers run out of room, every NATed peer ends up with about as many (all
        of them dial at once in a real swarm; one after another, the first would take it all)."""
        rng, peers = self.rng, self.peers
        open_ = [q for q in public if len(peers[q].neighbors) < accept]
        order = nat[:]
        rng.shuffle(order)
        for _ in range(want):
            for p_idx in order:
                p = peers[p_idx]
                for _ in range(8):  # bounded: a few unlucky draws leave a node one short
                    if not open_:
                        return
                    k = rng.randrange(len(open_))
                    if open_[k] not in p.neighbors:
                        break
                else:
                    continue
                self._connect(p_idx, open_[k])
                if len(peers[open_[k]].neighbors) >= accept:
                    open_[k] = open_[-1]
                    open_.pop()

    def _follows(self, p: Peer, want: int) -> set[int]:
        """The neighbours ``p``'s downloads follow: all of them, or, for a public peer that
        accepted more connections than ``max_sources``, the node's rule
        (``protocol.sourcing``): every NATed neighbour (nobody else can reach them, while
        public peers are reachable by all: ``owed`` sources), then random public ones up to
        ``want``, and the trainer. Following a random ``want``
        instead leaves public uplink on public peers and NATed uplink idle (100 peers, 20 ms,
        half NATed: x1.84 of the bound against x1.57), and a NATed peer none of its
        neighbours follows holds the chunks the trainer super-seeded to it until the seeder
        shows them to others again (``SuperSeeder.starve_after_s``, 10 s: a swarm's whole run
        at these sizes; Hypothesis found such a swarm of 24)."""
        rollouts = sorted(p.neighbors - {TRAINER})
        if len(rollouts) <= want:
            return p.neighbors
        nat = [q for q in rollouts if self.peers[q].nat]
        public = [q for q in rollouts if not self.peers[q].nat]
        drawn = self.rng.sample(public, max(0, want - len(nat)))  # the public ones it prefers
        rank = {q: i for i, q in enumerate(drawn)}
        trainer = p.neighbors & {TRAINER}  # followed on top of ``want``
        order = sourcing.follow_order(
            sorted(p.neighbors),
            lambda q: q == TRAINER,
            lambda q: self.peers[q].nat,
            lambda q: rank.get(q, len(drawn)),
        )
        pick = sourcing.followed(order, want + len(trainer), lambda q: self._owed(p, q))
        return {q for q in pick if q != TRAINER} | trainer

    def _depths(self) -> list[int]:
        depth = [-1] * len(self.peers)
        depth[TRAINER] = 0
        queue = deque([TRAINER])
        while queue:
            p = queue.popleft()
            for q in self.peers[p].neighbors:
                if depth[q] < 0:
                    depth[q] = depth[p] + 1
                    queue.append(q)
        return depth

    # ------------------------------------------------------------ bounds

    def bounds(self) -> tuple[float, float]:
        """(Kumar-Ross lower bound, star time) for one payload to every honest rollout."""
        f, us = self.sc.payload_bytes, self.peers[TRAINER].uplink
        n = len(self.honest)
        d_min = min(p.downlink for p in self.honest)
        total_up = us + sum(p.uplink for p in self.honest)
        return max(f / us, f / d_min, n * f / total_up), max(n * f / us, f / d_min)

    def nat_bound(self, bound: float) -> float:
        """``bound`` once NATed peers can fetch only from public ones (or, punchable ones, from
        each other): the honest NATed rollouts that no punch reaches need their payloads from
        the trainer's and the public honest rollouts' uplinks alone."""
        us, f = self.peers[TRAINER].uplink, self.sc.payload_bytes
        nat = sum(p.nat and not p.punchable for p in self.honest)
        public_up = sum(p.uplink for p in self.honest if not p.nat)
        return max(bound, nat * f / (us + public_up))

    # ------------------------------------------------------------ a version

    def run_version(self, version: int) -> VersionResult:
        """Publish ``version`` and run until every honest rollout has it or the time limit (in
        lower bounds, the NAT-aware one: NAT can make the physics slower) passes."""
        clock = self.clock
        bound, star = self.bounds()
        nat_bound = self.nat_bound(bound)
        t0 = clock.now
        self.net.idle_restart()  # a training step apart: longer than any RTO
        if not self.sc.warm_connections:  # a step longer than the client's keep-alive
            self.handshaken.clear()
        self._publish(version)
        if self.sc.push_tree:
            self.tree = TreeLayout.build([p.idx for p in self.peers[1:]], self.rng)
            self.tree_children.clear()
            self.streams.clear()
            self.pushing.clear()
        up0, rx0 = self._trainer_sent_honest_received()
        self._remaining = 0
        behind = self._behind()
        self._unheld, self.full_at = set(range(self._n_chunks(self.artifacts[-1]))), None
        for p in self.honest:
            p.done_at, p.pushed = None, False
            p.early, p.early_art, p.early_asked = None, None, set()
            p.first_at, p.got_bytes, p.got_at_full = None, 0.0, 0.0
            p.away, p.left_at = 0.0, None
            self._remaining += 1
            if TRAINER in p.follows:
                announce = partial(self._announce_to, p, self.artifacts[-1], behind.get(p.idx, 0))
                wait = self._handshake(TRAINER, p.idx)
                clock.after(wait, announce) if wait else announce()
            else:  # hears the digest, asks its peers' have-maps and the manifest at once
                heard = t0 + self.lat * max(self.depth[p.idx], 1)
                clock.at(heard, self._hear, p, self.artifacts[-1])
                clock.at(heard + 2 * self.lat + self._manifest_handshake_s, self._learn, p)
        churned = {p.idx for p in self._schedule_churn(t0, bound)}
        self._run(version, t0 + self.sc.time_limit_factor * nat_bound, bound)
        up, rx = self._trainer_sent_honest_received()
        up, rx = up - up0, rx - rx0
        result = self._result(version, t0, (bound, star, nat_bound), churned, (up, rx))
        self._settle_version()
        self.results.append(result)
        return result

    def _trainer_sent_honest_received(self) -> tuple[float, float]:
        received = self.net.bytes_received
        return self.net.bytes_sent[TRAINER], sum(received[p.idx] for p in self.honest)

    def _publish(self, version: int) -> None:
        """The trainer stores the patch from ``version - 1`` to ``version``: all its chunks."""
        art = Artifact(
            version,
            PATCH,
            version - 1,
            f"s{version - 1}",
            f"s{version}",
            self.sc.payload_bytes,
            ident=f"v{version}",
        )
        self.artifacts.append(art)
        self.published_at = self.clock.now
        self.peers[TRAINER].have[art.ident] = set(range(self._n_chunks(art)))
        self.peers[TRAINER].state = PeerState(version, art.target_state)

    def _run(self, version: int, deadline: float, bound: float) -> None:
        every = None
        if self.progress is not None:
            progress, t0 = self.progress, self.published_at

            def every() -> None:
                done = len(self.honest) - self._remaining
                progress(version, done, len(self.honest), (self.clock.now - t0) / bound)

        self.clock.run(lambda: self._remaining == 0, deadline, 200_000_000, every)

    def _result(
        self,
        version: int,
        t0: float,
        bounds: tuple[float, float, float],
        churned: set[int],
        up_rx: tuple[float, float],
    ) -> VersionResult:
        """The version's figures: ``bounds`` (Kumar-Ross, star, NAT-aware), ``up_rx`` (the
        trainer's upload, the honest rollouts' download) and when each honest peer finished."""
        took = {p.idx: p.done_at - t0 for p in self.honest if p.done_at is not None}
        done = sorted((p for p in self.honest if p.done_at is not None), key=lambda p: p.done_at)
        stayed = [t for idx, t in took.items() if idx not in churned]
        kind = {k: [t for i, t in took.items() if self.peers[i].nat is k] for k in (True, False)}
        nan = float("nan")
        return VersionResult(
            version,
            bounds[0],
            bounds[1],
            sorted(took.values()),
            len(took),
            len(self.honest),
            up_rx[0],
            up_rx[1],
            float(self.sc.payload_bytes) * len(took),
            len(churned),
            max(stayed, default=nan),
            self._own_bound_ratio(took, bounds[0]),
            bounds[2],
            max(kind[True], default=nan),
            max(kind[False], default=nan),
            nan if self.full_at is None else self.full_at - t0,
            [self._lag(p) for p in done if p.first_at is not None],
        )

    def _own_bound_ratio(self, took: dict[int, float], bound: float) -> float:
        """The worst honest peer's completion over :func:`own_bound` (inf: one never finished)."""
        if len(took) < len(self.honest):
            return float("inf")
        size = self.sc.payload_bytes
        return max(
            (
                t / own_bound(bound, size, self.peers[i].downlink, self.peers[i].away)
                for i, t in took.items()
            ),
            default=float("nan"),
        )

    def _settle_version(self) -> None:
        """Let stragglers' churn end, so the next version starts from a quiet swarm."""
        self.news_from.clear()
        for p in self.peers:
            p.news.clear()
            p.quiet = set(p.subscribers)
        for p in self.peers[1:]:
            if not p.online:
                self._rejoin(p, p.generation)
            if p.sched is not None:  # gave up on this version (time limit): drop the download
                self._drop_download(p)

    def _n_chunks(self, art: Artifact) -> int:
        return -(-art.size // self.chunk_bytes)

    def _seed_keys(self, art: Artifact) -> tuple[tuple[str, int], ...]:
        """The trainer seeder's keys for ``art``'s chunks: one tuple, so that its offers find
        the manifest's arrays without hashing every key (``SuperSeeder.offer``)."""
        keys = self.seed_keys.get(art.ident)
        if keys is None:
            keys = tuple((art.ident, i) for i in range(self._n_chunks(art)))
            self.seed_keys[art.ident] = keys
        return keys

    def _chunk_size(self, art: Artifact, index: int) -> int:
        size = self.chunk_bytes
        return min(size, art.size - index * size)

    # ------------------------------------------------------------ downloads

    def _learn(self, p: Peer) -> None:
        if p.online and p.sched is None and p.done_at is None:
            self._start_download(p)

    def _hear(self, p: Peer, art: Artifact) -> None:
        """``p`` hears of ``art`` from a relay (its digest only) and, while it fetches the
        manifest, opens have feeds to the peers its download will follow
        (``p2p_sync.runtime.early``)."""
        if not p.online or p.sched is not None or p.done_at is not None:
            return
        p.early, p.early_art = {}, art
        for q in p.neighbors:  # in the set's order, as ``_start_download``
            if q in p.follows and q not in p.banned:
                p.early_asked.add(q)
                self._message_after(self._handshake(p.idx, q), self._early_reached, p, q, art)

    def _early_reached(self, p: Peer, q_idx: int, art: Artifact) -> None:
        """The early question reaches ``q`` (which holds it until it knows the manifest: here
        it answers what it holds, as ``_subscribed``), and ``q`` follows up with news."""
        q = self.peers[q_idx]
        if not q.online or not p.online or p.early_art is not art:
            return
        self._follower(q, p.idx)
        shown = frozenset(self._visible(q, p, art))
        self._message(self._early_answer, p, q_idx, art, shown)

    def _early_answer(self, p: Peer, q_idx: int, art: Artifact, indices: frozenset[int]) -> None:
        """An early answer: kept until the download starts, or handed to it."""
        if not p.online or p.early_art is not art or q_idx in p.banned:
            return
        if p.early is not None:
            p.early.setdefault(q_idx, set()).update(indices)
        elif p.sched is not None and p.artifact is art:
            self._feed(p, PeerHad(q_idx, indices, 2 * self.lat, self._owed(p, q_idx)))

    def _behind(self) -> dict[int, int]:
        """How many chunks each follower gets behind its announcement, by the node's rule
        (``seeding.chunks_behind``) with what its trainer measures in a running swarm: a
        round trip at its uplink's rate. Over HTTP only: a NATed follower's news comes over
        libp2p, with no chunk behind it."""
        if self.sc.push_tree:  # the trees carry the trainer's chunks from the start
            return {}
        takers = [p.idx for p in self.honest if TRAINER in p.follows and not p.nat]
        budget = 2 * self.lat * self.peers[TRAINER].uplink
        counts = chunks_behind(budget, self.chunk_bytes, len(takers), self.sc.push_chunks)
        return dict(zip(takers, counts))

    def _announce_to(self, p: Peer, art: Artifact, k: int) -> None:
        """The trainer's ``POST /announce`` to a follower: the manifest, then the first ``k``
        chunks it hands it, behind the manifest on the same connection (the node's framed
        announcement: ``p2p_sync.runtime.learning``); handed out, and counted served, when the
        announcement is built, as the node's seeder does."""
        n = self._n_chunks(art)
        keys = self._seed_keys(art)
        now = self.clock.now
        behind = sorted(self.seeder.offer(keys, p.idx, now))[:k] if k else []
        for i in behind:
            self.seeder.note_served((art.ident, i), p.idx, now)
        p.pushing = frozenset(behind)
        done = partial(self._pushed, p, art, behind)
        self.net.start(TRAINER, p.idx, MANIFEST_BYTES_PER_CHUNK * n, done)

    def _pushed(self, p: Peer, art: Artifact, behind: list[int]) -> None:
        """The announcement's JSON left the trainer (``p`` reads it a latency later); the
        chunks behind it follow on the same connection."""
        if p.online and p.done_at is None and not p.pushed:
            p.pushed = True
            self._message(self._learn, p)
        self._send_behind(p, art, list(behind))

    def _send_behind(self, p: Peer, art: Artifact, rest: list[int]) -> None:
        if not rest or not p.online:
            return
        index, trainer = rest.pop(0), self.peers[TRAINER]
        trainer.uploaded[(art.ident, index)] += 1
        self.sent_behind += 1
        self.served[(TRAINER, p.idx)] = self.served.get((TRAINER, p.idx), 0) + 1

        def sent() -> None:
            event = self._checked(trainer, art, index)
            self._message(self._behind_arrived, p, art, event)
            self._send_behind(p, art, rest)

        self.net.start(TRAINER, p.idx, self._chunk_size(art, index), sent)

    def _behind_arrived(self, p: Peer, art: Artifact, event: Event) -> None:
        """A chunk behind the announcement landed (after the download started: it left the
        trainer after the JSON, which ``p`` acted on a latency after its last byte)."""
        if p.online and p.artifact is art and p.sched is not None:
            self._accept(p, art, event)

    def _start_download(self, p: Peer) -> None:
        steps = plan(p.state, self.artifacts)
        if not steps:
            self._finish(p)
            return
        art = steps[0]
        p.artifact = art
        p.generation += 1
        have = p.have.setdefault(art.ident, set())
        seed = self.sc.seed * 1_000_003 + p.idx * 1009 + art.version
        config = self.sc.swarm_config(seed)
        p.sched = Scheduler(self._n_chunks(art), config, have, self.chunk_bytes)
        p.timer_at = None
        self._feed(p, TimerFired())
        if p.pushing and art is self.artifacts[-1]:  # behind the announcement: not asked
            self._feed(p, PeerPushes(TRAINER, p.pushing))
        p.pushing = frozenset()
        early = p.early if p.early_art is art else None
        asked = p.early_asked if early is not None else set()
        p.early = None  # later early answers and news go to the scheduler
        if early is None:
            p.early_art = None
        for q_idx, indices in (early or {}).items():  # taken over: their feeds go on
            rtt = 2 * self.lat
            self._feed(p, PeerHad(q_idx, frozenset(indices), rtt, self._owed(p, q_idx)))
        if self.tree is not None:
            for s in range(self.tree.k):
                self._push_subscribe(p, self.tree.parent[(p.idx, s)], s)
        for q in p.neighbors:  # in the set's order: runs stay reproducible
            if q in p.follows and q not in p.banned and q not in asked:
                self._subscribe(p, q)

    def _arm(self, p: Peer) -> None:
        """Wake the scheduler when it says it next needs time (as the node's driver does)."""
        assert p.sched is not None
        wake = p.sched.next_timer(self.clock.now)
        if wake is not None and (p.timer_at is None or wake < p.timer_at):
            p.timer_at = wake
            self.clock.at(wake, self._timer, p, p.generation, wake)

    def _timer(self, p: Peer, gen: int, wake: float) -> None:
        if p.generation == gen and p.sched is not None and p.timer_at == wake:
            p.timer_at = None
            self._feed(p, TimerFired())

    def _feed(self, p: Peer, event: Event) -> None:
        if p.sched is not None:
            self._carry_out(p, p.sched.handle(event, self.clock.now))

    def _feed_many(self, p: Peer, events: list[Event]) -> None:
        """Events that reach ``p`` together: one scheduling decision (as the node's driver
        takes what queued up while it was busy)."""
        if p.sched is not None and events:
            self._carry_out(p, p.sched.handle_many(events, self.clock.now))

    def _carry_out(self, p: Peer, actions: list[Action]) -> None:
        runs: dict[int, list[int]] = {}  # a peer's chunks asked at once: one request
        for action in actions:
            if isinstance(action, RequestChunk):
                runs.setdefault(action.peer, []).append(action.index)
            elif isinstance(action, CancelRequest):
                self._cancel(p, action.peer, action.index)
            elif isinstance(action, PeerBanned):
                p.banned.add(action.peer)
                q = self.peers[action.peer]
                self.bans.append(Ban(p.idx, q.idx, q.role, action.reason))
            elif isinstance(action, PushStopped):
                self.clock.after(0.0, self._reparent, p, action.peer, p.generation)
            elif isinstance(action, DownloadCompleted):
                self._completed(p)
                return
        for q_idx, indices in runs.items():
            if self.peers[q_idx].nat:  # named p2p://, asked over libp2p: a chunk a request
                for i in indices:
                    self._request(p, q_idx, [i])
            else:
                self._request(p, q_idx, indices)
        self._arm(p)

    def _completed(self, p: Peer) -> None:
        assert p.artifact is not None
        p.state = p.state.after(p.artifact)  # the real planner's rule: only onto its base
        self._drop_download(p)
        self._start_download(p)  # next step of the plan, or done

    def _finish(self, p: Peer) -> None:
        if p.done_at is None and p.role == HONEST:
            p.done_at = self.clock.now
            self._remaining -= 1

    def _drop_download(self, p: Peer) -> None:
        for q, i in list(p.requests):
            self._cancel(p, q, i)
        p.requests.clear()
        p.runs.clear()
        p.sched, p.artifact = None, None
        p.generation += 1

    # ------------------------------------------------------------ have-maps

    def _visible(self, q: Peer, p: Peer, art: Artifact) -> Collection[int]:
        """What ``q`` shows ``p`` of ``art``: adversaries claim everything."""
        if q.role in (CORRUPT, STALL, LIAR):
            return range(self._n_chunks(art))
        if q.idx == TRAINER:
            late = self.published_at + self.sc.reseed_after_s
            if self.tree is not None and self.clock.now < late:
                return ()  # the trees carry its chunks; pulling from it is the late fall-back
            return self.seeder.offer(self._seed_keys(art), p.idx, self.clock.now)
        return q.have.get(art.ident, set())

    def _subscribe(self, p: Peer, q_idx: int) -> None:
        if q_idx == TRAINER and p.pushed:  # its first answer came with the news
            p.pushed = False
            self._subscribed(p, q_idx, p.generation, pushed=True)
            return
        wait = self._handshake(p.idx, q_idx)
        self.clock.after(wait + self.lat, self._subscribed, p, q_idx, p.generation)

    def _subscribed(self, p: Peer, q_idx: int, gen: int, pushed: bool = False) -> None:
        """``q_idx`` answers ``p``'s first have-map question (a latency later), or gave its
        answer with the news it pushed (at once, and no round trip measured)."""
        q = self.peers[q_idx]
        if not q.online or p.generation != gen or p.artifact is None:
            return
        self._follower(q, p.idx)
        shown = frozenset(self._visible(q, p, p.artifact))
        rtt = None if pushed else 2 * self.lat
        self.clock.after(0.0 if pushed else self.lat, self._deliver_have, p, q_idx, gen, shown, rtt)
        if q_idx == TRAINER:
            self.clock.after(HAVE_WAIT_S, self._repoll_seed, p, gen, shown)

    def _repoll_seed(self, p: Peer, gen: int, shown: frozenset[int]) -> None:
        """The seed's answer on a have feed is its SuperSeeder's offer at that moment; a
        node's feed that had no news for ``have_wait_s`` ends and its follower asks again
        (answered at once if the offer changed), so what the seeder frees up in the meantime
        (reseeded or starved chunks) reaches the follower then."""
        if p.generation != gen or p.artifact is None or p.sched is None or not p.online:
            return
        now = frozenset(self._visible(self.peers[TRAINER], p, p.artifact))
        if now - shown:
            self._message(self._deliver_have, p, TRAINER, gen, now - shown)
        self.clock.after(HAVE_WAIT_S, self._repoll_seed, p, gen, shown | now)

    def _deliver_have(
        self, p: Peer, q_idx: int, gen: int, indices: frozenset[int], rtt: float | None = None
    ) -> None:
        """The first answer of a have-map subscription (``rtt``: the round trip it took)."""
        if p.generation == gen and p.online and q_idx not in p.banned:
            self._feed(p, PeerHad(q_idx, indices, rtt, self._owed(p, q_idx)))

    def _push_have(self, q: Peer, p_idx: int, index: int) -> None:
        """``q`` tells follower ``p_idx`` of a new chunk: coalesced while the news is on its
        way (a latency), delivered with the other news ``p`` gets in the same decision
        window (one scheduling decision for all of it)."""
        key = (q.idx, p_idx)
        pending = self.pending_have.get(key)
        if pending is not None:
            pending.add(index)
            return
        self.pending_have[key] = {index}
        self._inbox(p_idx, self.clock.now + self.lat).append(q.idx)

    def _inbox(self, p_idx: int, when: float) -> list[int | tuple[int, Event]]:
        """What reaches ``p_idx`` in the decision window that ``when`` falls in: taken in one
        decision at the window's end."""
        t0 = self.published_at  # windows from the version's start: each version alike
        window = self.window
        due = t0 + -(-(when - t0) // window) * window
        inbox = self.inbox.get((p_idx, due))
        if inbox is None:
            inbox = self.inbox[(p_idx, due)] = []
            self.clock.line(1, due, self._flush_news, p_idx, due)
        return inbox

    def _flush_news(self, p_idx: int, due: float) -> None:
        p, events = self.peers[p_idx], []
        for item in self.inbox.pop((p_idx, due)):
            if isinstance(item, int):
                news = self._news_of(item, p_idx)
                events += self._news(p, item, news) if news else []
            elif item[0] == p.generation and p.online:
                events.append(item[1])
        self._feed_many(p, events)

    def _news_of(self, q_idx: int, p_idx: int) -> set[int]:
        """The news from ``q_idx`` that reaches ``p_idx`` now: the chunks it was told of one
        by one, and those ``q`` announced since the first of them left (``_announce_chunk``);
        ``p`` is quiet again."""
        indices = self.pending_have.pop((q_idx, p_idx), set())
        since = self.news_from.pop((q_idx, p_idx), None)
        q = self.peers[q_idx]
        if since is not None:
            indices.update(q.news.get(since[0], ())[since[1] :])
            if p_idx in q.subscribers:
                q.quiet.add(p_idx)
        return indices

    def _news(self, p: Peer, q_idx: int, indices: set[int]) -> list[Event]:
        """What ``q``'s news of ``indices`` tells ``p``'s download (kept, on an early feed)."""
        promised = self.promised.pop((q_idx, p.idx), None)  # forwarded: said in the answer
        if p.sched is not None and p.online and q_idx not in p.banned:
            out: list[Event] = []
            if promised and promised & indices:
                out.append(PeerPushes(q_idx, frozenset(promised & indices)))
            out.append(PeerHad(q_idx, frozenset(indices), None, self._owed(p, q_idx)))
            return out
        if p.early is not None and p.online:  # news on an early feed: kept
            p.early.setdefault(q_idx, set()).update(indices)
        return []

    def _owed(self, p: Peer, q_idx: int) -> bool:
        """``q``'s uplink is one few can use (the node's ``ChunkSource.owed``): it is behind
        NAT and ``p`` is public."""
        return sourcing.owed(self.peers[q_idx].nat, not p.nat)

    @property
    def _handshake_s(self) -> float:
        """A TLS 1.3 handshake's round trip in a private swarm, else nothing."""
        return 2 * self.lat if self.sc.private else 0.0

    @property
    def _manifest_handshake_s(self) -> float:
        """The manifest comes from the gossip sender, a mesh neighbour: stable over versions,
        so met before when connections stay warm; else a handshake first."""
        return 0.0 if self.sc.warm_connections else self._handshake_s

    def _warm_connections(self) -> None:
        """A private swarm that ran earlier versions (``warm_connections``): each pair that
        follows the other holds TLS connections both ways, handshaken before this run."""
        if not (self.sc.private and self.sc.warm_connections):
            return
        for p in self.peers[1:]:
            for q in p.follows:
                self.handshaken[p.idx, q] = self.handshaken[q, p.idx] = 0.0

    def _close_connections(self, p: Peer) -> None:
        """A node that leaves closes its connections: every pair with it handshakes anew."""
        if self.handshaken:
            for pair in [k for k in self.handshaken if p.idx in k]:
                del self.handshaken[pair]

    def _handshake(self, a: int, b: int) -> float:
        """How long ``a``'s HTTP message to ``b`` waits for their TLS handshake (private
        swarms; libp2p, to or from a NATed peer, is encrypted either way)."""
        if not self.sc.private or self.peers[a].nat or self.peers[b].nat:
            return 0.0
        now = self.clock.now
        ready = self.handshaken.setdefault((a, b), now + self._handshake_s)
        return ready - now if ready > now else 0.0

    def _message(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` one latency from now: a message between peers. Sent at the clock's
        time, which never goes back, so these keep in delay line 0, out of the heap."""
        self.clock.line(0, self.clock.now + self.lat, fn, *args)

    def _message_after(self, wait: float, fn: Callable[..., Any], *args: Any) -> None:
        """A message that waits ``wait`` (a TLS handshake) before its latency."""
        if wait:
            self.clock.after(wait + self.lat, fn, *args)
        else:
            self._message(fn, *args)

    def _announce_chunk(self, q: Peer, art: Artifact, index: int) -> None:
        if self.tree is not None:
            self._push_on(q, art, index)
        log = q.news.setdefault(art.ident, [])
        log.append(index)
        told = []
        for s in q.quiet:  # the others have news on its way, which will carry this one too
            p = self.peers[s]
            sched = p.sched
            if p.artifact is art and sched is not None and index in sched.holders:
                told.append(s)
            elif p.early is not None and p.early_art is art:
                told.append(s)
        for s in told:
            q.quiet.discard(s)
            if (q.idx, s) not in self.news_from:
                self.news_from[(q.idx, s)] = (art.ident, len(log) - 1)
                self._inbox(s, self.clock.now + self.lat).append(q.idx)

    def _follower(self, q: Peer, p_idx: int) -> None:
        """``p_idx`` follows ``q``'s have feed (news of each chunk ``q`` verifies)."""
        if p_idx not in q.subscribers or (q.idx, p_idx) not in self.news_from:
            q.quiet.add(p_idx)
        q.subscribers.add(p_idx)

    # ------------------------------------------------------------ requests

    def _request(self, p: Peer, q_idx: int, indices: list[int]) -> None:
        run = Run(p.idx, q_idx, indices, p.generation)
        self.requests_sent += 1
        self.chunks_requested += len(indices)
        for i in indices:  # one key object for both tables (56 bytes a request in flight)
            key = (q_idx, i)
            p.requests[key] = None
            p.runs[key] = run
        self._message_after(self._handshake(p.idx, q_idx), self._arrive, p, run)

    def _wanted(self, p: Peer, run: Run) -> list[int]:
        """The chunks of ``run`` its requester still wants (not cancelled, not served)."""
        indices, runs = run.indices, p.runs
        if len(indices) == 1:  # most runs (64 KiB chunks at 1 Gbit/s): no list built
            return indices if runs.get((run.source, indices[0])) is run else []
        return [i for i in indices if runs.get((run.source, i)) is run]

    def _cancel(self, p: Peer, q_idx: int, index: int) -> None:
        t = p.requests.pop((q_idx, index), None)
        run = p.runs.pop((q_idx, index), None)
        if run is None or self._wanted(p, run) or p.runs.get((q_idx, run.current)) is run:  # type: ignore[arg-type]
            return  # the rest of its run is still wanted: the bytes keep flowing
        q = self.peers[q_idx]
        if run.transfer is not None:
            if self.net.cancel(run.transfer):  # not if it died with its uploader already
                run.transfer = None
                self._upload_ended(q, p.idx)
        elif t is None and q.slots.withdraw(run):  # else still on its way
            self._seed_contact(q, p.idx)

    def _seed_contact(self, q: Peer, requester: int) -> None:
        """The trainer's upload slots changed for ``requester``: its seeder hears of it, as
        the node's does from the data plane (a quiet owner's chunks go to others). Here a
        requester that crashed silently takes its waiting requests with it at once; a node's
        data plane holds them until served into the dead connection or timed out, so a real
        trainer notices such a crash up to that much later."""
        if q.idx == TRAINER:
            self.seeder.contact(requester, q.slots.pending(requester), self.clock.now)

    def _reply(self, p: Peer, gen: int, event: Event) -> None:
        self._message(self._answer, p, gen, event)

    def _answer(self, p: Peer, gen: int, event: Event) -> None:
        key = (event.peer, event.index)  # type: ignore[union-attr]
        if p.generation == gen and p.online and key in p.requests:
            del p.requests[key]
            p.runs.pop(key, None)
            self._feed(p, event)

    def _fail(self, p: Peer, q_idx: int, indices: list[int], event: type[Event]) -> None:
        for i in indices:
            self._reply(p, p.generation, event(q_idx, i))  # type: ignore[call-arg]

    def _arrive(self, p: Peer, run: Run) -> None:
        if p.generation != run.gen:
            return
        run.indices = self._wanted(p, run)
        if not run.indices:
            return  # cancelled on the way
        q, art = self.peers[run.source], p.artifact
        assert art is not None
        if not q.online:
            if not q.silent_crash:  # connection refused; a silent host: the request times out
                self._fail(p, q.idx, run.indices, ChunkFailed)
            return
        if q.role == STALL:
            return
        if q.role == LIAR:
            self._fail(p, q.idx, run.indices, ChunkFailed)
            return
        if q.role != CORRUPT:
            self._cut_at_missing(p, q, run, q.have.get(art.ident, set()))
            if not run.indices:
                return
        admission = q.slots.request(p.idx, run, q.uploaded[(art.ident, run.indices[0])])
        self._seed_contact(q, p.idx)
        if admission is Admission.SERVE and not self._serve(q, p, run):
            self._upload_ended(q, p.idx)  # refused at once (the seed's 404): the slot is free
        elif admission is Admission.BUSY:
            self._fail(p, q.idx, run.indices, PeerBusy)

    def _cut_at_missing(self, p: Peer, q: Peer, run: Run, held: Collection[int]) -> None:
        """``q`` serves ``run`` up to the first chunk it lacks: that one fails, and the
        requester asks for those after it again once the short reply is in."""
        for at, i in enumerate(run.indices):
            if i not in held:
                rest = run.indices[at + 1 :]
                run.indices = run.indices[:at]
                self._fail(p, q.idx, [i], ChunkFailed)
                if rest:
                    self._message(self._ask_again, p, run, rest)
                return

    def _ask_again(self, p: Peer, run: Run, rest: list[int]) -> None:
        wanted = [i for i in rest if p.runs.get((run.source, i)) is run]
        if p.generation == run.gen and wanted:
            self._request(p, run.source, wanted)

    def _serve(self, q: Peer, p: Peer, run: Run) -> bool:
        """Start the next wanted chunk of ``run``; False if none is left (the upload ends)."""
        art = p.artifact
        wanted = self._wanted(p, run) if p.generation == run.gen and art is not None else []
        if not wanted:
            return False
        index = wanted[0]
        run.indices = wanted[1:]
        assert art is not None
        q_idx = q.idx
        if q_idx == TRAINER:  # the node asks its seeder as it reads the chunk, and offers more
            if not self.seeder.may_serve((art.ident, index), p.idx, self.clock.now):
                run.indices = wanted  # a 404 there: the rest is asked again
                self._cut_at_missing(p, q, run, ())
                return False
            self.seeder.note_served((art.ident, index), p.idx, self.clock.now)
            if p.online:
                self._reoffer(p, art)
        pair = (q_idx, p.idx)
        self.served[pair] = self.served.get(pair, 0) + 1
        q.uploaded[(art.ident, index)] += 1
        size = self._chunk_size(art, index)
        transfer = self.net.start(
            q_idx, p.idx, size, lambda: self._delivered(p, q, art, run, index)
        )
        p.requests[(q_idx, index)] = run.transfer = transfer
        run.current = index
        if not p.metering:
            p.metering = True
            self.clock.after(self.sc.download.stall_timeout_s / 4, self._meter, p)
        return True

    def _meter(self, p: Peer) -> None:
        """Tell ``p``'s scheduler how far its transfers got (``ChunkMoving``), a quarter of
        ``stall_timeout_s`` apart while any runs, as the node's driver does for a transfer
        running that long: a chunk whose bytes keep coming is slow, not stalled. Nearly all
        transfers end sooner, so nearly no simulation sees one."""
        p.metering = False
        running = [(q, i, t) for (q, i), t in p.requests.items() if t is not None]
        if p.sched is None or not running:
            return
        gen = p.generation
        for q, i, t in running:
            if p.generation != gen:
                return  # the download completed meanwhile
            self._feed(p, ChunkMoving(q, i, int(self.net.progress(t))))
        p.metering = True
        self.clock.after(self.sc.download.stall_timeout_s / 4, self._meter, p)

    def _upload_ended(self, q: Peer, requester: int) -> None:
        """An upload of ``q`` ended: its slots start what they pick from the line (a request
        its requester no longer wants ends at once, as a closed connection does)."""
        ended = [requester]
        while ended and q.online:
            done = ended.pop()
            started = q.slots.finished(done)
            self._seed_contact(q, done)
            for r_idx, run in started:
                if not self._serve(q, self.peers[r_idx], run):
                    ended.append(r_idx)

    def _delivered(self, p: Peer, q: Peer, art: Artifact, run: Run, index: int) -> None:
        run.current, run.transfer = None, None
        self._message(self._received, p, art, run.gen, self._checked(q, art, index))
        if not self._serve(q, p, run):  # the run's next chunk follows at once
            self._upload_ended(q, p.idx)

    def _checked(self, q: Peer, art: Artifact, index: int) -> Event:
        """What the receiver's hash check makes of chunk ``index`` from ``q``."""
        if q.role == CORRUPT:
            return ChunkCorrupted(q.idx, index)
        return ChunkVerified(q.idx, index, self._chunk_size(art, index))

    def _received(self, p: Peer, art: Artifact, gen: int, event: Event) -> None:
        key = (event.peer, event.index)  # type: ignore[union-attr]
        if p.generation != gen or not p.online or key not in p.requests:
            return
        del p.requests[key]
        p.runs.pop(key, None)
        self._accept(p, art, event)

    def _keep(self, p: Peer, art: Artifact, index: int) -> None:
        """``p`` now holds ``index``. A set grows its table 4-fold (1,229 of 1,525 chunks held:
        8,192 slots, 128 KB a peer); a copy then takes half that. Only once it covers every
        index: a table wider than the largest iterates in index order either way."""
        have = p.have[art.ident]
        size = sys.getsizeof(have)
        have.add(index)
        if sys.getsizeof(have) > size and 2 * len(have) >= self._n_chunks(art):
            p.have[art.ident] = set(have)

    def _accept(self, p: Peer, art: Artifact, event: Event) -> bool:
        """``p`` got a chunk (pulled or pushed): keep and announce it if new, pass it on if
        the trainer handed it over, tell its scheduler (in the window's one decision, with
        the news: ``_inbox``); ``True`` if it was new."""
        new = False
        if isinstance(event, ChunkVerified) and event.index not in p.have[art.ident]:
            new = True
            self._keep(p, art, event.index)
            if p.role == HONEST and art is self.artifacts[-1]:
                self._count_new(p, event.index, event.nbytes)
            self._announce_chunk(p, art, event.index)
            if event.peer == TRAINER and p.role == HONEST and not p.nat:
                self._forward(p, art, event.index)  # if no other peer it follows has it
        self._inbox(p.idx, self.clock.now).append((p.generation, event))
        return new

    def _count_new(self, p: Peer, index: int, nbytes: int) -> None:
        """Book a new chunk of the version at honest ``p`` for its :class:`Lag`."""
        if p.first_at is None:
            p.first_at = self.clock.now
        p.got_bytes += nbytes
        self._unheld.discard(index)
        if not self._unheld and self.full_at is None:  # the swarm holds every chunk now
            self.full_at = self.clock.now
            for q in self.honest:
                q.got_at_full = q.got_bytes

    def _lag(self, p: Peer) -> Lag:
        """Where converged honest ``p``'s time went (:class:`Lag`)."""
        assert p.done_at is not None and p.first_at is not None and self.full_at is not None
        d, t0 = p.downlink, self.published_at
        full = max(self.full_at, p.first_at)  # its first chunk came after the swarm had all
        start = p.first_at - t0
        filling = (full - p.first_at) - p.got_at_full / d
        tail = (p.done_at - full) - (p.got_bytes - p.got_at_full) / d
        return Lag(start, filling, tail)

    def _forward(self, p: Peer, art: Artifact, index: int) -> None:
        """``p`` pushes a chunk the trainer handed it, and that none of the other peers it
        follows claims, while it serves no more than ``forward_seed_chunks`` uploads, to that
        many of the peers following its have-map, unasked (the node's
        ``p2p_sync.runtime.forwarding``: a
        framed ``POST /announce`` to each, over HTTP only: not to NATed peers, and not from a
        NATed ``p``, whose pushes receivers drop), whether or not they hold it by now (the
        node cannot know: a copy they hold is wasted bytes, counted as such). The node sends
        one push at a time to a peer, the chunks meanwhile riding the next POST together: in
        this fluid model parallel flows on one pair share its links as a queue would, so each
        push stays a flow of its own here."""
        n, sched = self.sc.download.forward_seed_chunks, p.sched
        if n <= 0:
            return
        holders = None if sched is None else sched.holders.get(index)
        if holders is None or holders - {TRAINER}:  # not rare (``Download._rare_from_seed``)
            return
        if p.slots.busy > n:  # its uplink is busy serving requests (``Forwarder.forward``)
            return
        takers = [
            s
            for s in sorted(p.subscribers)
            if s != TRAINER
            and not self.peers[s].nat
            and self.peers[s].online
            and self.peers[s].artifact is art
        ]
        if not takers:
            return
        for s in random.Random(p.idx * 1_000_003 + index).sample(takers, min(n, len(takers))):
            c = self.peers[s]
            p.uploaded[(art.ident, index)] += 1
            self.promised.setdefault((p.idx, s), set()).add(index)
            done = partial(self._forwarded, p, c, art, index, c.generation)
            size, wait = self._chunk_size(art, index), self._handshake(p.idx, s)
            if wait:
                self.clock.after(wait, self.net.start, p.idx, s, size, done)
            else:
                self.net.start(p.idx, s, size, done)

    def _forwarded(self, p: Peer, c: Peer, art: Artifact, index: int, gen: int) -> None:
        """A forwarded chunk left ``p``'s uplink: ``c`` has it a latency later."""
        self._message(self._push_arrived, c, art, gen, self._checked(p, art, index))

    def _reoffer(self, p: Peer, art: Artifact) -> None:
        """The trainer served ``p`` one of its chunks: top up what it shows ``p``."""
        trainer = self.peers[TRAINER]
        if p.idx in trainer.subscribers and p.artifact is art:
            for i in self._visible(trainer, p, art):
                if p.sched is not None and i in p.sched.holders:
                    self._push_have(trainer, p.idx, i)

    # ------------------------------------------------------------ push trees (push_tree)

    def _push_subscribe(self, p: Peer, parent: int, s: int) -> None:
        """``p`` asks ``parent`` to push it stripe ``s``, and expects those chunks from it."""
        assert self.tree is not None and p.sched is not None and p.artifact is not None
        if parent in p.banned:
            return
        chunks = self.tree.chunks(s, self._n_chunks(p.artifact))
        self._feed(p, PeerPushes(parent, frozenset(chunks)))
        self._message(self._push_subscribed, p, parent, s, p.generation)

    def _push_subscribed(self, p: Peer, parent: int, s: int, gen: int) -> None:
        """The subscription reached ``parent``: it pushes what it holds of the stripe now and
        each chunk it gets later, and ``p`` hears of its have-map as a subscriber does."""
        q, art = self.peers[parent], p.artifact
        if p.generation != gen or not q.online or art is None or self.tree is None:
            return
        self.tree_children.setdefault((parent, s), set()).add(p.idx)
        if parent != TRAINER:
            self._follower(q, p.idx)
            held = frozenset(self._visible(q, p, art))
            self._message(self._deliver_have, p, parent, gen, held)
        for i in self.tree.chunks(s, self._n_chunks(art)):
            if i in q.have.get(art.ident, ()):
                self._push_queue(q, p, i)

    def _push_on(self, q: Peer, art: Artifact, index: int) -> None:
        """``q`` got chunk ``index``: forward it to its children in that chunk's stripe."""
        assert self.tree is not None
        for child in sorted(self.tree_children.get((q.idx, self.tree.stripe(index)), ())):
            c = self.peers[child]
            if c.artifact is art:
                self._push_queue(q, c, index)

    def _push_queue(self, q: Peer, c: Peer, index: int) -> None:
        if q.idx in c.banned:
            return
        self.streams.setdefault((q.idx, c.idx), {})[index] = None  # once: an ordered set
        self._push_next(q, c)

    def _push_next(self, q: Peer, c: Peer) -> None:
        """One chunk at a time per child (a stream): the next one the child still lacks."""
        key, art = (q.idx, c.idx), c.artifact
        line = self.streams.get(key)
        while line and key not in self.pushing and q.online and c.online and art is not None:
            index = next(iter(line))
            del line[index]
            if c.sched is not None and index in c.sched.holders and q.idx not in c.banned:
                self.pushing.add(key)
                done = partial(self._pushed_chunk, q, c, art, index, c.generation)
                self.net.start(q.idx, c.idx, self._chunk_size(art, index), done)

    def _pushed_chunk(self, q: Peer, c: Peer, art: Artifact, index: int, gen: int) -> None:
        self.pushing.discard((q.idx, c.idx))
        self._push_next(q, c)
        self._message(self._push_arrived, c, art, gen, self._checked(q, art, index))

    def _push_arrived(self, p: Peer, art: Artifact, gen: int, event: Event) -> None:
        if p.generation != gen or not p.online or p.sched is None:
            return
        if self._accept(p, art, event):
            self.pushed_chunks += p.role == HONEST

    def _reparent(self, p: Peer, stopped: int, gen: int) -> None:
        """``stopped`` owed ``p`` pushes and is gone (left, banned) or never pushed anything (a
        corrupt root that does not even download): an interior node asks the next parent of
        its stripe (``TreeLayout.replace``); a leaf pulls the stripe from the mesh. A parent
        that pushed before and is still there but slow (its stream into a crowded downlink)
        is kept: what it lags on comes from the mesh (replacing it made the new root's
        trainer stream a second copy: 100 peers, 10% corrupt + 20% churn, 1.08 -> 1.04 F)."""
        if self.tree is None or p.generation != gen or p.sched is None:
            return
        slow = self.peers[stopped].online and p.sched.pushes.pushed_any(stopped)
        if slow and stopped not in p.banned:
            return  # connected, pushing, slow: the mesh fills in what it lags on
        for s in range(self.tree.k):
            if self.tree.parent.get((p.idx, s)) != stopped:
                continue
            self.tree_children.get((stopped, s), set()).discard(p.idx)
            usable = partial(self._may_parent, p, stopped)
            new = self.tree.replace(p.idx, s, usable)
            if new is not None:
                self._push_subscribe(p, new, s)

    def _drop_streams(self, p: Peer) -> None:
        """``p`` left: the push streams it served or received die with its connections (back
        online, it subscribes again; a stream left queued would push its backlog twice)."""
        for key in [key for key in self.tree_children if key[0] == p.idx]:
            del self.tree_children[key]
        for children in self.tree_children.values():
            children.discard(p.idx)
        for key in [key for key in self.streams if p.idx in key]:
            del self.streams[key]
            if key[0] == p.idx:
                self.pushing.discard(key)

    def _may_parent(self, p: Peer, stopped: int, q: int) -> bool:
        return q != stopped and q not in p.banned and self.peers[q].online

    # ------------------------------------------------------------ churn

    def _schedule_churn(self, t0: float, bound: float) -> list[Peer]:
        k = round(self.sc.churn_fraction * len(self.honest))
        chosen = self.rng.sample(self.honest, k)
        for n, p in enumerate(chosen):
            leave = t0 + self.rng.uniform(0, bound)
            self.clock.at(leave, self._leave, p, n % 2 == 0, bound * self.sc.churn_downtime)
        return chosen

    def _leave(self, p: Peer, silent: bool, downtime: float) -> None:
        if not p.online:
            return
        p.online, p.silent_crash = False, silent
        p.left_at = self.clock.now
        self._drop_download(p)
        for r_idx, run in p.slots.clear():  # queued requests die with it
            r = self.peers[r_idx]
            if not silent and r.generation == run.gen:  # reset, or silence
                self._fail(r, p.idx, self._wanted(r, run), ChunkFailed)
        for t in self.net.uploads(p.idx):  # uploads in progress die with the node
            self.net.cancel(t)
            if not silent:
                r = self.peers[t.dst]
                self._reply_failed_transfer(r, p.idx, t)
        for s in p.subscribers:
            r = self.peers[s]
            if not silent and r.sched is not None:
                self._message(self._lost, r, p.idx, r.generation)
            elif r.early is not None:  # an early feed ended: the download asks again
                r.early.pop(p.idx, None)
                r.early_asked.discard(p.idx)
        p.subscribers.clear()
        p.quiet.clear()
        self._close_connections(p)
        p.early, p.early_art, p.early_asked = None, None, set()
        self._drop_streams(p)
        self.clock.after(downtime, self._rejoin, p, p.generation)

    def _reply_failed_transfer(self, r: Peer, q_idx: int, t: Transfer | Flow) -> None:
        """An upload from ``q_idx`` died: the chunk on the wire fails, and the rest of its run."""
        for (q, i), tr in r.requests.items():
            if tr is t and q == q_idx:
                r.requests[(q, i)] = None
                run = r.runs.get((q, i))
                rest = self._wanted(r, run) if run is not None else []
                self._fail(r, q, [i, *(j for j in rest if j != i)], ChunkFailed)
                return

    def _lost(self, r: Peer, q_idx: int, gen: int) -> None:
        if r.generation == gen and r.online:
            self._feed(r, PeerLost(q_idx))

    def _rejoin(self, p: Peer, gen: int) -> None:
        if p.online or p.generation != gen:
            return
        p.online, p.silent_crash = True, False
        if p.done_at is None and p.left_at is not None:  # time it could not download
            p.away += self.clock.now - p.left_at
        if p.done_at is None and p.sched is None and p.state.version is not None:
            if p.state.version < self.peers[TRAINER].state.version:  # type: ignore[operator]
                self._start_download(p)
        for s in p.neighbors:  # it reconnects: neighbours still fetching ask for its have-map
            r = self.peers[s]
            if p.idx not in r.follows or r.sched is None:
                continue
            if s not in p.banned and p.idx not in r.banned:
                self._subscribe(r, p.idx)


def own_bound(bound: float, payload: float, downlink: float, away: float) -> float:
    """The lower bound for one peer that was offline ``away`` seconds before it finished:
    ``max(bound, payload / downlink + away)``.

    Kumar-Ross bounds the last peer of a swarm whose peers are online throughout. A churned
    peer also needs ``payload / downlink`` seconds online to receive the payload, and the
    seconds it was away do not count, so it cannot finish before the sum; where its downlink
    sets the swarm's bound (symmetric links, as in ``scale-1k-hostile``), that is the bound
    plus its time away. A peer that never left gets ``bound``, so the worst ratio over peers
    is the usual last-peer ratio when nothing churns."""
    return max(bound, payload / downlink + away)


def _spread(
    rng: random.Random, slots: list[int], classes: Sequence[tuple[V, float]], rest: V
) -> list[V]:
    """Each class's value on its fraction of the slots, drawn at random (``slots`` is shuffled
    in place, so successive draws chain as they always have); ``rest`` on the others."""
    out = [rest] * len(slots)
    rng.shuffle(slots)
    at = 0
    for value, fraction in classes:
        k = round(fraction * len(slots))
        for s in slots[at : at + k]:
            out[s] = value
        at += k
    return out
