"""Rule-based state machines (Hypothesis, h2 style) for the sans-I/O scheduler and seeder: one
rule per event, invariants checked after every step, liveness checked at teardown."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from p2p_sync.protocol import seeding
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
    RequestChunk,
    TimerFired,
)
from p2p_sync.protocol.seeding import SuperSeeder
from p2p_sync.protocol.stalls import carry_unserved
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.swarmconfig import SwarmConfig

FAST = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def swarms(draw: st.DrawFn) -> tuple[int, dict[str, set[int]], dict[str, set[int]], SwarmConfig]:
    """Payload size, honest and evil peers' holdings (every chunk has an honest holder)."""
    n = draw(st.integers(1, 20))
    n_honest, n_evil = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    honest = {f"h{i}": set(draw(st.sets(st.integers(0, n - 1)))) for i in range(n_honest)}
    for i in range(n):
        honest[f"h{draw(st.integers(0, n_honest - 1))}"].add(i)
    evil = {f"e{i}": set(draw(st.sets(st.integers(0, n - 1), min_size=1))) for i in range(n_evil)}
    config = SwarmConfig(
        max_requests_per_peer=draw(st.integers(1, 4)),
        max_requests_total=draw(st.integers(1, 10)),
        endgame_sources=draw(st.integers(1, 3)),
        request_timeout_s=1.0,
        request_bytes=draw(st.sampled_from([0, 1000, 3000])),  # runs of 1 to 3 chunks
        request_s=draw(st.sampled_from([0.005, 1.0])),  # a second: runs once measured
        min_request_timeout_s=0.2,
        stall_timeout_s=draw(st.sampled_from([0.5, 5.0])),
        seed=draw(st.integers(0, 9)),
    )
    return n, honest, evil, config


class SchedulerMachine(RuleBasedStateMachine):
    """Simulated peers around one :class:`Scheduler`; every action is checked as it comes out.

    ``pending`` holds requests the scheduler has in flight; ``cancelled`` those it cancelled
    whose bytes may still arrive (an endgame loser, a timed-out peer that answers late)."""

    @initialize(swarm=swarms())
    def start(self, swarm) -> None:
        self.n, self.honest, self.evil, config = swarm
        self.sched = Scheduler(self.n, config, (), 1000)  # chunks of 1000 bytes
        self.now = 0.0
        self.pending: list[tuple[str, int]] = []
        self.cancelled: list[tuple[str, int]] = []
        self.verified: set[int] = set()
        self.banned: set[str] = set()
        self.completions = 0
        self.stalls = 0
        self.record: dict[int, set[str]] = {}  # what a re-plan carries to the next download
        self.arriving: tuple[str, int] | None = None
        for peer, chunks in sorted({**self.honest, **self.evil}.items()):
            self.feed(PeerHad(peer, frozenset(chunks)))

    # ------------------------------------------------------------ plumbing

    def feed(self, event: Event) -> None:
        for action in self.sched.handle(event, self.now):
            self.check(action)

    def check(self, action: Action) -> None:
        if isinstance(action, RequestChunk):
            assert action.peer not in self.banned, "requested from a banned peer"
            assert action.index not in self.verified, "requested a verified chunk"
            assert (action.peer, action.index) not in self.pending, "duplicate request"
            self.pending.append((action.peer, action.index))
        elif isinstance(action, CancelRequest):
            key = (action.peer, action.index)
            assert key in self.pending or key == self.arriving, "cancelled an unknown request"
            if key in self.pending:
                self.pending.remove(key)
                self.cancelled.append(key)
        elif isinstance(action, PeerBanned):
            assert action.peer in self.evil, f"honest {action.peer} banned: {action.reason}"
            self.banned.add(action.peer)
        elif isinstance(action, DownloadCompleted):
            self.completions += 1
        elif isinstance(action, DownloadStalled):
            assert action.indices, "a stall names its chunks"
            assert not action.indices & self.verified, "stalled on a verified chunk"
            assert not any(self.sched.holders[i] for i in action.indices), "it had a source"
            carry_unserved(self.record, action.indices, action.disowned)
            self.stalls += 1

    def take(self, k: int) -> tuple[str, int]:
        return self.pending.pop(k % len(self.pending))

    def arrive(self, peer: str, index: int) -> None:
        """Bytes from ``peer`` for ``index``: what an honest and an evil peer send differ."""
        self.arriving = (peer, index)  # a ban cancels the sender's requests, this one too
        if peer in self.evil:
            self.feed(ChunkCorrupted(peer, index))
        else:
            self.verified.add(index)
            self.feed(ChunkVerified(peer, index, 1000 if index < self.n - 1 else 300))

    # ------------------------------------------------------------ rules: one per event

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6), dt=st.floats(0.0, 0.3))
    def chunk_arrives(self, k: int, dt: float) -> None:
        self.now += dt
        self.arrive(*self.take(k))

    @precondition(lambda self: self.cancelled)
    @rule(k=st.integers(0, 10**6))
    def cancelled_request_arrives_anyway(self, k: int) -> None:
        """Endgame: the loser's copy lands after its CancelRequest (or a timed-out peer
        answers late)."""
        key = self.cancelled.pop(k % len(self.cancelled))
        if key in self.pending:  # asked again since: the scheduler takes this copy for it,
            self.pending.remove(key)  # and the second copy may still land later
            self.cancelled.append(key)
        self.arrive(*key)

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6))
    def chunk_fails(self, k: int) -> None:
        """A transport error, or the peer lacks what it claimed: honest peers too."""
        self.feed(ChunkFailed(*self.take(k)))

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6))
    def peer_busy(self, k: int) -> None:
        self.feed(PeerBusy(*self.take(k)))

    @rule(data=st.data())
    def peer_had(self, data: st.DataObject) -> None:
        """A have-map arrives, possibly late (naming chunks already verified)."""
        peers = {**self.honest, **self.evil}
        peer = data.draw(st.sampled_from(sorted(peers)))
        held = sorted(peers[peer])
        rtt = data.draw(st.none() | st.floats(0.001, 0.5))  # a timed have-map teaches a round trip
        owed = data.draw(st.booleans())  # behind NAT, we are public: asked first
        if held:
            chunks = frozenset(data.draw(st.sets(st.sampled_from(held))))
            self.feed(PeerHad(peer, chunks, rtt, owed))

    @rule(data=st.data())
    def news_arrives_together(self, data: st.DataObject) -> None:
        """Have-maps from several peers, and maybe a chunk, taken in one decision (a
        driver's queue drained at once): every action is checked as for one event."""
        peers = {p: sorted(c) for p, c in {**self.honest, **self.evil}.items() if c}
        if not peers:
            return
        names = data.draw(st.lists(st.sampled_from(sorted(peers)), min_size=2, max_size=4))
        events: list[Event] = [
            PeerHad(p, frozenset(data.draw(st.sets(st.sampled_from(peers[p]))))) for p in names
        ]
        honest = [(p, i) for p, i in self.pending if p in self.honest and i not in self.verified]
        if honest and data.draw(st.booleans()):  # a verified chunk in the same batch
            peer, index = honest[0]
            self.pending.remove((peer, index))
            self.arriving = (peer, index)
            self.verified.add(index)
            events.append(ChunkVerified(peer, index, 1000 if index < self.n - 1 else 300))
        for action in self.sched.handle_many(events, self.now):
            self.check(action)

    @rule(data=st.data())
    def peer_lost(self, data: st.DataObject) -> None:
        peer = data.draw(st.sampled_from(sorted({**self.honest, **self.evil})))
        self.feed(PeerLost(peer))
        self.pending = [(p, i) for p, i in self.pending if p != peer]  # its requests are gone

    @rule(dt=st.floats(0.0, 2.0))
    def timer_fires(self, dt: float) -> None:
        self.now += dt
        self.feed(TimerFired())

    # ------------------------------------------------------------ invariants

    @invariant()
    def completes_exactly_once_when_complete(self) -> None:
        if not hasattr(self, "sched"):
            return
        assert self.completions == (1 if self.sched.complete else 0)
        assert self.sched.complete == (self.verified == set(range(self.n)))

    @invariant()
    def requests_stay_within_bounds(self) -> None:
        if not hasattr(self, "sched"):
            return
        c = self.sched.config
        assert self.sched.requests_in_flight() == len(self.pending) <= c.max_requests_total
        assert not any(p in self.banned for p, _ in self.pending)

    @invariant()
    def the_first_timeout_is_the_earliest_request_deadline(self) -> None:
        """``next_timer`` finds the earliest ``started + patience`` without summing every
        request: it must equal the sum taken over all of them."""
        if not hasattr(self, "sched") or not self.sched.inflight:
            return
        s = self.sched
        soft = s._timeout_limit()
        brute = min(
            started + s._patience(peer, i, soft)
            for i, peers in s.inflight.items()
            for peer, started in peers.items()
        )
        assert s._first_timeout() == brute

    @invariant()
    def peers_with_room_are_counted_afresh(self) -> None:
        """The scheduler keeps the peers with room for a run of requests as requests and
        depths change: it must be the set a count from scratch gives, among peers it may ask."""
        if not hasattr(self, "sched"):
            return
        s = self.sched

        def room(p: str) -> int:
            run = s.stats[p].run(s._chunk_bytes, s.config)
            depth = s.stats[p].depth(s._chunk_bytes, s.config, run)
            return depth - len(s.peer_inflight.get(p, ())) - min(run, depth)

        fresh = {p for p in s.peer_chunks if p not in s.banned and room(p) >= 0}
        assert {p for p in s._open if p in s.peer_chunks and p not in s.banned} == fresh

    @invariant()
    def kept_depths_and_offers_are_those_counted_afresh(self) -> None:
        """The scheduler keeps each peer's (depth, run) until its stats or the mean chunk
        size move (``peerstats.Depths``), and each peer's claims not in flight (``_avail``,
        what rarest first looks at): both must be what a count from scratch gives."""
        if not hasattr(self, "sched"):
            return
        s = self.sched
        for p, pair in s._depths.pairs.items():
            assert pair == s.stats[p].depth_run(s._chunk_bytes, s.config, bool(s.chunk_bytes))
        assert s._avail == {p: c - s.inflight.keys() for p, c in s.peer_chunks.items()}

    def teardown(self) -> None:
        """Liveness: the network now behaves (honest peers re-send their have-maps, as the
        node's have-map followers do, and everything asked for arrives): it must finish. A
        download that reported a stall may not (its caller gave up on it, and the peers that
        did not serve a stalled chunk lost standing for it, honest ones too): the caller
        re-plans and may come back to the payload with a new download of what is missing,
        carrying the stalls over (``carry_unserved``), which must finish within two such
        re-plans (the second gives back the chunks only the disowned held)."""
        if not hasattr(self, "sched"):
            return
        for _ in range(3):
            if self.settle():
                break
            config = self.sched.config
            record = {i: set(peers) for i, peers in self.record.items()}
            self.sched = Scheduler(self.n, config, self.verified, 1000, record)
            self.pending, self.cancelled, self.stalls = [], [], 0
        assert self.completions == 1 and self.verified == set(range(self.n))

    def settle(self) -> bool:
        """Honest peers re-send their have-maps, and everything asked for arrives: True once
        the download completes; False if it stalled and is stuck (a caller re-plans)."""
        for peer, chunks in sorted(self.honest.items()):
            self.feed(PeerHad(peer, frozenset(chunks)))
        for _ in range(40 * self.n + 100):
            if self.completions:
                return True
            if self.pending:
                self.now += 0.01
                self.arrive(*self.take(0))
            else:  # nothing in flight: the scheduler must say when it next needs time
                wake = self.sched.next_timer(self.now)
                if wake is None:
                    assert self.stalls, "stuck without a timer"
                    return False
                self.now = max(self.now, wake)
                self.feed(TimerFired())
        return bool(self.completions)


SchedulerMachine.TestCase.settings = FAST
test_scheduler_state_machine = SchedulerMachine.TestCase


PEERS = ("p0", "p1", "p2", "p3")


class StallMachine(RuleBasedStateMachine):
    """One :class:`Scheduler` among peers that claim chunks whether or not they ever serve
    them: claims come again at any time, and a request may time out, fail, meet a busy peer,
    bring some bytes or deliver. The model keeps, for each missing chunk asked for, when its
    stall clock started (its first request since it was last reported or first asked of a
    peer, a first claim after it had no source, or its last progress: more of its bytes than
    any request brought before), whom it was asked of since, and which peers claim it with
    standing. Its deadline is ``stall_timeout_s`` after that (or ``timeout_factor`` times the
    longest a delivered chunk waited, if longer); a request for it made before the deadline
    is the peer's answer still to come, and a chunk nobody claims waits for a source, so the
    chunk is late once past its deadline, claimed, with no such request in flight. Whatever
    is claimed meanwhile, invariants: a late chunk is reported stalled at the first event the
    scheduler handles, and the scheduler's next timer is never past a deadline (a driver that
    sleeps until then sees it at most one timer period late); a chunk is never reported
    before it is late unless no peer with standing claims it; a stall disowns exactly its
    claimants and the peers asked for it, for that chunk only; a peer is asked only for a
    chunk it claims with standing."""

    @initialize(
        n=st.integers(1, 8),
        stall=st.sampled_from([0.5, 2.0]),
        per_peer=st.integers(1, 3),
        total=st.integers(1, 6),
        seed=st.integers(0, 9),
    )
    def start(self, n: int, stall: float, per_peer: int, total: int, seed: int) -> None:
        config = SwarmConfig(
            max_requests_per_peer=per_peer,
            max_requests_total=total,
            request_timeout_s=1.0,
            min_request_timeout_s=0.2,
            stall_timeout_s=stall,
            seed=seed,
        )
        self.n, self.limit = n, stall
        self.sched = Scheduler(n, config, (), 1000)
        self.now = 0.0
        self.pending: list[tuple[str, int]] = []
        self.started: dict[tuple[str, int], float] = {}  # when each was asked for
        self.verified: set[int] = set()
        self.due: dict[int, float] = {}  # chunk -> when its stall clock started
        self.tried: dict[int, set[str]] = {}  # chunk -> peers asked for it since
        self.most: dict[int, int] = {}  # chunk -> most bytes one request brought
        self.holders: dict[int, set[str]] = {i: set() for i in range(n)}  # with standing
        self.unserved: dict[int, set[str]] = {}
        self.longest = 0.0  # the longest a delivered chunk waited once due
        self.stalls = 0

    @property
    def deadline_after(self) -> float:
        """The stall limit: ``stall_timeout_s``, or ``timeout_factor`` (4) times the longest
        wait of a delivered chunk, if longer (a slow swarm's honest chunks wait their turn)."""
        return max(self.limit, 4 * self.longest)

    def feed(self, event: Event) -> None:
        reported = False
        for action in self.sched.handle(event, self.now):
            if isinstance(action, RequestChunk):
                peer, i = action.peer, action.index
                assert peer in self.holders[i], "asked a peer without standing for the chunk"
                self.pending.append((peer, i))
                self.started[(peer, i)] = self.now
                if i not in self.due or peer not in self.tried.get(i, ()):
                    self.due[i] = self.now  # a source asked for the first time: its chance
                self.tried.setdefault(i, set()).add(peer)
            elif isinstance(action, CancelRequest):
                self.pending.remove((action.peer, action.index))
            elif isinstance(action, DownloadStalled):
                reported = True
                self.stalled(action)
            else:
                assert not isinstance(action, PeerBanned), "nobody here sent bad bytes"
        if not isinstance(event, ChunkMoving):  # the scheduler looked at the clocks
            late = {i for i in self.due if self.late(i)}
            assert not late, f"chunks {late} outlived stall_timeout_s unreported"
        assert not (reported and isinstance(event, ChunkMoving)), "a stall on a bytes event"

    def late(self, i: int) -> bool:
        """Chunk ``i`` is past its deadline, claimed, and no request for it made before the
        deadline is in flight."""
        deadline = self.due[i] + self.deadline_after
        if deadline > self.now or not self.holders[i]:
            return False
        return not any(j == i and self.started[(p, j)] < deadline for p, j in self.pending)

    def stalled(self, action: DownloadStalled) -> None:
        self.stalls += 1
        for i in action.indices:
            assert i not in self.verified, "stalled on a verified chunk"
            overdue = i in self.due and self.late(i)
            assert overdue or not self.holders[i], f"chunk {i} reported early, claimed"
            expected = frozenset(self.tried.pop(i, set()) | self.holders[i])
            assert action.disowned.get(i, frozenset()) == expected, "disowned the wrong peers"
            self.unserved.setdefault(i, set()).update(expected)
            self.holders[i] -= expected
            self.due.pop(i, None)
            self.most.pop(i, None)
        assert set(action.disowned) <= action.indices

    def take(self, k: int) -> tuple[str, int]:
        return self.pending.pop(k % len(self.pending))

    # ------------------------------------------------------------ rules: one per event

    @rule(peer=st.sampled_from(PEERS), chunks=st.sets(st.integers(0, 7)), dt=st.floats(0, 0.5))
    def peer_claims(self, peer: str, chunks: set[int], dt: float) -> None:
        """A have-map, perhaps the hundredth with the same chunks, perhaps a lie."""
        self.now += dt
        claimed = {i for i in chunks if i < self.n and i not in self.verified}
        for i in claimed:
            if peer in self.unserved.get(i, ()) or peer in self.holders[i]:
                continue  # no standing for it, or nothing new
            if i in self.due and not self.holders[i] and peer not in self.tried.get(i, ()):
                self.due[i] = self.now  # a new source for a chunk that had none
            self.holders[i].add(peer)
        self.feed(PeerHad(peer, frozenset(claimed)))

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6), dt=st.floats(0, 0.5))
    def chunk_delivered(self, k: int, dt: float) -> None:
        self.now += dt
        peer, i = self.take(k)
        self.verified.add(i)
        if i in self.due:
            self.longest = max(self.longest, self.now - self.due[i])
        for table in (self.due, self.tried, self.most, self.holders, self.unserved):
            table.pop(i, None)  # type: ignore[attr-defined]
        self.feed(ChunkVerified(peer, i, 1000))

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6), dt=st.floats(0, 0.5))
    def request_fails(self, k: int, dt: float) -> None:
        """An error, a 404, or a transfer its transport cut (no byte for too long)."""
        self.now += dt
        peer, i = self.take(k)
        self.holders[i].discard(peer)  # a peer that fails a chunk no longer counts for it
        self.feed(ChunkFailed(peer, i))

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6), dt=st.floats(0, 0.5))
    def peer_busy(self, k: int, dt: float) -> None:
        self.now += dt
        self.feed(PeerBusy(*self.take(k)))

    @precondition(lambda self: self.pending)
    @rule(k=st.integers(0, 10**6), nbytes=st.integers(1, 999), dt=st.floats(0, 0.5))
    def bytes_arrive(self, k: int, nbytes: int, dt: float) -> None:
        """Some of a chunk's bytes, so far, on a request still in flight: progress only if
        further than any request got (the same half again is none)."""
        self.now += dt
        peer, i = self.pending[k % len(self.pending)]
        if nbytes > self.most.get(i, 0):
            self.most[i] = nbytes
            self.due[i] = self.now
        self.feed(ChunkMoving(peer, i, nbytes))

    @rule(peer=st.sampled_from(PEERS), dt=st.floats(0, 0.5))
    def peer_lost(self, peer: str, dt: float) -> None:
        self.now += dt
        for holders in self.holders.values():
            holders.discard(peer)
        self.feed(PeerLost(peer))

    @rule(dt=st.floats(0.0, 3.0))
    def timer_fires(self, dt: float) -> None:
        self.now += dt
        self.feed(TimerFired())

    @invariant()
    def the_next_timer_is_no_later_than_the_first_deadline(self) -> None:
        if not hasattr(self, "sched"):
            return
        after = self.deadline_after
        coming = [t + after for t in self.due.values() if t + after > self.now]
        if coming:
            wake = self.sched.next_timer(self.now)
            assert wake is not None and wake <= min(coming)

    def teardown(self) -> None:
        """Nothing is served any more: a driver waking the scheduler when it asks (its
        requests time out, and are asked again) sees the download stall, unless nothing it
        asked for is claimed any more (one nobody claims is reported with the orphans, once
        per quiet spell). Not every chunk needs to be: the first stall ends the download."""
        if not hasattr(self, "sched"):
            return
        before = self.stalls
        for _ in range(40 * self.n + 40):
            wake = self.sched.next_timer(self.now)
            claimed = {i for i in self.due if self.holders[i]}
            if self.stalls > before or not claimed or wake is None:
                break
            self.now = max(self.now, wake)
            self.feed(TimerFired())
        claimed = {i for i in self.due if self.holders[i]}
        assert self.stalls > before or not claimed, f"chunks {claimed} asked for, no stall"


StallMachine.TestCase.settings = FAST
test_stall_state_machine = StallMachine.TestCase


class SeederMachine(RuleBasedStateMachine):
    """A :class:`SuperSeeder` answering requesters that fetch some of what they are shown."""

    @initialize(n=st.integers(1, 30), outstanding=st.integers(1, 6), reseed=st.floats(0.1, 3.0))
    def start(self, n: int, outstanding: int, reseed: float) -> None:
        self.keys = [f"c{i}" for i in range(n)]
        self.seeder = SuperSeeder(outstanding, reseed, starve_after_s=4 * reseed)
        self.now = 0.0
        self.shown: dict[str, set[str]] = {}  # requester -> keys it was shown
        self.handed_at: dict[str, tuple[str, float]] = {}  # key -> (owner, when) as seen
        self.pending: set[str] = set()  # requesters with a chunk request at the seed now
        self.heard: dict[str, float] = {}  # requester -> when the seed last heard of it
        self.handed: dict[str, bool] = {}  # requester -> handed chunks since it last grew

    def offer(self, requester: str) -> list[str]:
        before = dict(self.seeder.owner)
        held = sum(
            1 for k, (who, _) in before.items() if who == requester and not self.seeder.served[k]
        )
        grant = (requester, self.keys[0])
        allowed = self.seeder.allowance.get(grant, (self.seeder.outstanding, False))[0]
        shown = [self.keys[i] for i in self.seeder.offer(self.keys, requester, self.now)]
        owners = self.seeder.owner
        fresh = [k for k in shown if owners.get(k) == (requester, self.now) != before.get(k)]
        grown, base = self.seeder.allowance[grant][0], self.seeder.outstanding
        share = len(self.keys) // (2 * self.seeder.askers[self.keys[0]])
        cap = max(base, min(seeding.GROWTH * base, share))
        assert base <= grown <= cap, "over its share"
        allowed = min(allowed, cap)
        if grown > allowed:  # only for a requester that fetched half of what it was handed
            assert 2 * held <= allowed and self.handed.get(requester), "allowance grew too soon"
            assert grown <= 2 * allowed
        if cap > base and 2 * held <= allowed:
            self.handed[requester] = False
        if cap > base and 2 * held > grown:  # topped up only once half is fetched
            assert not fresh, "topped up a requester holding over half its hand-outs"
        assert len(fresh) <= max(0, grown - held)  # a share shrinks as requesters come
        self.handed[requester] = self.handed.get(requester, False) or bool(fresh)
        for key in shown:
            owner = self.seeder.owner.get(key, (None, 0.0))[0]
            if owner != requester:  # only a chunk long in the swarm is shown to anyone
                assert self.seeder.served[key], "showed a chunk handed to someone else"
                since = self.seeder.spread_since[key]
                assert self.now - since >= self.seeder.starve_after_s, "shown before starving"
                continue
            prev = before.get(key)
            if prev is not None and prev[0] != requester:  # taken over from a quiet owner
                assert not self.seeder.served[key], "re-handed a chunk already fetched"
                if self.now - prev[1] <= self.seeder.reseed_after_s:  # its owner went quiet
                    assert prev[0] not in self.pending, "taken from an owner asking for it"
                    last = max(prev[1], self.heard.get(prev[0], prev[1]))
                    assert self.now - last > self.seeder.quiet_floor_s, "re-handed too soon"
        self.shown.setdefault(requester, set()).update(shown)
        return shown

    @rule(requester=st.sampled_from(["r0", "r1", "r2", "r3"]), dt=st.floats(0.0, 1.5))
    def requester_asks(self, requester: str, dt: float) -> None:
        self.now += dt
        self.offer(requester)

    @rule(requester=st.sampled_from(["r0", "r1", "r2", "r3"]), pending=st.booleans())
    def requester_asks_for_a_chunk_or_stops(self, requester: str, pending: bool) -> None:
        self.seeder.contact(requester, pending, self.now)
        self.heard[requester] = self.now
        (self.pending.add if pending else self.pending.discard)(requester)

    @rule(requester=st.sampled_from(["r0", "r1", "r2", "r3"]))
    def requester_found_gone(self, requester: str) -> None:
        self.seeder.release(requester)  # a pushed offer did not reach it
        held = [k for k, (who, _) in self.seeder.owner.items() if who == requester]
        assert all(self.seeder.served[k] for k in held), "kept a gone requester's chunks"

    @rule(data=st.data(), requester=st.sampled_from(["r0", "r1", "r2", "r3"]))
    def requester_fetches(self, data: st.DataObject, requester: str) -> None:
        """Any requester may ask for any chunk shown to anyone (a stale claim, or a thief):
        a fresh chunk and an owner's are always served, and a fetch takes a chunk from its
        owner only if it was handed to the fetcher before, or its owner went quiet."""
        shown = sorted({k for keys in self.shown.values() for k in keys})
        if not shown:
            return
        key = data.draw(st.sampled_from(shown))
        seeder = self.seeder
        owner, served, previous = (
            seeder.owner.get(key),
            seeder.served[key],
            seeder.previous.get(key),
        )
        lapsed = owner is not None and seeder._lapsed(owner, self.now)
        ok = seeder.may_serve(key, requester, self.now)
        if not served or (owner is not None and owner[0] == requester):
            assert ok, "refused a fresh chunk, or its owner"
        if not ok:
            return
        seeder.note_served(key, requester, self.now)
        after = seeder.owner.get(key)
        if after != owner:
            assert owner is not None and after == (requester, owner[1]) and not served
            assert requester == previous or lapsed, "a fetch took a chunk from its owner"

    @invariant()
    def no_requester_holds_more_than_its_largest_allowance_unfetched(self) -> None:
        if not hasattr(self, "seeder"):
            return
        unfetched: dict[str, int] = {}
        for key, (owner, _) in self.seeder.owner.items():
            if not self.seeder.served[key]:
                unfetched[owner] = unfetched.get(owner, 0) + 1
        most = seeding.GROWTH * self.seeder.outstanding
        assert all(v <= most for v in unfetched.values()), unfetched

    def teardown(self) -> None:
        """Liveness: requesters that fetch everything they are shown get every chunk out of
        the seed, even when some requesters went quiet holding chunks."""
        if not hasattr(self, "seeder"):
            return
        for _ in range(len(self.keys) + 10):
            if all(self.seeder.served[k] for k in self.keys):
                break
            self.now += self.seeder.reseed_after_s + 0.1  # quiet owners' chunks free up
            for key in self.offer("r-active"):
                if not self.seeder.served[key]:
                    self.seeder.note_served(key)
        assert all(self.seeder.served[k] for k in self.keys)
        # a requester that reaches nobody but the seed is shown everything once it starved
        self.seeder.offer(self.keys, "r-isolated", self.now)  # the seed notes what spread
        self.now += self.seeder.starve_after_s + 0.01
        shown = self.seeder.offer(self.keys, "r-isolated", self.now)
        assert sorted(shown) == list(range(len(self.keys)))


SeederMachine.TestCase.settings = FAST
test_seeder_state_machine = SeederMachine.TestCase


def test_a_quiet_owner_s_chunks_go_to_the_next_requester() -> None:
    """An owner with no request at the seed for twice the 90th percentile of the idle gaps
    seen (a requester's answer to its next question) loses its unfetched chunks; an owner
    with a request waiting keeps them however long it waits."""
    seeder, keys = SuperSeeder(outstanding=1, reseed_after_s=5.0), ["a", "b"]
    assert seeder.offer(keys, "busy", 0.0) == [0]
    assert seeder.offer(keys, "gone", 0.0) == [1]
    for i in range(seeding.MIN_GAPS):  # "busy" asks again 0.1 s after each answer
        seeder.contact("busy", True, 0.15 * i)
        assert seeder.quiet_after_s is None  # too few gaps seen to trust
        seeder.contact("busy", False, 0.15 * i + 0.05)
    seeder.contact("busy", True, 1.2)  # and waits for a slot from now on
    assert seeder.quiet_after_s is not None and abs(seeder.quiet_after_s - 0.2) < 1e-9
    seeder.contact("gone", True, 1.1)
    seeder.contact("gone", False, 1.2)  # its answer went out; it never asks again
    assert seeder.offer(keys, "next", 1.39) == []  # 0.19 s idle: not yet
    assert seeder.offer(keys, "next", 1.41) == [1]  # b; a's owner waits for its turn
    assert seeder.offer(keys, "next", 4.9) == [1]
    seeder.note_served("b")
    assert seeder.offer(keys, "gone", 4.95) == []  # back: b is in the swarm, a is busy's


def test_a_chunk_fetched_by_its_quiet_owner_is_refused_to_the_next_one() -> None:
    """Found in the simulator (100 peers at 20 ms: 26 of the seed's 789 uploads were such
    seconds): a chunk handed to r0, which went quiet, was handed to r1; r0 asked after all
    and fetched it first. It owns it now, and r1 takes it from the swarm: the seed refuses
    it until it starves."""
    seeder, keys = SuperSeeder(outstanding=1, reseed_after_s=0.5, starve_after_s=2.0), ["a"]
    assert seeder.offer(keys, "r0", 0.0) == [0]
    assert seeder.offer(keys, "r1", 0.6) == [0]  # r0 lapsed
    assert seeder.may_serve("a", "r0", 0.7)  # never fetched: anyone may
    seeder.note_served("a", "r0", 0.7)
    assert seeder.owner["a"][0] == "r0" and seeder.may_serve("a", "r0", 0.8)
    assert not seeder.may_serve("a", "r1", 0.8)
    assert not seeder.may_serve("a", "r2", 2.7)
    assert seeder.may_serve("a", "r1", 2.81)  # starved (first seen fetched at 0.8)


def test_a_peer_fetching_a_chunk_handed_to_another_does_not_take_it() -> None:
    """Any peer may ask the seed for any chunk: one that fetches chunks handed to others
    first must not make the seed withhold them from their owners (they would wait
    ``starve_after_s``); after it, only the owner gets it."""
    seeder, keys = SuperSeeder(outstanding=1, reseed_after_s=5.0), ["a"]
    assert seeder.offer(keys, "owner", 0.0) == [0]
    assert seeder.may_serve("a", "thief", 0.1)
    seeder.note_served("a", "thief", 0.1)
    assert seeder.may_serve("a", "owner", 0.2) and not seeder.may_serve("a", "thief", 0.2)
    assert seeder.offer(keys, "owner", 0.3) == [0]  # still shown as its own


def test_the_seed_forgets_the_oldest_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer hands out ~768 chunks a version for as long as it trains: what it notes of
    each (owner, uploads, first seen spread) is bounded, the oldest forgotten."""
    monkeypatch.setattr(seeding, "MAX_KEYS", 4)
    seeder = SuperSeeder(outstanding=3)
    for v in range(5):
        keys = [f"{v}-{i}" for i in range(3)]
        assert seeder.offer(keys, "r", float(v)) == [0, 1, 2]
        for key in keys:
            assert seeder.may_serve(key, "r", float(v))
            seeder.note_served(key, "r", float(v))
    tables = (seeder.owner, seeder.served, seeder.spread_since, seeder.previous)
    assert all(len(t) <= 4 for t in tables)
    assert "4-2" in seeder.owner and "0-0" not in seeder.owner and seeder.served["4-2"] == 1


def test_quiet_factor_0_leaves_hand_outs_to_reseed_after_s_alone() -> None:
    seeder, keys = SuperSeeder(outstanding=1, reseed_after_s=2.0, quiet_factor=0.0), ["a"]
    assert seeder.offer(keys, "gone", 0.0) == [0]
    for i in range(2 * seeding.MIN_GAPS):  # others' round trips: a threshold it ignores
        seeder.contact("other", True, 0.1 * i)
        seeder.contact("other", False, 0.1 * i + 0.05)
    assert seeder.offer(keys, "next", 1.9) == []
    assert seeder.offer(keys, "next", 2.1) == [0]


def test_before_any_idle_gap_an_owner_is_quiet_only_after_reseed_after_s() -> None:
    seeder, keys = SuperSeeder(outstanding=1, reseed_after_s=2.0), ["a"]
    assert seeder.offer(keys, "r0", 0.0) == [0]
    assert seeder.offer(keys, "r1", 1.9) == []
    assert seeder.offer(keys, "r1", 2.1) == [0]


def test_a_released_requester_s_chunks_go_to_the_next_one_at_once() -> None:
    seeder, keys = SuperSeeder(outstanding=2, reseed_after_s=2.0), ["a", "b", "c"]
    assert seeder.offer(keys, "gone", 0.0) == [0, 1]
    seeder.note_served("a")
    assert seeder.offer(keys, "next", 0.1) == [2]  # b is still handed to "gone"
    seeder.release("gone")
    assert seeder.offer(keys, "next", 0.2) == [1, 2]  # b at once; a is in the swarm already


def test_a_released_chunk_fetched_anyway_is_not_handed_out_again() -> None:
    """Found by the state machine: the push to a requester failed, yet it still fetched a chunk
    it had been shown (its have-map answer came earlier). That chunk is in the swarm: nobody
    gets it as fresh (the seed would upload it twice), and it is shown to all once starved."""
    seeder, keys = SuperSeeder(outstanding=2, reseed_after_s=0.5, starve_after_s=2.0), ["a", "b"]
    assert seeder.offer(keys, "r1", 0.0) == [0, 1]
    seeder.release("r1")
    seeder.note_served("a")  # r1 fetched it all the same
    assert seeder.offer(keys, "r0", 0.1) == [1]  # b, freed; not a
    assert seeder.offer(keys, "r0", 2.2) == [0, 1]  # a starved: shown to anyone asking
