"""The super-seeder's offers as first written: each a Python pass over the whole manifest,
key by key. Kept as the specification that :meth:`SuperSeeder.offer`'s arrays must match,
offer for offer and table for table (``test_seeder_offers.py``), and as the baseline of
``benchmarks/seeder.py``. The rest is the seeder's own: with no views (this offer builds
none), its copies into them do nothing."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from p2p_sync.protocol.seeding import SuperSeeder


class ScanningSeeder(SuperSeeder):
    """A seeder whose offers pass over the manifest."""

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
