"""Super-seeding: which chunks a seed shows to each requester (sans-I/O, clock passed in).

A seed that shows every requester every chunk uploads the same popular chunks many times over
while the swarm's own upload capacity sits idle. Like BitTorrent's super-seeding, the seed hands
each requester a few chunks of its own (up to ``outstanding`` handed out and not yet served) and
shows a chunk to someone else only if it was never fetched within ``reseed_after_s`` of being
handed out, so a requester that vanished cannot stall the swarm (a chunk that was fetched is
in the swarm already: handing it out again would only add to the seed's upload). Everything
else the requesters take from each other, and the seed's upload stays near one copy of the
payload however many peers there are.

Except for requesters who cannot reach the peers holding a chunk: two volunteers behind
different NATs never meet (without a relay), and one that can reach only the seed would wait
forever for chunks the seed handed to others. So a chunk that has been in the swarm for
``starve_after_s`` (the seed first saw it fetched that long ago) is shown to every requester
still asking: one that lacks it by then can get it from nobody else. In a swarm whose members
reach each other a chunk spreads in seconds, and a requester asks only for what it lacks, so
this costs the seed little more than the stragglers' own copies.

The trainer node answers ``GET /have`` with :meth:`SuperSeeder.offer`; the simulator calls the
same method, so what it shows of seeding is true of the node.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class SuperSeeder:
    """Hands out chunks (identified by any hashable key) to requesters."""

    outstanding: int = 256
    reseed_after_s: float = 2.0
    starve_after_s: float = 10.0
    owner: dict[Hashable, tuple[Hashable, float]] = field(default_factory=dict)
    served: collections.Counter[Hashable] = field(default_factory=collections.Counter)
    spread_since: dict[Hashable, float] = field(default_factory=dict)  # first seen fetched

    def starved(self, key: Hashable, now: float) -> bool:
        """Fetched from the seed ``starve_after_s`` ago or longer: shown to anyone asking."""
        if not self.served[key]:
            return False
        return now - self.spread_since.setdefault(key, now) >= self.starve_after_s

    def note_served(self, key: Hashable) -> None:
        """The seed uploaded chunk ``key`` (to anyone)."""
        self.served[key] += 1

    def release(self, requester: Hashable) -> None:
        """``requester`` is gone (an offer pushed to it found nobody): the chunks handed to it
        and not fetched go to the next requester at once, not ``reseed_after_s`` later."""
        for key in [k for k, (who, _) in self.owner.items() if who == requester]:
            if not self.served[key]:
                del self.owner[key]

    def offer(self, keys: Sequence[Hashable], requester: Hashable, now: float) -> list[int]:
        """Indices into ``keys`` to show ``requester``: its own, topped up with fresh ones."""
        budget, served = self.outstanding, self.served
        for key in keys:
            owner = self.owner.get(key)
            if owner is not None and owner[0] == requester and not served[key]:
                budget -= 1
        out = []
        for i, key in enumerate(keys):
            owner = self.owner.get(key)
            if (owner is not None and owner[0] == requester) or self.starved(key, now):
                out.append(i)
            elif (
                not served[key]
                and (owner is None or now - owner[1] > self.reseed_after_s)
                and budget > 0
            ):
                # never fetched, and unclaimed or handed out long ago (its owner went quiet);
                # a chunk fetched without an owner (one released while its requester still
                # fetched it) is out in the swarm: shown only once it starves, like any other
                self.owner[key], budget = (requester, now), budget - 1
                out.append(i)
        return out
