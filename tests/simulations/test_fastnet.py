"""The compiled bandwidth model gives the reference model's events, bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from simulations.clock import Clock
from simulations.fastnet import FastNetwork
from simulations.network import Network
from simulations.scenario import load
from simulations.swarm_sim import SwarmSim

ROOT = Path(__file__).resolve().parents[2]
MB = 1e6

# (start time, src, dst, bytes, follow-ups its callback starts at once, cancel after or None)
transfer = st.tuples(
    st.floats(0, 2),
    st.integers(0, 4),
    st.integers(0, 4),
    st.floats(1, 5 * MB),
    st.integers(0, 2),
    st.one_of(st.none(), st.floats(0, 1)),
)


def _replay(make: Callable[[Clock], Network | FastNetwork], plan: list) -> tuple:
    """Run ``plan`` on the model ``make`` builds: when each transfer ended, what each node
    sent and received, and the events the clock ran."""
    clock = Clock()
    net = make(clock)
    ended: list[tuple[float, int]] = []

    def begin(n: int, src: int, dst: int, size: float, follow: int) -> None:
        def done() -> None:
            ended.append((clock.now, n))
            for j in range(follow):  # as an upload slot starts its next chunk
                net.start(src, (dst + j + 1) % 5, size / 2, lambda: ended.append((clock.now, -n)))

        t = net.start(src, dst, size, done)
        if cancel_after[n] is not None:
            clock.after(cancel_after[n], lambda: ended.append(stop(n, t)))

    def stop(n: int, t: object) -> tuple:
        return clock.now, n, net.progress(t), net.cancel(t), net.progress(t)  # type: ignore[arg-type]

    cancel_after = {}
    for n, (at, src, dst, size, follow, cancel) in enumerate(plan):
        if src == dst:
            continue
        cancel_after[n] = cancel
        clock.at(at, begin, n, src, dst, size, follow)
    clock.run(lambda: False, deadline=1e9, max_events=1_000_000)
    return ended, list(net.bytes_sent), list(net.bytes_received), clock.events_run


@given(
    st.lists(st.floats(1 * MB, 100 * MB), min_size=5, max_size=5),
    st.lists(st.floats(1 * MB, 100 * MB), min_size=5, max_size=5),
    st.lists(transfer, min_size=1, max_size=40),
)
@settings(max_examples=150, deadline=None)
def test_random_transfers_end_at_the_same_instants(up: list, down: list, plan: list) -> None:
    reference = _replay(lambda c: Network(c, up, down), plan)
    compiled = _replay(lambda c: FastNetwork(c, up, down), plan)
    assert compiled == reference
    assert len(reference[0]) >= sum(1 for p in plan if p[1] != p[2] and p[5] is None)


def test_many_concurrent_flows_outgrow_the_first_slots() -> None:
    """More flows at once than the compiled model starts with: its tables grow mid-run."""
    n = 40
    plan = [(0.0, i % n, (i * 7 + 1) % n, 1e5 + i, 0, None) for i in range(3_000)]
    plan = [p for p in plan if p[1] != p[2]]
    up = [10 * MB] * n

    def run(make: Callable[[Clock], Network | FastNetwork]) -> list[tuple[float, int]]:
        clock, ended = Clock(), []
        net = make(clock)
        for k, (_, src, dst, size, _, _) in enumerate(plan):
            net.start(src, dst, size, lambda k=k: ended.append((clock.now, k)))
        clock.run(lambda: False, deadline=1e9, max_events=1_000_000)
        return ended

    reference = run(lambda c: Network(c, up, up))
    assert run(lambda c: FastNetwork(c, up, up)) == reference
    assert len(reference) == len(plan)


def test_a_swarm_with_churn_and_corruption_runs_the_same_on_both_models() -> None:
    """The CI scenario's adversaries and churn cancel transfers mid-flight and kill uploads."""
    sc = load(ROOT / "configs/simulations/scale-1k-hostile.toml", peers=40, payload_mb=8.0)
    results = []
    for reference in (True, False):
        sim = SwarmSim(sc, reference_network=reference)
        results.append(([asdict(sim.run_version(v)) for v in (1, 2)], sim.clock.events_run))
    assert json.dumps(results[0]) == json.dumps(results[1])  # NaN (no NATed peer) as text
    assert results[0][1] > 10_000 and results[0][0][0]["churned"] > 0
