"""Publishing policy and the catch-up planner (hand-built cases plus Hypothesis properties)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2p_sync.errors import BaseMismatchError, NoPathError
from p2p_sync.protocol.versions import (
    PATCH,
    SNAPSHOT,
    Artifact,
    PeerState,
    PublishPolicy,
    plan,
    to_publish,
)


def h(v: int) -> str:
    return f"{v:032x}"


def patch(base: int, target: int, size: int) -> Artifact:
    return Artifact(target, PATCH, base, h(base), h(target), size)


def snap(v: int, size: int) -> Artifact:
    return Artifact(v, SNAPSHOT, None, None, h(v), size)


CHAIN = [patch(v, v + 1, 10) for v in range(10)]


@pytest.mark.parametrize(
    ("local", "artifacts", "expected"),
    [
        (PeerState(3, h(3)), CHAIN, [(3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10)]),
        (PeerState(3, h(3)), [*CHAIN, patch(3, 10, 50)], [(3, 10)]),  # merged beats chain
        (
            PeerState(3, h(3)),
            [*CHAIN, patch(3, 10, 80)],
            [(3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10)],
        ),  # chain is cheaper
        (PeerState(3, h(3)), [*CHAIN, snap(8, 30)], [(None, 8), (8, 9), (9, 10)]),  # anchor
        (PeerState(), [*CHAIN, snap(0, 100), snap(8, 100)], [(None, 8), (8, 9), (9, 10)]),
        (PeerState(10, h(10)), CHAIN, []),
    ],
)
def test_planner_picks_the_cheapest_path(local, artifacts, expected) -> None:
    steps = plan(local, artifacts)
    assert [(a.base_version, a.version) for a in steps] == expected


def test_planner_refuses_patches_for_another_base_state() -> None:
    forked = PeerState(3, "ff" * 16)  # version 3, but not the trainer's v3 weights
    with pytest.raises(NoPathError, match="v3 to v10"):
        plan(forked, CHAIN)
    assert [a.kind for a in plan(forked, [*CHAIN, snap(5, 1000)])][0] == SNAPSHOT


def test_newcomer_without_anchor_has_no_path() -> None:
    with pytest.raises(NoPathError):
        plan(PeerState(), CHAIN)


def test_peer_state_refuses_a_wrong_base() -> None:
    with pytest.raises(BaseMismatchError, match="needs base v4"):
        PeerState(3, h(3)).after(patch(4, 5, 1))
    assert PeerState(3, h(3)).after(patch(3, 4, 1)) == PeerState(4, h(4))


def test_publish_policy_anchors_and_aligned_catchups() -> None:
    policy = PublishPolicy(anchor_every=8, catchup_spans=(4, 16))
    assert to_publish(0, policy) == [(SNAPSHOT, None)]
    assert to_publish(3, policy) == [(PATCH, 2)]
    assert to_publish(8, policy) == [(SNAPSHOT, None), (PATCH, 7), (PATCH, 4)]
    assert to_publish(16, policy) == [(SNAPSHOT, None), (PATCH, 15), (PATCH, 12), (PATCH, 0)]


def published(head: int, policy: PublishPolicy, patch_size: int) -> list[Artifact]:
    out = []
    for v in range(head + 1):
        for kind, base in to_publish(v, policy):
            size = 1000 if kind == SNAPSHOT else patch_size * (v - base)  # merged ~ sum
            out.append(snap(v, size) if kind == SNAPSHOT else patch(base, v, size))
    return out


def brute_force_cost(local: PeerState, arts: list[Artifact], head: int) -> int | None:
    """Cheapest cost over every sequence of distinct artifacts that applies in turn, of any
    length (tiny inputs only; a sequence stops growing where the next artifact does not
    apply, so this walks only the valid ones)."""
    best: int | None = None

    def walk(state: PeerState, used: frozenset[int], cost: int) -> None:
        nonlocal best
        if used and state.version == head:
            best = cost if best is None else min(best, cost)
        for i, a in enumerate(arts):
            if i in used:
                continue
            try:
                after = state.after(a)
            except BaseMismatchError:
                continue
            walk(after, used | {i}, cost + a.size)

    walk(local, frozenset(), 0)
    return best


@st.composite
def artifact_sets(draw: st.DrawFn) -> list[Artifact]:
    """Up to 7 random patches/snapshots over versions 0..5; some patches have a foreign base."""
    arts = []
    for _ in range(draw(st.integers(1, 7))):
        target = draw(st.integers(0, 5))
        size = draw(st.integers(1, 100))
        if target == 0 or draw(st.booleans()):
            arts.append(snap(target, size))
        else:
            base = draw(st.integers(0, target - 1))
            state = h(base) if draw(st.integers(0, 4)) else "ee" * 16  # a fork, unusable
            arts.append(Artifact(target, PATCH, base, state, h(target), size))
    return arts


CHAIN_OF_FIVE = [snap(0, 1)] + [Artifact(v, PATCH, v - 1, h(v - 1), h(v), 1) for v in (2, 3, 1, 4)]


@settings(max_examples=200, deadline=None)
@given(artifact_sets(), st.one_of(st.none(), st.integers(0, 4)))
@example(CHAIN_OF_FIVE, None)  # a path of five steps: an oracle that tried four saw none
def test_plan_is_valid_and_optimal(arts: list[Artifact], start: int | None) -> None:
    local = PeerState() if start is None else PeerState(start, h(start))
    head = max(a.version for a in arts)
    expected = 0 if local.version == head else brute_force_cost(local, arts, head)
    if expected is None:
        with pytest.raises(NoPathError):
            plan(local, arts, head)
        return
    steps = plan(local, arts, head)
    state = local
    for a in steps:  # every step applies to exactly the state before it, moving forward
        state = state.after(a)
    assert state.version == head or (not steps and local.version == head)
    assert sum(a.size for a in steps) == expected


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 40))
def test_skip_list_catchup_needs_few_patches(head: int, start: int) -> None:
    start = min(start, head)
    arts = published(head, PublishPolicy(anchor_every=1000, catchup_spans=(4, 16)), 10)
    steps = plan(PeerState(start, h(start)), arts, head)
    # 1-steps up to a 4-aligned version, 4-spans up to 16-aligned, 16-spans, then back down
    assert len(steps) <= 3 + 3 + head // 16 + 3 + 3
    assert sum(a.size for a in steps) == 10 * (head - start)  # never more bytes than the chain
