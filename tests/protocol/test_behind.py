"""Chunks behind an announcement: how many each follower gets, and the budget a trainer
measures for them (a round trip at its uplink's rate)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from p2p_sync.protocol.seeding import MIN_GAPS, SuperSeeder, chunks_behind
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.dataview import SeedingView


@given(
    budget=st.floats(0, 1e9),
    chunk=st.integers(1, 4 << 20),
    followers=st.integers(0, 300),
    most=st.integers(0, 8),
)
def test_chunks_behind_fill_the_budget_one_round_at_a_time(
    budget: float, chunk: int, followers: int, most: int
) -> None:
    counts = chunks_behind(budget, chunk, followers, most)
    assert len(counts) == followers
    assert sum(counts) * chunk <= budget  # never more than the round trip holds
    assert all(0 <= k <= most for k in counts)
    assert counts == sorted(counts, reverse=True) and (not counts or counts[0] - counts[-1] <= 1)
    # nothing left unspent that another round could have used
    assert sum(counts) == min(int(budget // chunk), most * followers) if most else sum(counts) == 0


def test_a_round_trip_is_the_median_idle_gap_once_enough_were_seen() -> None:
    seeder = SuperSeeder()
    for i in range(MIN_GAPS - 1):
        seeder.contact("r", True, 10.0 * i)  # asks...
        seeder.contact("r", False, 10.0 * i + 1)  # ...is answered: idle from here
    assert seeder.round_trip_s() is None  # too few gaps yet
    for i in range(MIN_GAPS - 1, 3 * MIN_GAPS):
        seeder.contact("r", True, 10.0 * i)
        seeder.contact("r", False, 10.0 * i + 1)
    assert seeder.round_trip_s() == 9.0  # 10 s apart, 1 s busy each time


def test_the_budget_is_a_round_trip_at_the_rate_chunks_were_served() -> None:
    node = SimpleNamespace(cfg=SimpleNamespace(publish=PublishPolicy()))
    view = asyncio.run(_view(node))
    assert view.behind_budget() == 0.0  # nothing measured: nothing behind the news
    for i in range(100):  # 1 MB every 10 ms: 100 MB/s
        view._serves.append((i * 0.01, 1_000_000))
    view.seeder.gaps.extend([0.04] * MIN_GAPS)  # a 40 ms round trip
    assert abs(view.behind_budget() - 0.04 * 100e6) < 1  # 4 MB


async def _view(node: SimpleNamespace) -> SeedingView:
    return SeedingView(node)  # type: ignore[arg-type]
