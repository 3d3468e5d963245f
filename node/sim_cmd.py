"""`p2psync simulate SCENARIO --out DIR`: run a swarm simulation and write its report."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from node.lazy import imported

if TYPE_CHECKING:  # the simulator (numba) is imported when a simulation runs
    from simulations import scenario as scenarios
    from simulations.swarm_sim import VersionResult


def cmd_simulate(args: argparse.Namespace) -> int:
    scenarios = imported("simulations.scenario")  # the simulator (numba): only to simulate
    simulate_to = imported("simulations.run").simulate_to
    sc = scenarios.load(args.scenario, peers=args.peers, seed=args.seed, versions=args.versions)
    with _progress_bar(args.quiet) as bar:
        progress = _progress_reporter(bar)
        on_version = _version_reporter(bar, sc, progress)
        rep = simulate_to(sc, args.out, not args.no_plots, on_version, progress)
    own = rep["ratio_to_own_bound"]["worst"]
    churn = f" (x{own:.2f} of each peer's own, its time offline added)" if sc.churn_fraction else ""
    print(
        f"{sc.name}: worst x{rep['ratio_to_bound']['worst']:.2f} of the lower bound{churn}, "
        f"{rep['honest_converged_fraction']:.1%} honest converged, {rep['false_bans']} false "
        f"bans; report in {args.out / 'report.json'}"
    )
    return 0


def _progress_bar(quiet: bool) -> Progress:
    """Progress bars on stderr, so stdout holds only the summary line."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[simulated]}"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=Console(stderr=True), disable=quiet)


def _progress_reporter(bar: Progress) -> Callable[[int, int, int, float], None]:
    """The simulation's progress callback: one bar per version, made when it first reports,
    with how far the simulated clock got in lower bounds (a large swarm's first peer finishes
    near the bound, so before that this is what moves)."""
    tasks: dict[int, TaskID] = {}

    def progress(version: int, done: int, total: int, bounds: float = float("nan")) -> None:
        if version not in tasks:
            tasks[version] = bar.add_task(
                f"v{version} honest peers synced", total=total, simulated=""
            )
        simulated = "" if math.isnan(bounds) else f"clock at x{bounds:.2f} of the bound"
        bar.update(tasks[version], completed=done, simulated=simulated)

    return progress


def _version_reporter(
    bar: Progress, sc: scenarios.Scenario, progress: Callable[[int, int, int, float], None]
) -> Callable[[VersionResult], None]:
    """The callback for a finished version: settle its bar and print how it went against the
    lower bound and what the trainer uploaded."""

    def on_version(r: VersionResult) -> None:
        last = r.completion_s[-1] if r.completion_s else float("nan")
        progress(r.version, r.converged, r.honest, last / r.lower_bound_s)
        bar.console.print(
            f"v{r.version}: {r.converged}/{r.honest} honest peers in {last:.3f} s "
            f"(lower bound {r.lower_bound_s:.3f} s, x{last / r.lower_bound_s:.2f}), trainer "
            f"sent {r.trainer_upload_bytes / sc.payload_bytes:.2f}x the payload"
        )

    return on_version


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate a swarm at scale (scenario TOML)")
    p.add_argument("scenario", type=Path, help="scenario file, e.g. configs/simulations/ci.toml")
    p.add_argument("--out", type=Path, required=True, help="directory for report.json and plots")
    p.add_argument("--peers", type=int, help="override the scenario's peer count")
    p.add_argument("--versions", type=int, help="override the scenario's version count")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_simulate)
