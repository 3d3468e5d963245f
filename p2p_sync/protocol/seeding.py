"""Super-seeding: which chunks a seed shows to each requester (sans-I/O, clock passed in).

A seed that shows every requester every chunk uploads the same popular chunks many times over
while the swarm's own upload capacity sits idle. Like BitTorrent's super-seeding, the seed hands
each requester a few chunks of its own (up to ``outstanding`` handed out and not yet served) and
shows a chunk to someone else only if it was never fetched within ``reseed_after_s`` of being
handed out, so a requester that vanished cannot stall the swarm (a chunk that was fetched is
in the swarm already: handing it out again would only add to the seed's upload). Everything
else the requesters take from each other, and the seed's upload stays near one copy of the
payload however many peers there are.

And once a chunk is out in the swarm, the seed uploads it again only to the peer that owns it
(``SuperSeeder.may_serve``; the others it was shown to, when an owner went quiet and the chunk
was handed on, get a 404 and take it from their peers), until it starves (below).

Except for requesters who cannot reach the peers holding a chunk: two volunteers behind
different NATs never meet (without a relay), and one that can reach only the seed would wait
forever for chunks the seed handed to others. So a chunk that has been in the swarm for
``starve_after_s`` (the seed first saw it fetched that long ago) is shown to every requester
still asking: one that lacks it by then can get it from nobody else. In a swarm whose members
reach each other a chunk spreads in seconds, and a requester asks only for what it lacks, so
this costs the seed little more than the stragglers' own copies.

A requester that crashes silently or exits holding chunks handed to it would keep them from
everyone for ``reseed_after_s`` (or until it comes back): measured in the simulator, such
chunks were the last to spread in swarms with churn, everyone waiting on them. So the seed also
watches its upload slots (:meth:`SuperSeeder.contact`): a live requester that owns unfetched
chunks asks for them (only the seed has them, so they are its rarest), and has a request
here in progress or waiting nearly all the time, idle only for the round trip between one
answer and its next question (plus a back-off when the seed refused it as busy). An owner
with no request here for ``quiet_factor`` times the 90th percentile of those idle gaps (at
least ``quiet_floor_s``; ``reseed_after_s`` before ``MIN_GAPS`` were seen) is taken for gone, and
its unfetched chunks go to the next requester. Taking a live but idle owner for gone costs at
most one more upload of its chunk.

How many: ``outstanding`` at first, per requester and payload. A fixed 8 made a small swarm's
fetch a loop of have-map round trips (one rollout: a poll, then a run of 8 chunks, 66 times for
a 530-chunk patch; at 20 ms a trickle of ~8 MB/s per requester however fast the seed's uplink).
So where half a fair share of the payload (its chunks over twice the requesters that asked for
it) exceeds ``outstanding``, a requester is topped up once half of its allowance is fetched,
and each time it fetched half of what it was handed its allowance doubles (it keeps up: the
seed, not the swarm, is what it waits for), up to ``GROWTH`` times ``outstanding`` and half a
fair share. Where many peers ask, nothing changes: ``outstanding``, topped up chunk by chunk.
Without the fair-share bound a greedy or corrupt requester, which fetches everything it is
handed at once, hoarded chunks the others could then get only from it (simulated, 100 peers at
20 ms with 10% corrupt and 20% churn: the median peer at 1.75x the bound against 1.46x).

The trainer node answers ``GET /have`` with :meth:`SuperSeeder.offer`; the simulator calls the
same method, so what it shows of seeding is true of the node.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from p2p_sync.bounded import remember, trim

MAX_IDLE = 4096  # requesters whose last request here is remembered (the oldest forgotten)
GAPS = 64  # recent idle gaps the quiet threshold follows
MIN_GAPS = 8  # gaps seen before the threshold is trusted (``reseed_after_s`` until then)
GROWTH = 32  # a requester's allowance grows to at most this many times ``outstanding``
MAX_PAYLOADS = 64  # payloads whose requesters are counted (the oldest forgotten)
# chunks whose owner, uploads and spread the seed remembers (the oldest forgotten: a trainer
# publishes ~768 chunks a version for as long as it trains; a forgotten chunk counts as fresh)
MAX_KEYS = 1 << 16


class SeedSettings(Protocol):
    """The seeding fields of ``[publish]`` (read only: both holders are frozen dataclasses)."""

    @property
    def seed_outstanding(self) -> int: ...
    @property
    def reseed_after_s(self) -> float: ...
    @property
    def seed_quiet_factor(self) -> float: ...


@dataclass
class SuperSeeder:
    """Hands out chunks (identified by any hashable key) to requesters."""

    outstanding: int = 256
    reseed_after_s: float = 2.0
    starve_after_s: float = 10.0
    owner: dict[Hashable, tuple[Hashable, float]] = field(default_factory=dict)
    previous: dict[Hashable, Hashable] = field(default_factory=dict)  # handed to before its owner
    served: collections.Counter[Hashable] = field(default_factory=collections.Counter)
    spread_since: dict[Hashable, float] = field(default_factory=dict)  # first seen fetched
    quiet_factor: float = 2.0
    quiet_floor_s: float = 0.05
    busy: set[Hashable] = field(default_factory=set)  # requesters with requests here now
    idle_since: dict[Hashable, float] = field(default_factory=dict)  # their last one ended
    gaps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=GAPS))
    quiet_after_s: float | None = None  # from ``gaps``; None before ``MIN_GAPS`` were seen
    # (requester, payload's first key) -> (chunks it may hold unfetched, handed any since
    # the allowance last grew)
    allowance: dict[tuple[Hashable, Hashable], tuple[int, bool]] = field(default_factory=dict)
    askers: dict[Hashable, int] = field(default_factory=dict)  # requesters per payload

    @classmethod
    def of(cls, settings: SeedSettings) -> SuperSeeder:
        """From the ``[publish]`` seeding fields (``versions.PublishPolicy``, or a simulated
        ``Scenario``): the node and the simulator build the same seeder."""
        return cls(
            settings.seed_outstanding,
            settings.reseed_after_s,
            quiet_factor=settings.seed_quiet_factor,
        )

    def contact(self, requester: Hashable, pending: bool, now: float) -> None:
        """The seed's upload slots changed for ``requester``: it has chunk requests in progress
        or waiting here (``pending``), or has none since ``now``."""
        if not pending:
            self.busy.discard(requester)
            remember(self.idle_since, requester, now, MAX_IDLE)
        elif requester not in self.busy:
            self.busy.add(requester)
            since = self.idle_since.pop(requester, None)
            if since is not None:  # from one answer to its next question: ~ a round trip
                self._idle_gap(now - since)

    def _idle_gap(self, gap: float) -> None:
        """A live requester was idle here for ``gap``: the quiet threshold is ``quiet_factor``
        times the 90th percentile of recent gaps (a busy seed's back-off adds to round trips)."""
        self.gaps.append(gap)
        if len(self.gaps) >= MIN_GAPS:
            p90 = statistics.quantiles(self.gaps, n=10, method="inclusive")[-1]
            self.quiet_after_s = max(self.quiet_floor_s, self.quiet_factor * p90)

    def round_trip_s(self) -> float | None:
        """A typical round trip to a live requester: the median of recent idle gaps (an answer,
        then its next question); None before ``MIN_GAPS`` were seen."""
        return statistics.median(self.gaps) if len(self.gaps) >= MIN_GAPS else None

    def quiet(self, owner: Hashable, handed_at: float, now: float) -> bool:
        """``owner``, handed a chunk at ``handed_at``, asked nothing here for too long."""
        if owner in self.busy or self.quiet_factor <= 0:
            return False
        limit = self.reseed_after_s if self.quiet_after_s is None else self.quiet_after_s
        return now - max(handed_at, self.idle_since.get(owner, handed_at)) > limit

    def note_served(
        self, key: Hashable, requester: Hashable | None = None, now: float = 0.0
    ) -> None:
        """The seed uploaded chunk ``key`` (to ``requester``, if known). Its first fetch by
        the peer it was handed to before (that went quiet, and asked after all) or by anyone
        once its owner went quiet makes that requester the owner: the peer it was handed to
        next then takes it from the swarm (``may_serve``). Anyone else's fetch leaves the
        owner as it is: any peer may ask for any chunk, and one that fetched chunks handed
        to others must not make the seed withhold them from their owners."""
        previous = self.previous.pop(key, None)
        owner = self.owner.get(key)
        if requester is not None and owner is not None and not self.served[key]:
            if requester == previous or (owner[0] != requester and self._lapsed(owner, now)):
                self.owner[key] = (requester, owner[1])
        self.served[key] += 1
        self._bound()

    def may_serve(self, key: Hashable, requester: Hashable, now: float) -> bool:
        """Whether to upload ``key`` to ``requester``: not a chunk already out in the swarm
        that was handed to someone else, unless it starved. A requester asks for a chunk it
        was shown once; one whose hand-out lapsed (it went quiet, and the chunk was handed
        to, and fetched by, the next requester) would otherwise fetch it here a second time
        while peers hold it (simulated, 100 peers at 20 ms: 26 of the seed's 789 uploads).
        Refused, it takes the chunk from the swarm like everyone else (``note_served`` says
        who owns a chunk once fetched)."""
        if not self.served.get(key):
            return True
        owner = self.owner.get(key)
        if owner is not None and owner[0] == requester:
            return True
        return now - self.spread_since.setdefault(key, now) >= self.starve_after_s

    def release(self, requester: Hashable) -> None:
        """``requester`` is gone (an offer pushed to it found nobody): the chunks handed to it
        and not fetched go to the next requester at once, not ``reseed_after_s`` later."""
        for key in [k for k, (who, _) in self.owner.items() if who == requester]:
            if not self.served[key]:
                del self.owner[key]

    def offer(self, keys: Sequence[Hashable], requester: Hashable, now: float) -> list[int]:
        """Indices into ``keys`` to show ``requester``: its own, topped up with fresh ones
        (up to its allowance, once half of it is fetched: see the module docstring). Asked
        for every chunk a seed serves, over the whole manifest: the loop is kept tight."""
        owners, served = self.owner, self.served
        held = self._held(keys, requester)
        grant = (requester, keys[0] if keys else None)
        budget = max(0, self._allowed(grant, len(keys), held) - held)
        full = budget
        out = []
        for i, key in enumerate(keys):
            owner = owners.get(key)
            if owner is not None and owner[0] == requester:
                out.append(i)
            elif served.get(key):  # out in the swarm: shown to anyone once fetched from
                # the seed ``starve_after_s`` ago (``spread_since``: first seen fetched)
                if now - self.spread_since.setdefault(key, now) >= self.starve_after_s:
                    out.append(i)
            elif (owner is None or self._lapsed(owner, now)) and budget > 0:
                # never fetched, and unclaimed or handed out long ago (its owner went quiet);
                # a chunk fetched without an owner (one released while its requester still
                # fetched it) is out in the swarm: shown only once it starves, like any other
                if owner is not None:
                    self.previous[key] = owner[0]
                owners[key], budget = (requester, now), budget - 1
                out.append(i)
        if budget < full:  # handed some: the next half fetched doubles its allowance
            self.allowance[grant] = (self.allowance[grant][0], True)
        self._bound()
        return out

    def _held(self, keys: Sequence[Hashable], requester: Hashable) -> int:
        """How many of ``keys`` are handed to ``requester`` and not fetched yet
        (``served.get``: a Counter's missing key costs a Python call)."""
        owners, served = self.owner, self.served
        return sum(
            1
            for key in keys
            if (o := owners.get(key)) is not None and o[0] == requester and not served.get(key)
        )

    def _bound(self) -> None:
        for table in (self.owner, self.previous, self.served, self.spread_since):
            trim(table, MAX_KEYS)

    def _allowed(self, grant: tuple[Hashable, Hashable], chunks: int, held: int) -> int:
        """What requester ``grant[0]`` may hold unfetched of payload ``grant[1]`` (of
        ``chunks`` chunks) now. Where half a fair share is no more than ``outstanding``, that;
        else doubled each time it fetched half of what it was handed, within ``GROWTH`` and
        half a fair share. 0 while it holds more than half of a grown allowance (it is
        topped up once half is fetched)."""
        payload = grant[1]
        if grant not in self.allowance:  # a new asker for this payload
            remember(self.askers, payload, self.askers.get(payload, 0) + 1, MAX_PAYLOADS)
        share = chunks // (2 * self.askers.get(payload, 1))  # 1: an old count forgotten
        cap = max(self.outstanding, min(share, GROWTH * self.outstanding))
        allowed, handed = self.allowance.get(grant, (self.outstanding, False))
        allowed, grows = min(allowed, cap), cap > self.outstanding
        if grows and 2 * held <= allowed and handed:
            allowed, handed = min(2 * allowed, cap), False  # half fetched: the seed held it back
        remember(self.allowance, grant, (allowed, handed), MAX_IDLE)
        if grows and 2 * held > allowed:
            return 0  # topped up once half is fetched
        return allowed  # where many ask (cap: outstanding), topped up chunk by chunk

    def _lapsed(self, owner: tuple[Hashable, float], now: float) -> bool:
        """A hand-out not fetched in time: ``reseed_after_s`` ago, or its owner went quiet."""
        return now - owner[1] > self.reseed_after_s or self.quiet(*owner, now)


def chunks_behind(budget: float, chunk_bytes: int, followers: int, most: int) -> list[int]:
    """How many chunks each of ``followers`` (in the order announced) gets behind its
    announcement, from ``budget`` bytes: what the seed's uplink carries in the round trip
    before the followers' first requests arrive (idle otherwise). One chunk to each in turn,
    then a second round, up to ``most`` each. More than the round trip holds only spreads the
    uplink over more flows at the start (simulated at 5 ms, 1,000 peers: 64 followers sent
    one chunk each, x1.279 against x1.235 with none; at 20 ms x1.449 against x1.467)."""
    if followers <= 0 or chunk_bytes <= 0 or most <= 0:
        return [0] * max(followers, 0)
    total = min(int(budget // chunk_bytes), most * followers)
    return [total // followers + (1 if j < total % followers else 0) for j in range(followers)]
