"""The virtual clock: events run in (time, scheduling) order, cancelled ones never, whether or
not the heap has dropped them yet."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import simulations.clock as clock_mod
from simulations.clock import Clock

events = st.lists(
    st.tuples(st.integers(0, 20), st.booleans()),  # (time, cancelled before the run)
    min_size=1,
    max_size=200,
)


@settings(max_examples=60, deadline=None)
@given(events, st.sampled_from([0, 3, 4096]))
def test_events_run_in_order_and_cancelled_ones_never(plan, compact_at) -> None:
    old = clock_mod.COMPACT_AT
    clock_mod.COMPACT_AT = compact_at  # 0 and 3 make the heap drop cancelled entries often
    try:
        clock, ran = Clock(), []
        entries = [clock.at(float(t), ran.append, k) for k, (t, _) in enumerate(plan)]
        for entry, (_, cancel) in zip(entries, plan):
            if cancel:
                clock.cancel(entry)
                clock.cancel(entry)  # twice: still one cancellation
        assert clock.run(lambda: False, 1e9, 10_000) is False
    finally:
        clock_mod.COMPACT_AT = old
    kept = [k for k, (_, cancel) in enumerate(plan) if not cancel]
    assert ran == sorted(kept, key=lambda k: (plan[k][0], k))
    assert clock.events_run == len(kept)
    assert clock._cancelled == 0 and not clock._heap  # every mark left with its entry


def test_cancelling_an_event_that_ran_changes_nothing() -> None:
    clock, ran = Clock(), []
    first = clock.at(1.0, ran.append, "a")
    clock.at(2.0, lambda: clock.cancel(first))  # already ran: a no-op
    clock.at(3.0, ran.append, "b")
    clock.run(lambda: False, 1e9, 100)
    assert ran == ["a", "b"] and clock._cancelled == 0


def test_an_event_may_cancel_a_later_one() -> None:
    clock, ran = Clock(), []
    later = clock.at(2.0, ran.append, "late")
    clock.at(1.0, lambda: clock.cancel(later))
    clock.at(3.0, ran.append, "last")
    clock.run(lambda: False, 1e9, 100)
    assert ran == ["last"] and clock.now == 3.0
