"""Bounded memories (``p2p_sync.bounded``): the newest entries stay, at most ``limit`` of them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from p2p_sync.bounded import remember, trim


@given(st.lists(st.integers(0, 20), max_size=60), st.integers(1, 8))
def test_remember_keeps_the_most_recently_remembered_keys(keys: list[int], limit: int) -> None:
    entries: dict[int, int] = {}
    for n, key in enumerate(keys):
        remember(entries, key, n, limit)
    newest_first = list(dict.fromkeys(reversed(keys)))[:limit]
    assert list(entries) == list(reversed(newest_first))  # oldest first, as inserted
    assert all(entries[k] == max(n for n, x in enumerate(keys) if x == k) for k in entries)


def test_trim_forgets_the_oldest_first() -> None:
    entries = {"a": 1, "b": 2, "c": 3}
    trim(entries, 2)
    assert entries == {"b": 2, "c": 3}
    trim(entries, 5)
    assert entries == {"b": 2, "c": 3}


def test_trim_returns_what_it_forgot_oldest_first() -> None:
    entries = {"a": 1, "b": 2, "c": 3}
    assert trim(entries, 1) == [1, 2] and entries == {"c": 3}
    assert trim(entries, 1) == []
