"""Run a scenario end to end: every version in turn, then the report.

Versions go one after another: version v+1 is published once every honest rollout has v (or
the version's time limit passed), so each version's completion time is measured on its own
against its own lower bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from simulations import report
from simulations.scenario import Scenario
from simulations.swarm_sim import SwarmSim, VersionResult

# (version, honest peers done, honest peers, simulated time since publication in lower bounds)
Progress = Callable[[int, int, int, float], None]


def simulate(
    scenario: Scenario,
    on_version: Callable[[VersionResult], None] | None = None,
    progress: Progress | None = None,
) -> tuple[SwarmSim, dict[str, Any]]:
    started, rss_before = time.perf_counter(), report.peak_rss()
    sim = SwarmSim(scenario, progress)
    for v in range(1, scenario.versions + 1):
        result = sim.run_version(v)
        if on_version is not None:
            on_version(result)
    return sim, report.build(sim, time.perf_counter() - started, rss_before)


def simulate_to(
    scenario: Scenario,
    out: Path,
    plots: bool = True,
    on_version: Callable[[VersionResult], None] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    sim, rep = simulate(scenario, on_version, progress)
    report.write(sim, rep, out, plots)
    return rep
