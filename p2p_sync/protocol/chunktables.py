"""Tables keyed by chunk index, kept lean: the scheduler's memory per download.

Memory, not speed: the simulator runs thousands of downloads in one process, and at 1,525
chunks each one's tables were ~1.1 MB (10,000 peers would not fit in 16 GB). Four causes:

* ints above 256 are separate 28-byte objects, so each download that built its indices with
  ``range`` (and each request that computed one) had its own copies: :func:`indices` and
  :func:`shared` hand out one object per value to every download of the process;
* an empty set is 216 bytes, and most chunks have no holder early on: :data:`NOBODY` stands
  for all of them until a first claim;
* Python's dicts and sets never shrink as they empty: the scheduler rebuilds those keyed by
  missing chunks each time a third of them arrived (:func:`shrink`);
* a set grown one ``add`` at a time quadruples its table each time it fills, one grown by
  ``update`` from a dict or a set only doubles it: the scheduler adds a have-map's new
  claims to a peer's sets in one ``update`` (half their tables). Their orders change with
  their tables, and no decision depends on them: ``_avail``'s union is sorted by a total
  key (``rarity``), ``peer_chunks`` is walked only to discard (a lost peer) and to note
  claims of promised chunks (``pushes.claimed``: one pusher's, whose order no output sees).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

NOBODY: frozenset[str] = frozenset()  # the holders of a chunk nobody claims (never mutated)

_SHARED: list[int] = []  # the shared object of each index handed out so far: _SHARED[i] == i
_GROWING = threading.Lock()  # two threads extending at once would misplace every index after


def indices(n: int) -> list[int]:
    """Indices ``0..n-1``, as the objects shared by every download of the process."""
    if len(_SHARED) < n:
        with _GROWING:
            _SHARED.extend(range(len(_SHARED), n))
    return _SHARED[:n]


def shared(index: int) -> int:
    """The shared object for ``index`` (one handed out by :func:`indices` already)."""
    return _SHARED[index]


def shrink(
    holders: dict[int, AbstractSet[str]], *claims: dict[str, set[int]]
) -> dict[int, AbstractSet[str]]:
    """A copy of ``holders`` (in the same order), and each set of each of ``claims`` copied in
    place, each into a table sized for what it holds now (the claims' orders may change: the
    scheduler sorts claims by rarity before it uses them)."""
    for table in claims:
        for key, chunks in table.items():
            table[key] = set(chunks)
    return dict(holders)


def still_missing(indices: frozenset[int], missing: Mapping[int, object]) -> frozenset[int]:
    """Those of ``indices`` in ``missing``, built as ``indices & missing`` built them when
    ``missing`` was a set: CPython walks the right side unless it is the larger (the walk's
    order lays out the result's table, and so its iteration order)."""
    if len(missing) <= len(indices):
        return frozenset(i for i in missing if i in indices)
    return frozenset(i for i in indices if i in missing)


def orphans(holders: Mapping[int, AbstractSet[str]]) -> set[int]:
    """The chunks of ``holders`` that nobody holds, in ascending order into a table sized as
    a set's copy is (``dict``): the set the scheduler kept of them cost 64 KB at 1,525
    chunks, and is read only when a stall is reported."""
    return set(dict.fromkeys(sorted(i for i, h in holders.items() if not h)))
