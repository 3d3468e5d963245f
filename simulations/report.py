"""What a simulation run reports: ``report.json``, ``summary.md`` and two PNG plots.

``report.json`` keys (times in seconds, sizes in bytes; "honest" = rollouts that are neither
corrupt, stalling nor lying):

* ``peers``, ``honest_peers``, ``payload_bytes``, ``versions``
* ``honest_converged_fraction``: honest rollouts that reached the version, over all versions
* ``completion_time_s``: ``{"per_version": [last honest peer, ...], "worst": max}``
* ``completion_p50_s``: median honest peer per version
* ``lower_bound_s``: Kumar-Ross bound per version, max(F/u_s, F/d_min, N*F/(u_s + sum u_i))
  over the N honest rollouts (adversaries upload nothing useful, so they do not count)
* ``ratio_to_bound``: worst completion / bound, per version and worst
* ``star_time_s``: the trainer sending the payload to every honest rollout itself
* ``trainer_upload_bytes``: per version and total; ``trainer_upload_ratio``: worst per version
  over the payload
* ``churned_per_version``; ``stayed_online_completion_s``: the last honest peer among those
  that did not churn (a peer away for part of the version finishes late by construction)
* ``ratio_to_own_bound``: per version and worst, the worst honest peer's completion over its
  own bound, ``swarm_sim.own_bound``: the Kumar-Ross bound, or for a churned peer its payload
  at its downlink's rate plus its time offline if that is later. Equal to ``ratio_to_bound``
  when nothing churns; with churn it is what the protocol lost, not what the churn took
* ``redundant_bytes``: bytes honest rollouts received beyond one payload each (cancelled
  endgame copies, corrupt chunks, transfers cut by churn)
* ``lag_s``: per version, where the honest peers' time went beyond the payload at their
  downlink's rate (``swarm_sim.Lag``: ``start``, before a peer's first chunk; ``filling``,
  lost while the trainer's chunks were still coming; ``tail``, lost after the swarm first
  held every chunk, at ``full_s`` after the publication): ``median`` (of each phase over the
  honest peers) and ``last`` (the last honest peer's own three)
* ``bans``, ``false_bans`` (bans of honest peers or the trainer), ``ban_reasons``
* ``uploaded_bytes_per_peer``, ``wall_clock_s``, ``events``, ``scenario`` (every knob)
* ``simulator``: what the run cost, to tell what limits a larger one: ``us_per_event``,
  ``peak_rss_bytes`` (the process's peak) and ``rss_growth_bytes`` (how far the run raised
  it), ``rss_bytes_per_1000_peers`` (that growth per 1,000 rollouts)
* ``nat`` (only when ``nat_fraction`` > 0; over honest rollouts): ``nat_peers``,
  ``public_peers``, ``punchable_peers`` (NATed ones hole punching gets through);
  ``mean_upload_bytes`` per NATed and per public peer (all versions) and
  ``nat_upload_share`` (NATed peers' part of all rollout upload): whether NATed peers pull
  their weight through the connections they opened; ``mean_neighbours`` of each kind;
  ``last_s``: the last NATed and the last public peer per version; ``lower_bound_s``: the
  bound once NATed peers can fetch only from public ones (max of Kumar-Ross and
  N_nat*F/(u_s + sum of public u_i), N_nat counting the NATed peers no punch reaches) and
  ``ratio_to_bound``, worst completion over it; ``nat_nat_chunks``: chunks served between two
  NATed peers (over punched connections only: 0 unless ``punch_fraction`` > 0)
"""

from __future__ import annotations

import dataclasses
import json
import resource
import statistics
from pathlib import Path
from typing import Any

from simulations.swarm_sim import HONEST, Lag, SwarmSim, VersionResult

PHASES = tuple(f.name for f in dataclasses.fields(Lag))  # start, filling, tail


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def simulator_section(sim: SwarmSim, wall_clock_s: float, rss_before: int) -> dict[str, Any]:
    peak = peak_rss()
    growth = max(peak - rss_before, 0)
    return {
        "us_per_event": 1e6 * wall_clock_s / max(sim.clock.events_run, 1),
        "peak_rss_bytes": peak,
        "rss_growth_bytes": growth,
        "rss_bytes_per_1000_peers": 1000 * growth / max(sim.sc.peers, 1),
    }


def build(sim: SwarmSim, wall_clock_s: float, rss_before: int = 0) -> dict[str, Any]:
    res: list[VersionResult] = sim.results
    payload = sim.sc.payload_bytes
    last = [r.completion_s[-1] if r.converged == r.honest else float("inf") for r in res]
    bounds = [r.lower_bound_s for r in res]
    ratios = [c / b for c, b in zip(last, bounds)]
    up = [r.trainer_upload_bytes for r in res]
    false_bans = [b for b in sim.bans if b.role not in ("corrupt", "stall", "liar")]
    return {
        "scenario": dataclasses.asdict(sim.sc),
        "peers": sim.sc.peers,
        "honest_peers": len(sim.honest),
        "payload_bytes": payload,
        "versions": len(res),
        "honest_converged_fraction": sum(r.converged for r in res) / sum(r.honest for r in res),
        "completion_time_s": {"per_version": last, "worst": max(last)},
        "completion_p50_s": [statistics.median(r.completion_s or [float("inf")]) for r in res],
        "lower_bound_s": bounds,
        "ratio_to_bound": {"per_version": ratios, "worst": max(ratios)},
        "star_time_s": [r.star_time_s for r in res],
        "trainer_upload_bytes": {"per_version": up, "total": sum(up)},
        "trainer_upload_ratio": max(up) / payload,
        "redundant_bytes": sum(r.received_bytes - r.useful_bytes for r in res),
        "lag_s": [lag_section(r) for r in res],
        "churned_per_version": [r.churned for r in res],
        "stayed_online_completion_s": [r.stayed_online_last_s for r in res],
        "ratio_to_own_bound": {
            "per_version": [r.own_bound_ratio for r in res],
            "worst": max(r.own_bound_ratio for r in res),
        },
        "bans": len(sim.bans),
        "false_bans": len(false_bans),
        "ban_reasons": sorted({b.reason.split(" chunk")[0] for b in sim.bans}),
        "uploaded_bytes_per_peer": {
            "trainer": sim.net.bytes_sent[0],
            "honest": [sim.net.bytes_sent[p.idx] for p in sim.peers[1:] if p.role == HONEST],
        },
        "wall_clock_s": wall_clock_s,
        "events": sim.clock.events_run,
        "simulator": simulator_section(sim, wall_clock_s, rss_before),
        **({"nat": nat_section(sim, last)} if sim.sc.nat_fraction > 0 else {}),
    }


def lag_section(r: VersionResult) -> dict[str, Any]:
    """One version's ``lag_s`` (empty phases when no honest peer converged)."""
    lags = r.lags
    if not lags:
        return {"full_s": r.full_s, "median": {}, "last": {}}
    return {
        "full_s": r.full_s,
        "median": {k: statistics.median(getattr(x, k) for x in lags) for k in PHASES},
        "last": dataclasses.asdict(lags[-1]),
    }


def nat_section(sim: SwarmSim, last: list[float]) -> dict[str, Any]:
    """NATed against public honest rollouts: upload, neighbours, completion, the NAT-aware
    bound (``last``: the last honest peer per version)."""
    honest = [p for p in sim.peers[1:] if p.role == HONEST]
    kinds = {"nat": [p for p in honest if p.nat], "public": [p for p in honest if not p.nat]}
    sent = sim.net.bytes_sent

    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    uploads = {k: [sent[p.idx] for p in ps] for k, ps in kinds.items()}
    total = sum(uploads["nat"]) + sum(uploads["public"])
    bounds = [r.nat_bound_s for r in sim.results]
    pairs = sim.served.items()
    return {
        "nat_peers": len(kinds["nat"]),
        "public_peers": len(kinds["public"]),
        "punchable_peers": sum(p.punchable for p in kinds["nat"]),
        "mean_upload_bytes": {k: mean(v) for k, v in uploads.items()},
        "nat_upload_share": sum(uploads["nat"]) / total if total else 0.0,
        "mean_neighbours": {k: mean([len(p.neighbors) for p in ps]) for k, ps in kinds.items()},
        "last_s": {
            "nat": [r.last_nat_s for r in sim.results],
            "public": [r.last_public_s for r in sim.results],
        },
        "lower_bound_s": bounds,
        "ratio_to_bound": max(c / b for c, b in zip(last, bounds, strict=True)),
        "nat_nat_chunks": sum(n for (a, b), n in pairs if sim.peers[a].nat and sim.peers[b].nat),
    }


def summary_md(report: dict[str, Any]) -> str:
    sc = report["scenario"]
    mb = report["payload_bytes"] / 1e6
    lines = [
        f"# Simulation: {sc['name']}",
        "",
        f"{report['peers']} rollouts ({report['honest_peers']} honest) + 1 trainer, "
        f"{report['versions']} version(s) of a {mb:g} MB patch, links {sc['uplink_mbps']:g}/"
        f"{sc['downlink_mbps']:g} Mbit/s up/down (trainer up {sc['trainer_uplink_mbps']:g}), "
        f"latency {sc['latency_ms']:g} ms, churn {sc['churn_fraction']:.0%}, corrupt "
        f"{sc['corrupt_fraction']:.0%}, stall {sc['stall_fraction']:.0%}, liars "
        f"{sc['liar_fraction']:.0%}, seed {sc['seed']}.",
        "",
        "| version | last honest peer (s) | median (s) | lower bound (s) | ratio | star (s) "
        "| trainer upload / payload |",
        "|---|---|---|---|---|---|---|",
    ]
    for i in range(report["versions"]):
        lines.append(
            f"| {i + 1} | {report['completion_time_s']['per_version'][i]:.3f} "
            f"| {report['completion_p50_s'][i]:.3f} | {report['lower_bound_s'][i]:.3f} "
            f"| {report['ratio_to_bound']['per_version'][i]:.2f} "
            f"| {report['star_time_s'][i]:.2f} "
            f"| {report['trainer_upload_bytes']['per_version'][i] / report['payload_bytes']:.2f} |"
        )
    lines += [
        "",
        f"- honest peers converged: {report['honest_converged_fraction']:.1%}",
        f"- worst completion / lower bound: {report['ratio_to_bound']['worst']:.2f}",
        f"- worst peer / its own bound (time offline added for churned peers): "
        f"{report['ratio_to_own_bound']['worst']:.2f}",
        f"- redundant bytes: {report['redundant_bytes'] / 1e6:.1f} MB",
        f"- bans: {report['bans']} (false bans: {report['false_bans']})",
        f"- wall clock: {report['wall_clock_s']:.1f} s for {report['events']:,} events"
        f" ({report['simulator']['us_per_event']:.0f} us each); the run raised the process's"
        f" peak RSS by {report['simulator']['rss_growth_bytes'] / 1e6:.0f} MB"
        f" ({report['simulator']['rss_bytes_per_1000_peers'] / 1e6:.0f} MB per 1,000 peers)",
        *(_nat_lines(report) if "nat" in report else []),
        *_lag_lines(report),
        "",
    ]
    return "\n".join(lines)


def _lag_lines(report: dict[str, Any]) -> list[str]:
    """Where the time went, per version: the median and the last honest peer."""
    lines = [
        "",
        "Where the time went beyond the payload at each peer's downlink rate (ms lost: before "
        "its first chunk / while the trainer's chunks came / in the tail after the swarm held "
        "them all):",
        "",
        "| version | swarm held every chunk (s) | median peer | last peer |",
        "|---|---|---|---|",
    ]
    for i, lag in enumerate(report["lag_s"]):
        cells = [
            " / ".join(f"{1e3 * part[k]:.0f}" for k in PHASES) if part else "-"
            for part in (lag["median"], lag["last"])
        ]
        lines.append(f"| {i + 1} | {lag['full_s']:.3f} | {cells[0]} | {cells[1]} |")
    return lines


def _nat_lines(report: dict[str, Any]) -> list[str]:
    nat, mb = report["nat"], 1e6
    per = report["payload_bytes"] * report["versions"]  # one payload per version
    up = nat["mean_upload_bytes"]
    return [
        f"- NAT: {nat['nat_peers']} NATed ({nat['punchable_peers']} punchable) / "
        f"{nat['public_peers']} public honest rollouts "
        f"(mean neighbours {nat['mean_neighbours']['nat']:.1f} / "
        f"{nat['mean_neighbours']['public']:.1f})",
        f"- mean upload per NATed peer {up['nat'] / mb:.1f} MB ({up['nat'] / per:.2f}x the "
        f"payload), per public peer {up['public'] / mb:.1f} MB ({up['public'] / per:.2f}x); "
        f"NATed share of rollout upload {nat['nat_upload_share']:.1%}",
        f"- last NATed peer {max(nat['last_s']['nat']):.3f} s, last public peer "
        f"{max(nat['last_s']['public']):.3f} s; NAT-aware bound "
        f"{max(nat['lower_bound_s']):.3f} s (worst x{nat['ratio_to_bound']:.2f}); chunks "
        f"between NATed peers: {nat['nat_nat_chunks']}",
    ]


def _figure(path: Path, title: str, xlabel: str, ylabel: str, draw) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    draw(ax)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(sim: SwarmSim, out: Path) -> list[Path]:
    """Completion CDF per version against the bound; bytes uploaded per peer."""

    def cdf(ax) -> None:
        for r in sim.results:
            ys = [(i + 1) / r.honest for i in range(len(r.completion_s))]
            ax.step(r.completion_s, ys, where="post", label=f"v{r.version}")
        ax.axvline(sim.results[0].lower_bound_s, color="k", linestyle="--", label="lower bound")

    payload = sim.sc.payload_bytes * len(sim.results)
    ups = sorted(
        (sim.net.bytes_sent[p.idx] / payload for p in sim.peers[1:] if p.role == HONEST),
        reverse=True,
    )

    def uploads(ax) -> None:
        ax.bar(range(len(ups)), ups, width=1.0, label="honest rollouts")
        ax.axhline(sim.net.bytes_sent[0] / payload, color="r", label="trainer")

    name = sim.sc.name
    return [
        _figure(
            out / "completion_cdf.png",
            f"{name}: completion CDF",
            "time since publish (s)",
            "fraction of honest rollouts with the version",
            cdf,
        ),
        _figure(
            out / "upload_per_peer.png",
            f"{name}: upload per peer",
            "rollouts, by bytes uploaded",
            "uploaded / payload (all versions)",
            uploads,
        ),
    ]


def write(sim: SwarmSim, report: dict[str, Any], out: Path, with_plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "summary.md").write_text(summary_md(report))
    if with_plots:
        plots(sim, out)
