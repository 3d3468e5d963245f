"""The simulation report's PNG plots, each legible at 10,000 peers (step curves over sorted
data, no per-point markers or bars):

* ``completion_cdf.png``: per version, the fraction of honest rollouts holding it against
  time in units of that version's Kumar-Ross bound; vertical lines at 1, at the run's worst
  ratio and, when NAT raises it, at the NAT-aware bound.
* ``upload_per_class.png``: per class of peer (``peerclasses.peer_classes``), its peers' bytes
  uploaded over the payload (all versions), sorted, against the percentile of the class: the
  distribution behind ``upload_per_class`` in ``report.json``.
* ``startup_lag.png``: CDFs of the honest peers' ``Lag`` phases per version (start, filling,
  tail: ``swarm_sim.Lag``), with each version's median start and the one-way latency times
  the median overlay depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from simulations.peerclasses import PHASES, upload_ratios
from simulations.swarm_sim import SwarmSim

Draw = Callable[[Any], None]  # draws on one matplotlib Axes


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (imported late: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _step_cdf(ax: Any, values: Sequence[float], total: int, **style: Any) -> None:
    """A step CDF of ``values`` over ``total`` (peers that never got there keep it below 1)."""
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / total for i in range(len(xs))]
    ax.step([xs[0], *xs], [0.0, *ys], where="post", linewidth=1.2, **style)


def _one(path: Path, title: str, labels: tuple[str, str], draw: Draw) -> Path:
    """One figure with one Axes: ``draw`` fills it, ``labels`` are (x, y)."""
    fig, ax = _pyplot().subplots(figsize=(7.0, 4.4))
    draw(ax)
    ax.set(title=title, xlabel=labels[0], ylabel=labels[1])
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def completion_cdf(sim: SwarmSim, report: dict[str, Any], path: Path) -> Path:
    """Every version's completion CDF, completion over the version's bound."""
    worst = report["ratio_to_bound"]["worst"]

    def draw(ax: Any) -> None:
        for r in sim.results:
            ratios = [t / r.lower_bound_s for t in r.completion_s]
            _step_cdf(ax, ratios, r.honest, label=f"v{r.version}")
        ax.axvline(1.0, color="k", linestyle="--", label="lower bound (x1)")
        if math.isfinite(worst):
            ax.axvline(worst, color="r", linestyle=":", label=f"worst x{worst:.2f}")
        nat = report.get("nat")
        if nat and max(nat["lower_bound_s"]) > max(report["lower_bound_s"]):
            x = max(nat["lower_bound_s"]) / max(report["lower_bound_s"])
            ax.axvline(x, color="purple", linestyle="-.", label=f"NAT-aware bound x{x:.2f}")
        ax.set_ylim(0, 1.02)

    title = f"{sim.sc.name}: completion, {len(sim.honest):,} honest rollouts"
    labels = ("completion / the version's lower bound", "fraction of honest rollouts")
    return _one(path, title, labels, draw)


def upload_per_class(sim: SwarmSim, path: Path) -> Path:
    """Each class's uploads, sorted high to low against the class's percentile; a class of
    one (the trainer) is a horizontal line."""
    classes = upload_ratios(sim)

    def draw(ax: Any) -> None:
        for name, values in classes.items():
            ys = sorted(values, reverse=True)
            if len(ys) == 1:
                ax.axhline(ys[0], linestyle="--", color="k", label=f"{name} (1)")
                continue
            xs = [100 * i / (len(ys) - 1) for i in range(len(ys))]
            ax.plot(xs, ys, linewidth=1.5, label=f"{name} ({len(ys):,})")
        ax.set_xlim(0, 100)
        ax.set_ylim(bottom=0)

    title = f"{sim.sc.name}: upload per class of peer"
    labels = ("percentile of the class, highest upload first", "uploaded / payload (all versions)")
    return _one(path, title, labels, draw)


def startup_lag(sim: SwarmSim, report: dict[str, Any], path: Path) -> Path:
    """CDFs of each converged honest peer's start, filling and tail lag, one panel each."""
    fig, axes = _pyplot().subplots(1, len(PHASES), figsize=(12.0, 4.0), sharey=True)
    depth_s = report["overlay_depth"]["median"] * sim.lat
    for ax, phase in zip(axes, PHASES, strict=True):
        for r in sim.results:
            values = [getattr(lag, phase) for lag in r.lags]
            _step_cdf(ax, values, r.honest, label=f"v{r.version}")
        ax.set(title=phase, xlabel=f"{phase} lag (s)")
        ax.grid(alpha=0.3)
    _mark_start(axes[0], report, depth_s)
    axes[0].set_ylabel("fraction of honest rollouts")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # nothing to name when no peer converged
            ax.legend(fontsize="small")
    fig.suptitle(f"{sim.sc.name}: where each honest peer's time went beyond F/d")
    return _save(fig, path)


def _mark_start(ax: Any, report: dict[str, Any], depth_s: float) -> None:
    """The start panel's references: each version's median, and latency x overlay depth."""
    for i, lag in enumerate(report["lag_s"]):
        if lag["median"]:
            label = "median (per version)" if i == 0 else None
            ax.axvline(lag["median"]["start"], color=f"C{i}", linestyle=":", label=label)
    ax.axvline(depth_s, color="k", linestyle="--", label="latency x median depth")


def write_all(sim: SwarmSim, report: dict[str, Any], out: Path) -> list[Path]:
    """Every plot, into ``out``."""
    return [
        completion_cdf(sim, report, out / "completion_cdf.png"),
        upload_per_class(sim, out / "upload_per_class.png"),
        startup_lag(sim, report, out / "startup_lag.png"),
    ]
