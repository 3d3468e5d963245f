"""The simulator's NAT model (``nat_fraction``): NATed rollouts reach only public peers, two
NATed peers never exchange a chunk, NATed peers still upload over the connections they opened,
and every honest peer still converges."""

from __future__ import annotations

import re
import statistics

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from simulations.report import summary_md
from simulations.run import simulate
from simulations.scenario import Scenario, ScenarioError, from_dict
from simulations.swarm_sim import TRAINER, SwarmSim

# A small swarm shaped like the node's defaults: a public peer may hold twice as many
# connections (max_peers) as a download follows (max_sources), so NATed peers find room.
NAT = dict(
    chunk_kb=64,
    payload_mb=1.0,
    latency_ms=1.0,
    max_peers=16,
    download={"max_sources": 8, "max_requests_per_peer": 2},
)


def nat_scenario(**kw: object) -> Scenario:
    return from_dict({**NAT, **kw}, "nat")


def nat_nat_chunks(sim: SwarmSim) -> int:
    peers = sim.peers
    return sum(n for (a, b), n in sim.served.items() if peers[a].nat and peers[b].nat)


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_nat_fraction_out_of_range_names_the_field(value: float) -> None:
    with pytest.raises(ScenarioError, match="^" + re.escape("scenario: nat_fraction: must be")):
        from_dict({"nat_fraction": value})


def test_nat_fraction_of_the_wrong_type_names_the_field() -> None:
    with pytest.raises(ScenarioError, match="^scenario: nat_fraction: expected float"):
        from_dict({"nat_fraction": "half"})


def test_overlay_has_no_nat_nat_edge_and_public_peers_stay_bounded() -> None:
    sc = nat_scenario(peers=60, nat_fraction=0.5)
    sim = SwarmSim(sc)
    nat = [p for p in sim.peers[1:] if p.nat]
    assert len(nat) == 30
    for p in nat:  # dials public peers only (and maybe the trainer), a full list of them
        assert p.neighbors and not any(sim.peers[q].nat for q in p.neighbors)
        assert len(p.neighbors - {TRAINER}) == 8
    for p in sim.peers[1:]:
        assert len(p.neighbors - {TRAINER}) <= sc.max_peers  # inbound bounded by max_peers
        nated = {q for q in p.neighbors if sim.peers[q].nat}
        # a download follows max_sources of them, and a public peer every NATed one (owed)
        assert len(p.follows - {TRAINER}) <= max(8, len(nated))
        assert p.nat or nated <= p.follows
        assert p.follows <= p.neighbors


def test_half_nated_swarm_converges_and_nated_peers_upload() -> None:
    sim, rep = simulate(nat_scenario(peers=40, nat_fraction=0.5, versions=2))
    assert rep["honest_converged_fraction"] == 1.0
    assert nat_nat_chunks(sim) == 0 and rep["nat"]["nat_nat_chunks"] == 0
    nat = rep["nat"]
    assert (nat["nat_peers"], nat["public_peers"]) == (20, 20)
    assert nat["mean_upload_bytes"]["nat"] > 0 and nat["nat_upload_share"] > 0.2
    from_nat = sum(n for (a, b), n in sim.served.items() if sim.peers[a].nat)
    assert from_nat > 0  # public peers fetched from NATed ones over their connections
    assert rep["ratio_to_bound"]["worst"] >= 1.0 and nat["ratio_to_bound"] >= 1.0
    assert "NATed share of rollout upload" in summary_md(rep)


def test_no_nat_section_without_nat() -> None:
    _, rep = simulate(nat_scenario(peers=10))
    assert "nat" not in rep


def test_all_nated_peers_reach_only_the_trainer_and_still_converge() -> None:
    # liveness, not speed: the seed shows a NATed peer the chunks it handed to others only
    # once they starved (SuperSeeder.starve_after_s), far beyond this swarm's usual time limit
    sc = nat_scenario(peers=6, nat_fraction=1.0, trainer_peers=2, time_limit_factor=2000.0)
    sim = SwarmSim(sc)
    assert all(p.neighbors == {TRAINER} for p in sim.peers[1:])  # a star: the trainer only
    _, rep = simulate(sc)
    assert rep["honest_converged_fraction"] == 1.0


@settings(max_examples=12, deadline=None)
@given(
    peers=st.integers(3, 24),
    nat_fraction=st.floats(0.0, 0.8),
    seed=st.integers(0, 1000),
)
@example(peers=24, nat_fraction=0.78125, seed=7)  # public peers that followed only 8 NATed ones
def test_random_nated_swarms_converge_without_nat_nat_transfers(
    peers: int, nat_fraction: float, seed: int
) -> None:
    sc = nat_scenario(peers=peers, nat_fraction=nat_fraction, seed=seed, latency_ms=2.0)
    sim, rep = simulate(sc)
    assert rep["honest_converged_fraction"] == 1.0
    assert nat_nat_chunks(sim) == 0
    assert all(not (p.nat and sim.peers[q].nat) for p in sim.peers for q in p.neighbors)


def test_punchable_nated_peers_trade_directly_and_no_other_nated_pair_does() -> None:
    sc = nat_scenario(peers=40, nat_fraction=0.8, punch_fraction=0.5, versions=2)
    sim, rep = simulate(sc)
    assert rep["honest_converged_fraction"] == 1.0
    nat = [p for p in sim.peers[1:] if p.nat]
    punchable = [p for p in nat if p.punchable]
    assert len(nat) == 32 and len(punchable) == rep["nat"]["punchable_peers"] == 16
    for p in nat:  # a NAT-NAT edge needs a hole punched: both NATs let it through
        assert all(p.punchable and sim.peers[q].punchable for q in p.neighbors if sim.peers[q].nat)
    # 8 public peers have room for few of the 32: punched connections fill the punchable
    # ones' lists, the others stay short
    mean = statistics.fmean
    assert mean(len(p.neighbors) for p in punchable) > mean(
        len(p.neighbors) for p in nat if not p.punchable
    )
    by_pair = sim.served.items()
    punched = sum(n for (a, b), n in by_pair if sim.peers[a].nat and sim.peers[b].nat)
    assert punched == rep["nat"]["nat_nat_chunks"] > 0
    assert "(16 punchable)" in summary_md(rep)


def test_punchable_peers_are_drawn_after_everything_else() -> None:
    # so a scenario without punch_fraction draws the swarm it always drew
    plain = SwarmSim(nat_scenario(peers=30, nat_fraction=0.5))
    punch = SwarmSim(nat_scenario(peers=30, nat_fraction=0.5, punch_fraction=0.6))
    assert [(p.role, p.nat, p.uplink) for p in plain.peers] == [
        (p.role, p.nat, p.uplink) for p in punch.peers
    ]
    assert not any(p.punchable for p in plain.peers)
    assert sum(p.punchable for p in punch.peers) == 9 and all(
        p.nat for p in punch.peers if p.punchable
    )
