"""Rarest first: the order in which the chunk scheduler (``protocol.swarm``) asks for chunks.

The fewest holders first; ties broken by a seeded hash of the chunk's index, so peers with
different seeds start on different chunks. The hash order is fixed for a download, so it is
taken once, as each chunk's rank; a chunk's place in the order is then one int (its holders,
its rank and its index side by side), and the sort after every event compares small ints
instead of (count, digest) tuples built by a key function.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Iterable, Mapping, Sized


class ChunkOrder:
    """The rarest-first order of a download's missing ``chunks``, ties broken by their hash
    salted with ``seed``."""

    __slots__ = ("_base", "_shift", "_mask")

    def __init__(self, chunks: Iterable[int], seed: int) -> None:
        salt = seed.to_bytes(8, "little", signed=True)

        def digest(i: int) -> bytes:
            return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8, salt=salt).digest()

        by_rank = sorted(chunks, key=digest)
        last = max(by_rank, default=-1)
        bits = max(last, 0).bit_length()  # an index's
        self._shift = bits + len(by_rank).bit_length()  # past the rank
        code = "I" if self._shift <= 8 * array("I").itemsize else "Q"  # half, where it fits
        self._base = array(code, bytes(array(code).itemsize * (last + 1)))  # rank, index
        for rank, i in enumerate(by_rank):
            self._base[i] = rank << bits | i
        self._mask = (1 << bits) - 1

    def rarest(self, chunks: Collection[int], holders: Mapping[int, Sized], most: int) -> list[int]:
        """``chunks`` rarest first by their ``holders`` (only the rarest if ``most`` is 1)."""
        if len(chunks) <= 1:
            return list(chunks)
        base, shift, mask = self._base, self._shift, self._mask
        keys = [len(holders[i]) << shift | base[i] for i in chunks]
        if most == 1:
            return [min(keys) & mask]
        keys.sort()
        return [k & mask for k in keys]
