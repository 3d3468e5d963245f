"""The compiled clock and bandwidth model give the reference's events, bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from simulations import netkernels
from simulations.clock import Clock
from simulations.fastclock import FastClock
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


def _reference(up: list, down: list) -> tuple[Clock, Network]:
    clock = Clock()
    return clock, Network(clock, up, down)


def _compiled(up: list, down: list) -> tuple[FastClock, FastNetwork]:
    clock = FastClock()
    return clock, FastNetwork(clock, up, down)


def _replay(make: Callable[[], tuple], plan: list) -> tuple:
    """Run ``plan`` on the model ``make`` builds: when each transfer ended, what each node
    sent and received, and the events the clock ran."""
    clock, net = make()
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
    reference = _replay(lambda: _reference(up, down), plan)
    compiled = _replay(lambda: _compiled(up, down), plan)
    assert compiled == reference
    assert len(reference[0]) >= sum(1 for p in plan if p[1] != p[2] and p[5] is None)


def test_many_concurrent_flows_outgrow_the_first_slots() -> None:
    """More flows at once than the compiled model starts with: its tables grow mid-run."""
    n = 40
    plan = [(0.0, i % n, (i * 7 + 1) % n, 1e5 + i, 0, None) for i in range(3_000)]
    plan = [p for p in plan if p[1] != p[2]]
    up = [10 * MB] * n

    def run(make: Callable[[], tuple]) -> list[tuple[float, int]]:
        ended: list[tuple[float, int]] = []
        clock, net = make()
        for k, (_, src, dst, size, _, _) in enumerate(plan):
            net.start(src, dst, size, lambda k=k: ended.append((clock.now, k)))
        clock.run(lambda: False, deadline=1e9, max_events=1_000_000)
        return ended

    reference = run(lambda: _reference(up, up))
    assert run(lambda: _compiled(up, up)) == reference
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


events = st.lists(
    st.tuples(st.integers(0, 20), st.booleans()),  # (time, cancelled before the run)
    min_size=1,
    max_size=300,
)


@settings(max_examples=60, deadline=None)
@given(events, st.integers(1, 300))
def test_the_compiled_clock_runs_events_in_the_reference_order(plan: list, stop: int) -> None:
    """Ties in time go in scheduling order, cancelled events never run, an event may
    schedule more (at its own time too), and the budget stops a run where it stopped."""
    outcomes = []
    for clock in (Clock(), FastClock()):
        ran: list = []

        def note(k: int, clock: Clock | FastClock = clock, ran: list = ran) -> None:
            ran.append((clock.now, k))
            if k % 7 == 0:  # and one more, now
                clock.after(0.0, ran.append, (clock.now, -k))

        handles = [clock.at(float(t), note, k) for k, (t, _) in enumerate(plan)]
        for h, (_, cancel) in zip(handles, plan):
            if cancel:
                clock.cancel(h)  # type: ignore[arg-type]
        done = clock.run(lambda: False, 1e9, stop)
        outcomes.append((ran, done, clock.events_run))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][2] == min(stop, len(outcomes[0][0]))


# (time, live): a finish event whose flow still waits on it, or one superseded since
entries = st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=400)


@settings(max_examples=80, deadline=None)
@given(entries)
def test_the_compiled_heap_pops_live_entries_in_time_then_seq_order(plan: list) -> None:
    """The four-ary heap, rebuilt without its stale entries part way (as at ``COMPACT_AT``):
    what comes off it is the live entries sorted by (time, seq), ties by seq."""
    state = netkernels.new_state(len(plan), 2 * len(plan))
    fi, ht, hs, st_ = state[3], state[4], state[5], state[8]
    for seq, (t, live) in enumerate(plan, start=1):
        f = seq - 1  # one flow an entry; a stale entry's flow waits on another seq
        fi[f, netkernels.EVENT] = seq if live else -1
        netkernels._push(fi, ht, hs, st_, float(t), seq, f)
        if seq == len(plan) // 2:
            netkernels._compact(fi, ht, hs, st_)
    netkernels._compact(fi, ht, hs, st_)
    popped = []
    while st_[netkernels.HEAP_N]:
        popped.append((ht[0], hs[0, 0]))
        netkernels._pop(ht, hs, st_)
    live = sorted((float(t), seq) for seq, (t, on) in enumerate(plan, start=1) if on)
    assert popped == live


# (time, line: None for the heap, else 0 or 1; cancelled before the run)
sends = st.lists(
    st.tuples(st.integers(0, 20), st.sampled_from([None, 0, 1]), st.booleans()),
    min_size=1,
    max_size=300,
)


@settings(max_examples=80, deadline=None)
@given(sends, st.integers(1, 300), st.integers(0, 21))
def test_delay_lines_run_events_in_the_reference_order(plan: list, stop: int, pause: int) -> None:
    """Events sent through the compiled clock's delay lines, in time order or not (one
    earlier than its line's last waits in the heap), run as the reference's one heap runs
    them: by time, ties in scheduling order, cancelled ones never, nothing past a deadline
    (the run goes on from there), and an event may send more through a line at its own time."""
    outcomes = []
    for clock in (Clock(), FastClock()):
        ran: list = []

        def note(k: int, clock: Clock | FastClock = clock, ran: list = ran) -> None:
            ran.append((clock.now, k))
            if k % 5 == 0:  # a message sent now, arriving now
                clock.line(k % 2, clock.now, ran.append, (clock.now, -k))

        handles = [
            clock.at(float(t), note, k) if line is None else clock.line(line, float(t), note, k)
            for k, (t, line, _) in enumerate(plan)
        ]
        for h, (_, _, cancel) in zip(handles, plan):
            if cancel:
                clock.cancel(h)  # type: ignore[arg-type]
        paused = clock.run(lambda: False, float(pause), stop)
        cut = list(ran)
        done = clock.run(lambda: False, 1e9, 10_000)
        outcomes.append((cut, paused, ran, done, clock.events_run))
    assert outcomes[0] == outcomes[1]
    assert all(t <= pause for t, _ in outcomes[0][0])


def test_a_delay_line_holds_a_thousand_messages_in_order() -> None:
    """Over a thousand messages in flight at once, sent while earlier ones are taken, among
    timers: the same order as the reference's one heap, and the compiled clock's heap held
    only the timers (the messages waited in the line)."""
    outcomes, held = [], []
    for clock in (Clock(), FastClock()):
        ran: list = []
        for r in range(8):
            for k in range(800):
                clock.line(0, r + (k // 3) * 1e-3, ran.append, (r, k))  # ties three at a time
                if k % 7 == 0:
                    clock.at(r + (k // 5) * 1e-3, ran.append, (r, -k))
            if isinstance(clock, FastClock):
                held.append((len(clock.lines[0]), clock.heap_n))
            clock.run(lambda: False, r + 0.1, 100_000)  # a third of the round's messages
        assert clock.run(lambda: False, 1e9, 100_000) is False  # ran out of events
        outcomes.append(ran)
    assert outcomes[0] == outcomes[1]
    assert len(outcomes[0]) == 8 * (800 + len(range(0, 800, 7)))
    assert max(n for n, _ in held) > 1_000 and max(h for _, h in held) < 200
