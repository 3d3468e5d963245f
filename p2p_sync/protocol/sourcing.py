"""Which sources a download follows, in what order, and which it owes a place: one rule.

A download follows at most ``max_sources`` peers (their have-maps and their uplinks). Which
ones matters: a peer behind NAT uploads to nobody but the public peers that follow it, so a
public follower owes it a place beyond that bound (the chunks the trainer handed it would wait
otherwise); and followers that all picked the same first few would queue at the same
uploaders. The node (``runtime.early``, ``runtime.fetch``, ``transport.download``) and the
simulator (``simulations.swarm_sim``) decide by these functions. Sans-I/O: a source is
whatever the caller names peers by (URLs, indices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def owed(behind_nat: bool, follower_public: bool) -> bool:
    """Whether a follower owes a source a place beyond ``max_sources`` (and asks it first):
    the source is behind NAT and the follower is public. Only public peers can fetch from
    such a source, so the chunks the trainer handed it would otherwise wait for
    ``SuperSeeder.starve_after_s``."""
    return behind_nat and follower_public


def follow_order(
    sources: Iterable[T],
    trusted: Callable[[T], bool],
    behind_nat: Callable[[T], bool],
    rank: Callable[[T], Any],
) -> list[T]:
    """The order in which a download follows ``sources``: trusted ones (given, proven) first,
    then those behind NAT (only public peers can fetch from them), then the rest by
    ``rank``, an order of the follower's own (followers that all took the same first few
    would queue at the same uploaders). Stable: equal keys keep the order given."""
    return sorted(sources, key=lambda s: (not trusted(s), not behind_nat(s), rank(s)))


def takes(following: int, limit: int, is_owed: bool) -> bool:
    """Whether a download that follows ``following`` sources takes one more: while it
    follows fewer than ``limit``, or beyond that when it owes the source (``owed``)."""
    return following < limit or is_owed


def followed(order: Iterable[T], limit: int, owes: Callable[[T], bool]) -> list[T]:
    """The sources a download follows, taken from ``order`` (``follow_order``) by
    ``takes``: the first ``limit``, and every owed one beyond."""
    out: list[T] = []
    for source in order:
        if takes(len(out), limit, owes(source)):
            out.append(source)
    return out
