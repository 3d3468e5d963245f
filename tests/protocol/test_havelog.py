"""Have logs: a long poll is answered only what its follower lacks (``p2p_sync.protocol.havelog``),
on
the wire (``GET /have?known=N&log=ID``) and in the follower (``DataPlaneSource.have``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p_sync.errors import PeerError
from p2p_sync.protocol.havelog import LOG_ID, HaveLog
from p2p_sync.transport.download import DataPlaneSource, HaveCursor
from tests.helpers import snapshot_manifest

# a have-map's life: chunks landing (a set of indices each step), now and then one dropped
steps = st.lists(
    st.one_of(
        st.tuples(st.just("land"), st.sets(st.integers(0, 63), max_size=8)),
        st.tuples(st.just("drop"), st.integers(0, 63)),
    ),
    max_size=40,
)


@given(steps)
def test_a_follower_applying_the_answers_always_sees_the_whole_map(life: list) -> None:
    """After every answer the follower's view is the map (replaced on a whole answer, else
    grown), and while nothing leaves the map each index is sent to it once."""
    held: set[int] = set()
    log, view, cursor, sent, dropped = HaveLog(), set(), (None, -1), 0, False
    for kind, arg in life:
        if kind == "land":
            held |= arg
        else:
            dropped |= arg in held
            held.discard(arg)
        log = log.sync(sorted(held))
        start, indices = log.since(*cursor)
        view = set(indices) if start == 0 else view | set(indices)
        cursor, sent = (log.ident, start + len(indices)), sent + len(indices)
        assert view == held and cursor[1] == len(log)
        assert log.waits(log.ident, len(log))
    if not dropped and life:
        assert sent == len(held)


@given(st.lists(st.lists(st.integers(0, 63), max_size=8), max_size=20))
def test_growing_a_log_by_arrivals_is_syncing_it_with_the_whole_map(arrivals: list) -> None:
    """``grow`` (the chunks that arrived, in order) keeps the log ``sync`` would, under the
    same name, each index once, in arrival order."""
    grown, synced, held = HaveLog(), HaveLog(), []
    for batch in arrivals:
        held += [i for i in dict.fromkeys(batch) if i not in held]
        grown = grown.grow(batch)
        synced = synced.sync(held)
        assert grown.order == held == synced.order and grown.members == set(held)
    assert grown.ident == grown.grow([]).ident


def test_a_chunk_leaving_starts_a_new_log_and_old_followers_get_the_whole_map() -> None:
    log = HaveLog().sync([0, 1, 2])
    first = log.ident
    assert LOG_ID.match(first) and log.since(first, 2) == (2, [2])
    assert log.sync([0, 1, 2, 5]).since(first, 3) == (3, [5])  # grown: the same log
    again = log.sync([0, 2, 5])  # chunk 1 found corrupt and dropped
    assert again.ident != first
    assert again.since(first, 4) == (0, [0, 2, 5]) and not again.waits(first, 4)
    assert again.since(again.ident, 9) == (0, [0, 2, 5])  # more than it has: the whole map


class _Client:
    """A peer client whose ``GET /have`` answers are given (a hostile peer's included)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers, self.urls = answers, []

    async def get_feed(self, url: str) -> AsyncIterator[Any]:
        self.urls.append(url)
        while self.answers:
            yield self.answers.pop(0)


def _ask(answers: list[Any], since: HaveCursor) -> tuple[list[int], HaveCursor, list[str]]:
    """The first answer of a feed of ``answers``."""
    client = _Client(answers)
    source = DataPlaneSource(client, lambda: ["http://p:1"])  # type: ignore[arg-type]
    m = snapshot_manifest(b"x" * 100)

    async def first() -> tuple[list[int], HaveCursor]:
        async with aclosing(source.have_feed("http://p:1", m, since)) as feed:
            async for have, after in feed:
                return have, after
        raise AssertionError("the feed ended without an answer")

    have, after = asyncio.run(first())
    return have, after, client.urls


def test_the_follower_asks_from_where_it_stands_and_keeps_the_log() -> None:
    log = "ab" * 8
    have, after, urls = _ask([{"have": [0, 3], "from": 0, "log": log}], HaveCursor())
    assert have == [0, 3] and after == HaveCursor(2, log) and urls[0].endswith("?feed=1")
    have, after, urls = _ask([{"have": [7], "from": 2, "log": log}], after)
    assert (
        have == [7]
        and after == HaveCursor(3, log)
        and urls[0].endswith(f"?known=2&log={log}&feed=1")
    )
    have, after, _ = _ask([{"have": [1, 2]}], HaveCursor(5))  # a seed: whole lists, no log
    assert have == [1, 2] and after == HaveCursor(2)


@pytest.mark.parametrize(
    "answer",
    [
        {"have": [1], "from": 7, "log": "ab" * 8},  # from where we never were
        {"have": [1], "from": 0, "log": "../etc"},  # a log name that is no log name
        {"have": [1], "from": "2", "log": "ab" * 8},
        {"have": "all"},
    ],
)
def test_a_malformed_have_answer_is_a_peer_error(answer: dict) -> None:
    with pytest.raises(PeerError):
        _ask([answer], HaveCursor(2, "ab" * 8))
