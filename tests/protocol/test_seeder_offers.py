"""The seeder's array offers against the pass it replaced (``reference_seeder``): the same
calls in any order give the same offers and the same tables, entry for entry and in the same
order (which chunk a bounded table forgets first depends on it)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from p2p_sync.protocol import seeding
from p2p_sync.protocol.seeding import SuperSeeder
from tests.protocol.reference_seeder import ScanningSeeder

REQUESTERS = st.sampled_from(["r0", "r1", "r2", "r3", None])
TABLES = (
    "owner",
    "previous",
    "served",
    "spread_since",
    "idle_since",
    "allowance",
    "askers",
)


class SameOffers(RuleBasedStateMachine):
    """Both seeders driven alike: two manifests (one holding a chunk twice), requesters that
    ask, fetch, go quiet and vanish, and time that may also step back."""

    @initialize(
        n=st.integers(1, 24),
        outstanding=st.integers(1, 5),
        reseed=st.floats(0.1, 3.0),
        quiet=st.sampled_from([0.0, 2.0]),
        max_keys=st.sampled_from([6, 1 << 16]),
    )
    def start(self, n: int, outstanding: int, reseed: float, quiet: float, max_keys: int) -> None:
        seeding.MAX_KEYS = max_keys
        args = dict(starve_after_s=2 * reseed, quiet_factor=quiet)
        self.new = SuperSeeder(outstanding, reseed, **args)
        self.old = ScanningSeeder(outstanding, reseed, **args)
        first = [f"a{i}" for i in range(n)]
        second = [f"b{i}" for i in range(n)] + ["a0"]  # a chunk both manifests hold
        second[n // 2] = "b0" if n > 1 else second[n // 2]  # and one this one holds twice
        self.manifests = [first, tuple(second)]
        self.now = 0.0

    def both(self, method: str, *args: object) -> None:
        got = getattr(self.new, method)(*args)
        want = getattr(self.old, method)(*args)
        assert got == want, (method, args)

    @rule(manifest=st.integers(0, 1), requester=REQUESTERS, dt=st.floats(-0.5, 1.5))
    def offer(self, manifest: int, requester: str | None, dt: float) -> None:
        self.now += dt
        self.both("offer", self.manifests[manifest], requester, self.now)

    @rule(requester=REQUESTERS, pending=st.booleans(), dt=st.floats(0.0, 0.3))
    def contact(self, requester: str | None, pending: bool, dt: float) -> None:
        self.now += dt
        self.both("contact", requester, pending, self.now)

    @rule(data=st.data(), requester=REQUESTERS, ask=st.booleans())
    def fetch(self, data: st.DataObject, requester: str | None, ask: bool) -> None:
        """Asked first as the node asks (``may_serve``), or served unasked (a push)."""
        key = data.draw(st.sampled_from([*self.manifests[0], *self.manifests[1]]))
        if ask:
            self.both("may_serve", key, requester, self.now)
        self.both("note_served", key, requester, self.now)

    @rule(requester=REQUESTERS)
    def release(self, requester: str | None) -> None:
        self.both("release", requester)

    @invariant()
    def same_tables(self) -> None:
        if not hasattr(self, "new"):
            return
        for name in TABLES:
            got, want = getattr(self.new, name), getattr(self.old, name)
            assert list(got.items()) == list(want.items()), name
        assert self.new.busy == self.old.busy
        assert self.new.quiet_after_s == self.old.quiet_after_s

    def teardown(self) -> None:
        seeding.MAX_KEYS = 1 << 16


SameOffers.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_array_offers_match_the_pass_they_replaced = SameOffers.TestCase


def test_a_view_is_dropped_past_max_views_and_rebuilt_from_the_tables() -> None:
    """A trainer serving more manifests than it mirrors rebuilds the oldest's arrays from its
    tables when asked again: what happened meanwhile (fetches) counts."""
    seeder = SuperSeeder(outstanding=1)
    manifests = [tuple(f"{v}-{i}" for i in range(3)) for v in range(seeding.MAX_VIEWS + 2)]
    assert seeder.offer(manifests[0], "r", 0.0) == [0]
    for keys in manifests[1:]:
        seeder.offer(keys, "r", 0.0)
    assert manifests[0] not in seeder.views
    seeder.note_served("0-0", "r", 0.1)  # its owner fetched it: r may be handed the next
    assert seeder.offer(manifests[0], "r", 0.2) == [0, 1]
    assert len(seeder.views) == seeding.MAX_VIEWS


@pytest.mark.parametrize("requesters", [1, 40])
def test_offers_hand_out_every_chunk_once(requesters: int) -> None:
    """However many ask, each chunk is handed out once (to the first that may take it)."""
    seeder, keys = SuperSeeder(outstanding=4), tuple(f"k{i}" for i in range(200))
    handed: dict[int, str] = {}
    for r in range(requesters):
        for i in seeder.offer(keys, f"r{r}", 0.0):
            assert handed.setdefault(i, f"r{r}") == f"r{r}"
    assert len(handed) == min(200, 4 * requesters)  # ``outstanding`` each, at first
