"""Have-maps in arrival order, so a long poll answers only what is new (sans-I/O).

Every peer that follows a rollout long-polls its have-map (``GET /have/{digest}?known=N``,
answered once the map is no longer N long). A full answer lists every chunk held, and a
follower asks again about once a round trip while a version arrives, so over a version each
follower was sent O(chunks) indices O(chunks) times: at 763 chunks, 20 ms and 32 followers,
by count ~2 MB of one rollout's uplink for a 100 MB patch (the simulator charged nothing for
it), 4x that at 5 ms and again 2x with 64 KiB chunks; and each answer cost both ends a JSON
list and a set of the whole manifest. Measured on 8 loopback rollouts (100 MB, 128 KiB
chunks): 1.66-2.06 MB of answers before, 0.27 MB with logs.

A :class:`HaveLog` keeps a have-map in the order its chunks arrived. While no chunk leaves it,
it only grows at the end, so its first N entries are the same for every follower, and a
follower that holds N entries of log ``ident`` is answered the entries from N on: each index
crosses the wire once per follower. A chunk leaves a have-map rarely (found corrupt on disk
and dropped); then the log starts over under a new ``ident``, and a follower naming the old
one gets the whole map, as before. A seed's have-map is an offer per requester that can
shrink (a hand-out lapses), so a seed keeps answering whole lists, without a log.

The wire side (``?known=N&log=ID`` -> ``{"have": [...], "from": N, "log": ID}``) is in
``docs/dataplane.md``; the follower's side in ``transport.download``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

LOG_ID = re.compile(r"^[0-9a-f]{16}$")  # how a log is named on the wire


def _new_id() -> str:
    """Random, so a node that restarted never reuses the name of a log a follower holds."""
    return secrets.token_hex(8)


@dataclass
class HaveLog:
    """One have-map's chunk indices in arrival order (indices within one sync in order)."""

    ident: str = field(default_factory=_new_id)
    order: list[int] = field(default_factory=list)
    members: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.order)

    def sync(self, held: Sequence[int]) -> HaveLog:
        """This log once the have-map is ``held``: grown at the end by the new chunks, or,
        if a chunk it listed is gone, a new log (another ``ident``) listing ``held``."""
        now = set(held)
        if not self.members <= now:
            return HaveLog(order=list(held), members=now)
        if len(now) > len(self.members):
            self.order.extend(i for i in held if i not in self.members)
            self.members = now
        return self

    def grow(self, arrived: Sequence[int]) -> HaveLog:
        """This log with ``arrived`` (chunks newly held, in arrival order) at its end: what
        :meth:`sync` does when nothing left, without listing the whole map again."""
        for i in arrived:
            if i not in self.members:
                self.members.add(i)
                self.order.append(i)
        return self

    def since(self, ident: str | None, known: int) -> tuple[int, list[int]]:
        """``(start, indices)``: what a follower holding the first ``known`` entries of log
        ``ident`` lacks, from position ``start``; the whole log (start 0) when it names
        another log, none, or more entries than this one has."""
        if ident == self.ident and 0 <= known <= len(self.order):
            return known, self.order[known:]
        return 0, list(self.order)

    def waits(self, ident: str | None, known: int) -> bool:
        """Whether a long poll from a follower at ``known`` of log ``ident`` has nothing new
        to be told yet (one naming another log is answered at once: the whole map)."""
        return ident == self.ident and known == len(self.order)
