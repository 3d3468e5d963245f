"""Chunk indices shared by every download in the process, and the empty holder set.

Memory, not speed: ints above 256 are separate 28-byte objects, so each download that built
its indices with ``range`` (and each request that computed one) paid ~43 KB per 1,525 chunks
for its own copies; the simulator runs thousands of downloads in one process. :func:`indices`
and :func:`shared` hand out one object per value instead. :data:`NOBODY` stands for a chunk no
peer claims (most chunks, early in a download), so that each costs no empty set of its own.
"""

from __future__ import annotations

NOBODY: frozenset[str] = frozenset()  # the holders of a chunk nobody claims (never mutated)

_SHARED: list[int] = []  # the shared object of each index handed out so far


def indices(n: int) -> list[int]:
    """Indices ``0..n-1``, as the objects shared by every download of the process."""
    if len(_SHARED) < n:
        _SHARED.extend(range(len(_SHARED), n))
    return _SHARED[:n]


def shared(index: int) -> int:
    """The shared object for ``index`` (one handed out by :func:`indices` already)."""
    return _SHARED[index]
