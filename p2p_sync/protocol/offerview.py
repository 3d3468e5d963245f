"""One manifest's chunks as arrays that mirror a :class:`~p2p_sync.protocol.seeding.SuperSeeder`'s
tables: who owns each chunk and since when, whether it was served, when it was first seen
fetched. An offer is then a few vector operations over the manifest instead of a Python pass
over its keys, and a trainer makes one for every chunk it serves (figures: docs/performance.md).

The seeder's dicts stay the truth: the seeder calls :meth:`OfferView.sync` for every chunk
whose entry it changes, and the view copies that entry. Owners are kept as small ints, one per
requester that owned a chunk of this manifest (``code``); the table is rebuilt from the
current owners when it outgrows them (a requester gone leaves no code behind for long).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

NOBODY = -1  # the owner code of a chunk nobody owns


class OfferView:
    """The chunks ``keys`` (in the manifest's order) as seen in the seeder's tables."""

    def __init__(
        self,
        keys: tuple[Hashable, ...],
        owner: Mapping[Hashable, tuple[Hashable, float]],
        served: Mapping[Hashable, int],
        spread_since: Mapping[Hashable, float],
    ) -> None:
        self.keys = keys
        n = len(keys)
        self.at: dict[Hashable, int] = {}  # a key's first position
        self.more: dict[Hashable, list[int]] = {}  # the others, for a chunk found twice
        for i, key in enumerate(keys):
            if self.at.setdefault(key, i) != i:
                self.more.setdefault(key, []).append(i)
        self.twice = n - len(self.at)  # positions of chunks found before
        self.requesters: list[Hashable] = []  # by code
        self._codes: dict[Hashable, int] = {}
        held = [owner.get(key) for key in keys]
        self.owner = np.array([NOBODY if h is None else self.code(h[0]) for h in held], np.int64)
        self.handed = np.array([0.0 if h is None else h[1] for h in held], np.float64)  # when
        self.served = np.array([bool(served.get(key)) for key in keys], np.bool_)
        # first seen fetched (NaN: not yet noted)
        self.spread = np.array([spread_since.get(key, math.nan) for key in keys], np.float64)

    def positions(self, key: Hashable) -> list[int]:
        """Where ``key`` stands in the manifest (none, one, or more for a chunk found twice)."""
        first = self.at.get(key)
        if first is None:
            return []
        return [first, *self.more.get(key, ())]

    def known(self, requester: Hashable) -> int | None:
        """``requester``'s owner code, if it owned a chunk here since the last renumbering."""
        return self._codes.get(requester)

    def code(self, requester: Hashable) -> int:
        """``requester``'s owner code here (a new one if it never owned a chunk here)."""
        code = self._codes.get(requester)
        if code is None:
            if len(self.requesters) > 2 * len(self.keys) + 16:
                self._recode()
            code = self._codes[requester] = len(self.requesters)
            self.requesters.append(requester)
        return code

    def sync(
        self,
        key: Hashable,
        owner: Mapping[Hashable, tuple[Hashable, float]],
        served: Mapping[Hashable, int],
        spread_since: Mapping[Hashable, float],
    ) -> None:
        """Copy ``key``'s entries from the seeder's tables (no-op for a key not here)."""
        at: int | list[int] | None = self.at.get(key)
        if at is None:
            return
        if key in self.more:
            at = self.positions(key)
        held = owner.get(key)
        self.owner[at] = NOBODY if held is None else self.code(held[0])
        self.handed[at] = 0.0 if held is None else held[1]
        self.served[at] = bool(served.get(key))
        self.spread[at] = spread_since.get(key, math.nan)

    def _recode(self) -> None:
        """Codes for the current owners only, numbered anew (in their old order)."""
        owned = self.owner != NOBODY
        used = np.unique(self.owner[owned])
        self.requesters = [self.requesters[c] for c in used.tolist()]
        self._codes = {r: c for c, r in enumerate(self.requesters)}
        self.owner[owned] = np.searchsorted(used, self.owner[owned])


def distinct_first(keys: Sequence[Hashable], positions: np.ndarray, most: int) -> list[int]:
    """The first positions of the first ``most`` distinct keys among ``positions`` (in order)."""
    out: list[int] = []
    seen: set[Hashable] = set()
    for i in positions.tolist():
        if len(out) >= most:
            break
        key = keys[i]
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out
