"""The stall clocks against a twin that never compacts its queue, and the peers a chunk was
asked of against a plain record of them: the lean bookkeeping changes nothing observable."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.protocol.stalls import StallClocks


class Eager(StallClocks):
    """Compacts its queue as soon as stale entries outnumber the live ones."""

    __slots__ = ()
    COMPACT_SLACK = 0


class Uncompacted(StallClocks):
    """Keeps every entry of its queue: what the clocks would do without ``_compact``."""

    __slots__ = ()

    def _compact(self) -> None:
        return None


OPS = st.lists(
    st.tuples(
        st.sampled_from(["asked", "claimed", "moved", "ended", "delivered", "forget", "overdue"]),
        st.integers(0, 6),  # chunk (few: clocks restart often, the queue fills)
        st.sampled_from(["a", "b", "c"]),  # peer
        st.floats(0.0, 3.0),  # time step (0: several things at one instant)
        st.booleans(),  # orphan / spared
    ),
    min_size=20,
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_compacting_the_queue_and_keeping_one_peer_as_itself_change_nothing(ops: list) -> None:
    lean, full = Eager(5.0, 4.0), Uncompacted(5.0, 4.0)
    asked: dict[int, set[str]] = {}  # peers asked of each chunk since it arrived or stalled
    now = 0.0
    for op, i, peer, step, flag in ops:
        now += step if step > 1.0 else 0.0
        results = []
        for clocks in (lean, full):
            if op == "asked":
                results.append(clocks.asked(i, peer, now))
            elif op == "claimed":
                results.append(clocks.claimed(i, peer, flag, now))
            elif op == "moved":
                results.append(clocks.moved(i, int(step * 1000), now))
            elif op == "ended":
                results.append(clocks.ended(i))
            elif op == "delivered":
                results.append(clocks.delivered(i, now))
            elif op == "forget":
                results.append(clocks.forget(i))
            else:
                results.append(clocks.overdue(now, lambda j, _t, spare=flag: spare and j % 2 == 0))
            results.append((clocks.deadline(), clocks.may_be_late(now), clocks.due(i)))
        assert results[:2] == results[2:]
        if op == "asked":
            asked.setdefault(i, set()).add(peer)
        elif op == "delivered":
            asked.pop(i, None)
        elif op == "forget":
            assert results[0] == asked.pop(i, set())
