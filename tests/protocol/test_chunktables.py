"""The scheduler's lean chunk tables: shared index objects, intersections and orphans that
equal what plain sets would give, and tables rebuilt with their contents and order kept."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from p2p_sync.protocol import chunktables
from p2p_sync.protocol.chunktables import NOBODY, indices, orphans, shared, shrink, still_missing

SMALL_SETS = st.frozensets(st.integers(0, 400), max_size=60)


def test_indices_are_one_object_per_value_for_every_download() -> None:
    a, b = indices(1_000), indices(1_500)
    assert a == list(range(1_000)) and b == list(range(1_500))
    assert all(x is y for x, y in zip(a, b, strict=False))
    assert shared(999) is a[999] and shared(1_499) is b[1_499]


def test_indices_grown_from_many_threads_at_once_stay_in_place() -> None:
    start = len(chunktables._SHARED)
    threads = [threading.Thread(target=indices, args=(start + k * 997,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert chunktables._SHARED == list(range(len(chunktables._SHARED)))


@given(SMALL_SETS, SMALL_SETS)
def test_still_missing_is_the_intersection_a_set_gives(
    wanted: frozenset[int], missing: frozenset[int]
) -> None:
    table = dict.fromkeys(missing, NOBODY)
    got = still_missing(wanted, table)
    assert got == wanted & missing
    if len(wanted) < len(missing):  # the wanted side is walked, as a set's ``&`` walks it
        assert list(got) == list(wanted & set(missing))


@given(st.dictionaries(st.integers(0, 400), st.frozensets(st.sampled_from("abcd")), max_size=60))
def test_orphans_are_the_chunks_nobody_holds(holders: dict[int, frozenset[str]]) -> None:
    assert orphans(holders) == {i for i, h in holders.items() if not h}


def test_shrink_keeps_every_table_s_contents_and_the_holders_order() -> None:
    holders: dict[int, frozenset[str] | set[str]] = {i: {"a"} for i in range(2_000, 0, -1)}
    claims = {"a": set(range(1, 2_001))}
    for i in range(1, 1_801):
        del holders[i]
        claims["a"].discard(i)
    before = claims["a"]
    small = shrink(holders, claims)
    assert list(small) == list(holders) and small == holders
    assert claims["a"] == before and claims["a"] is not before
