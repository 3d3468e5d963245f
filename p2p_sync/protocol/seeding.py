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

Cost: serving a chunk wakes its requester's have feed, so a trainer makes an offer for every
chunk it serves, and a pass over the manifest per offer made each version quadratic in its
chunks. Offers work instead on arrays that mirror the tables for the manifests offered lately
(:mod:`p2p_sync.protocol.offerview`); the tables stay the truth, and every method that changes
a chunk's entry has the arrays copy it.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from p2p_sync.bounded import remember, trim_items
from p2p_sync.protocol.offerview import OfferView, distinct_first

MAX_IDLE = 4096  # requesters whose last request here is remembered (the oldest forgotten)
GAPS = 64  # recent idle gaps the quiet threshold follows
MIN_GAPS = 8  # gaps seen before the threshold is trusted (``reseed_after_s`` until then)
GROWTH = 32  # a requester's allowance grows to at most this many times ``outstanding``
MAX_PAYLOADS = 64  # payloads whose requesters are counted (the oldest forgotten)
# chunks whose owner, uploads and spread the seed remembers (the oldest forgotten: a trainer
# publishes ~768 chunks a version for as long as it trains; a forgotten chunk counts as fresh)
MAX_KEYS = 1 << 16
MAX_VIEWS = 8  # manifests whose chunks are mirrored as arrays for offers (the oldest dropped)


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
    # the manifests offered lately, as arrays (``offerview``), by their keys
    views: dict[tuple[Hashable, ...], OfferView] = field(
        default_factory=dict, repr=False, compare=False
    )

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
        self._sync(key)
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
        return now - self._spread(key, now) >= self.starve_after_s

    def release(self, requester: Hashable) -> None:
        """``requester`` is gone (an offer pushed to it found nobody): the chunks handed to it
        and not fetched go to the next requester at once, not ``reseed_after_s`` later."""
        for key in [k for k, (who, _) in self.owner.items() if who == requester]:
            if not self.served[key]:
                del self.owner[key]
                self._sync(key)

    def offer(self, keys: Sequence[Hashable], requester: Hashable, now: float) -> list[int]:
        """Indices into ``keys`` to show ``requester``, ascending: its own (handed to it, or
        fetched by it from a quiet owner), those out in the swarm for ``starve_after_s``, and
        fresh ones up to its allowance, once half of it is fetched (see the module
        docstring), the first in ``keys``' order. Asked for every chunk a seed serves: it
        works on the manifest's arrays (``offerview``), not key by key."""
        view = self._view(keys)
        code = view.known(requester)
        own = view.owner == code if code is not None else np.zeros(len(keys), np.bool_)
        others_served = view.served & ~own
        held = int(np.count_nonzero(own & ~view.served))
        grant = (requester, keys[0] if keys else None)
        budget = max(0, self._allowed(grant, len(keys), held) - held)
        self._note_spread(view, np.flatnonzero(others_served & np.isnan(view.spread)), now)
        show = own | (others_served & (now - view.spread >= self.starve_after_s))
        if budget:
            free = ~view.served & ~own
            free &= (view.owner < 0) | self._lapsed_among(view, free, now)
            first = np.flatnonzero(free)[: budget + view.twice]  # enough for budget keys
            handed = distinct_first(view.keys, first, budget)
            for key in [view.keys[i] for i in handed]:
                self._hand(key, requester, now)
                show[view.positions(key)] = True
            if handed:  # handed some: the next half fetched doubles its allowance
                self.allowance[grant] = (self.allowance[grant][0], True)
        self._bound()
        return np.flatnonzero(show).tolist()

    def _hand(self, key: Hashable, requester: Hashable, now: float) -> None:
        """Hand ``key`` to ``requester`` now (from the owner it had, if any: ``previous``)."""
        owner = self.owner.get(key)
        if owner is not None:
            self.previous[key] = owner[0]
        self.owner[key] = (requester, now)
        self._sync(key)

    def _lapsed_among(self, view: OfferView, among: np.ndarray, now: float) -> np.ndarray:
        """Which chunks of ``view`` are handed out and lapsed (:meth:`_lapsed`), looked
        at only ``among`` those (the rest: False)."""
        lapsed = np.zeros(len(view.keys), np.bool_)
        at = np.flatnonzero(among & (view.owner >= 0))
        handed = view.handed[at]
        late = now - handed > self.reseed_after_s
        if self.quiet_factor > 0 and len(at):
            codes = view.owner[at]
            busy, idle = self._owners_state(view, set(codes.tolist()))
            since = idle[codes]  # the owner's idle time, else its hand-out's: ``quiet``
            last = np.where(np.isnan(since), handed, np.maximum(handed, since))
            limit = self.reseed_after_s if self.quiet_after_s is None else self.quiet_after_s
            late |= ~busy[codes] & (now - last > limit)
        lapsed[at] = late
        return lapsed

    def _owners_state(self, view: OfferView, codes: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """By owner code: whether it has requests here now, and since when it has none (NaN:
        unknown), filled in for ``codes``."""
        busy = np.zeros(len(view.requesters), np.bool_)
        idle = np.full(len(view.requesters), math.nan)
        for c in codes:
            owner = view.requesters[c]
            busy[c] = owner in self.busy
            idle[c] = self.idle_since.get(owner, math.nan)
        return busy, idle

    def _note_spread(self, view: OfferView, at: np.ndarray, now: float) -> None:
        """Chunks fetched since an offer last looked (at positions ``at``) are first seen
        out in the swarm now, in the manifest's order."""
        for i in distinct_first(view.keys, at, len(at)):
            self._spread(view.keys[i], now)

    def _spread(self, key: Hashable, now: float) -> float:
        """When ``key`` was first seen out in the swarm (``now`` if this is the first time)."""
        since = self.spread_since.get(key)
        if since is None:
            since = self.spread_since[key] = now
            self._sync(key)
        return since

    def _view(self, keys: Sequence[Hashable]) -> OfferView:
        """The arrays of manifest ``keys`` (built from the tables the first time)."""
        views = self.views
        for view in views.values():  # the caller's own tuple: no hashing of every key
            if view.keys is keys:
                break
        else:
            ident = keys if isinstance(keys, tuple) else tuple(keys)
            view = views.get(ident) or OfferView(ident, self.owner, self.served, self.spread_since)
        if next(reversed(views.values()), None) is not view:
            remember(views, view.keys, view, MAX_VIEWS)  # the newest: the oldest go first
        return view

    def _sync(self, key: Hashable) -> None:
        """``key``'s entries changed: every view holding it copies them."""
        for view in self.views.values():
            view.sync(key, self.owner, self.served, self.spread_since)

    def _bound(self) -> None:
        for table in (self.owner, self.previous, self.served, self.spread_since):
            for key, _ in trim_items(table, MAX_KEYS):  # the oldest forgotten: in views too
                self._sync(key)

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
