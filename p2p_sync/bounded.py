"""Bounded memories: dicts that keep their newest entries (insertion order) and forget the
oldest beyond a limit. Every table a peer can make a node fill (offers pushed to it, peers that
asked it, digests it saw) is one, so no peer can grow a node's memory without bound."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def trim(entries: dict[K, V], limit: int) -> list[V]:
    """Forget the oldest entries of ``entries`` beyond ``limit``; returns their values, oldest
    first (a forgotten waiter may need waking)."""
    return [value for _, value in trim_items(entries, limit)]


def trim_items(entries: dict[K, V], limit: int) -> list[tuple[K, V]]:
    """:func:`trim`, returning the forgotten keys with their values (a copy of them kept
    elsewhere may need forgetting too)."""
    forgotten = []
    while len(entries) > limit:
        key = next(iter(entries))
        forgotten.append((key, entries.pop(key)))
    return forgotten


def remember(entries: dict[K, V], key: K, value: V, limit: int) -> None:
    """Keep ``key`` as the newest entry of ``entries``, then :func:`trim` to ``limit``."""
    entries.pop(key, None)
    entries[key] = value
    trim(entries, limit)
