"""The simulator's report at a glance: the Kumar-Ross term that binds, upload per class of
peer, the start-up lag, "What limited this run" in ``summary.md``, and the plots, each on a
small run (tens of peers, a 2 MB payload)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from matplotlib import image

from simulations import report
from simulations.report import TERMS, summary_md
from simulations.run import simulate
from simulations.scenario import Scenario, from_dict
from simulations.swarm_sim import SwarmSim

SMALL = dict(chunk_kb=64, payload_mb=2.0, latency_ms=1.0, max_peers=16)
FAST = dict(uplink_mbps=100.0, downlink_mbps=100.0, trainer_uplink_mbps=100.0)
PNG = b"\x89PNG\r\n\x1a\n"


def small(**kw: Any) -> Scenario:
    download = kw.pop("download", {"max_requests_per_peer": 1, "min_requests_per_peer": 1})
    return from_dict({**SMALL, **FAST, **kw, "download": download}, "report")


def limits(summary: str) -> str:
    """The "What limited this run" section of a summary."""
    assert "## What limited this run" in summary
    return summary.split("## What limited this run", 1)[1]


BINDS = {
    # 10 Mbit/s out of the trainer against 100 Mbit/s rollouts: 1.6 s against 0.16 s
    "trainer_uplink": dict(peers=20, trainer_uplink_mbps=10.0),
    # a quarter of the rollouts on 5 Mbit/s downlinks: 3.2 s to take 2 MB
    "slowest_downlink": dict(
        peers=20, links=[{"fraction": 0.25, "uplink_mbps": 100.0, "downlink_mbps": 5.0}]
    ),
    # 30 rollouts that upload at 5 Mbit/s: 30 payloads over 31.25 MB/s of total uplink
    "swarm_uplink": dict(peers=30, uplink_mbps=5.0),
}


@pytest.mark.parametrize("term", list(BINDS))
def test_the_bound_is_named_by_the_term_that_sets_it(term: str) -> None:
    sim, rep = simulate(small(**BINDS[term]))
    terms = rep["lower_bound_terms_s"]
    assert terms["binding"] == term
    assert terms[term] == pytest.approx(rep["lower_bound_s"][0])  # the bound the run used
    assert all(terms[k] < 0.8 * terms[term] for k in TERMS if k != term)  # it alone binds
    f = rep["payload_bytes"]
    assert terms["trainer_uplink"] == pytest.approx(f / sim.peers[0].uplink)
    assert f"s, set by {TERMS[term]} (the others:" in limits(summary_md(rep))
    for other in set(TERMS) - {term}:
        assert f"set by {TERMS[other]}" not in summary_md(rep)


def test_upload_per_class_splits_nat_links_and_adversaries() -> None:
    sc = small(
        peers=40,
        nat_fraction=0.4,
        corrupt_fraction=0.1,
        liar_fraction=0.05,
        links=[{"fraction": 0.3, "uplink_mbps": 20.0, "downlink_mbps": 50.0}],
        download={"max_sources": 8, "max_requests_per_peer": 2, "request_timeout_s": 0.5},
        versions=2,
    )
    sim, rep = simulate(sc)
    classes = rep["upload_per_class"]
    links = ["honest 100/100 Mbit/s", "honest 20/50 Mbit/s"]
    expected = ["trainer", "honest public", "honest NATed", *links, "corrupt", "liar"]
    assert list(classes) == expected  # no stall class: nobody stalls
    honest = rep["honest_peers"]
    assert classes["honest public"]["peers"] + classes["honest NATed"]["peers"] == honest
    assert sum(classes[k]["peers"] for k in links) == honest
    assert classes["corrupt"]["peers"] == 4 and classes["liar"]["peers"] == 2
    payload = rep["payload_bytes"] * rep["versions"]
    trainer = classes["trainer"]
    assert trainer["mean"] == trainer["p50"] == rep["trainer_upload_bytes"]["total"] / payload
    nat = [sim.net.bytes_sent[p.idx] / payload for p in sim.honest if p.nat]
    assert classes["honest NATed"]["mean"] == pytest.approx(statistics.fmean(nat))
    assert classes["honest NATed"]["p50"] == pytest.approx(statistics.median(nat))
    for c in classes.values():
        assert 0 <= c["p10"] <= c["p50"] <= c["p90"]
    row = f"| honest NATed | {classes['honest NATed']['peers']} | "
    assert row + f"{classes['honest NATed']['mean']:.2f} |" in summary_md(rep)


def test_one_link_class_and_no_nat_leave_one_honest_class() -> None:
    _, rep = simulate(small(peers=12))
    assert list(rep["upload_per_class"]) == ["trainer", "honest"]
    assert rep["upload_per_class"]["honest"]["peers"] == 12


def test_what_limited_a_trainer_bound_run_says_where_its_time_went() -> None:
    """A slow trainer: the bound is its uplink, and every peer's idle downlink time is spent
    while the swarm fills (waiting for its chunks), most of it forced by the bound."""
    _, rep = simulate(small(**BINDS["trainer_uplink"], versions=2))
    text = limits(summary_md(rep))
    assert text.count("most in filling") == 2  # the last peer's and the median peer's
    i = max(range(2), key=lambda v: rep["ratio_to_bound"]["per_version"][v])
    last, bound = rep["completion_time_s"]["per_version"][i], rep["lower_bound_s"][i]
    assert f"version {i + 1} (the worst): the last honest peer took {last:.3f} s" in text
    own = 2e6 / (100e6 / 8)  # the payload at the last peer's downlink rate
    assert f"{bound - own:.3f} s of which the bound forces" in text
    assert "every honest peer converged in every version; no false bans." in text
    cost = rep["simulator"]
    assert cost["simulated_s"] >= sum(rep["completion_time_s"]["per_version"])
    assert f"{rep['events']:,} events in" in text and f"{cost['us_per_event']:.0f} us" in text


def test_what_limited_a_run_that_timed_out_names_the_peers_that_missed_it() -> None:
    _, rep = simulate(small(**BINDS["trainer_uplink"], time_limit_factor=0.5))
    assert rep["honest_unconverged"] == [20]
    text = limits(summary_md(rep))
    assert "did not converge within the time limit, of 20: v1: 20;" in text
    assert "not every honest peer converged" in text
    assert "no start-up lag is known" in text


def test_the_start_up_lag_is_set_against_latency_times_overlay_depth() -> None:
    """Four neighbours each in a swarm of 30 at 20 ms: the overlay is three or four hops deep
    and no peer's first chunk lands before the announcement could cross them."""
    download = {"max_sources": 4, "max_requests_per_peer": 2}
    sim = SwarmSim(small(peers=30, latency_ms=20.0, max_peers=4, trainer_peers=4))
    depths = [sim.depth[p.idx] for p in sim.honest]
    assert report.overlay_depth(sim) == {"median": statistics.median(depths), "max": max(depths)}
    sc = small(peers=30, latency_ms=20.0, max_peers=4, trainer_peers=4, download=download)
    _, rep = simulate(sc)
    depth = rep["overlay_depth"]
    assert depth["max"] >= 3
    median_start = rep["lag_s"][0]["median"]["start"]
    assert median_start >= 0.020 * depth["median"]
    text = limits(summary_md(rep))
    assert f"first chunk landed {median_start:.3f} s after publication" in text
    assert f"is {0.02 * depth['median']:.3f} s at the median depth ({depth['median']:g})" in text


def test_the_trainer_connections_are_its_neighbours_and_those_it_served() -> None:
    """A trainer wired to 4 of 30 rollouts: 4 neighbours, and it sent chunks to some of them
    at least (its followers fetch from it), never to more rollouts than exist."""
    sim, rep = simulate(small(peers=30, trainer_peers=4))
    conns = rep["trainer_connections"]
    assert conns["neighbours"] == len(sim.peers[0].neighbors) == 4
    served = {r for (u, r) in sim.served if u == 0}
    assert conns["served"] == len(served) and 1 <= conns["served"] <= 30
    assert f"trainer: connected to 4 rollouts, sent chunks to {len(served)}" in summary_md(rep)


def test_the_plots_are_written_as_valid_pngs(tmp_path: Path) -> None:
    sc = small(peers=20, versions=2, nat_fraction=0.3, download={"max_sources": 8})
    sim, rep = simulate(sc)
    report.write(sim, rep, tmp_path)
    names = ("completion_cdf.png", "upload_per_class.png", "startup_lag.png")
    for name in names:
        path = tmp_path / name
        assert path.read_bytes()[:8] == PNG, name
        height, width, _ = image.imread(path).shape  # decodes: a whole PNG
        assert width > 600 and height > 400, name
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(names)
    report.write(sim, rep, tmp_path / "bare", with_plots=False)
    assert not list((tmp_path / "bare").glob("*.png"))
