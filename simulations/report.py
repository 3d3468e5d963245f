"""What a simulation run reports: ``report.json``, ``summary.md`` and three PNG plots.

The plots (``simulations/plots.py``), each legible at 10,000 peers: ``completion_cdf.png``,
every version's completion CDF in units of its lower bound; ``upload_per_class.png``, the
sorted upload of each class of peer (``upload_per_class``); ``startup_lag.png``, CDFs of the
honest peers' ``Lag`` phases. ``summary.md`` ends with "What limited this run": the bound's
binding term, where the time beyond it went, convergence and the simulator's own cost.

``report.json`` keys (times in seconds, sizes in bytes; "honest" = rollouts that are neither
corrupt, stalling nor lying):

* ``peers``, ``honest_peers``, ``payload_bytes``, ``versions``
* ``honest_converged_fraction``: honest rollouts that reached the version, over all versions
* ``completion_time_s``: ``{"per_version": [last honest peer, ...], "worst": max}``
* ``completion_p50_s``: median honest peer per version
* ``lower_bound_s``: Kumar-Ross bound per version, max(F/u_s, F/d_min, N*F/(u_s + sum u_i))
  over the N honest rollouts (adversaries upload nothing useful, so they do not count)
* ``lower_bound_terms_s``: its three terms, the same every version (peers and links are
  fixed): ``trainer_uplink`` (F/u_s), ``slowest_downlink`` (F/d_min), ``swarm_uplink``
  (N*F/(u_s + sum u_i)), and ``binding``, the name of the largest
* ``honest_unconverged``: honest rollouts that did not reach each version in its time limit
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
* ``upload_per_class``: bytes uploaded over the payload (all versions together) per class
  of peer, each ``{"peers", "mean", "p10", "p50", "p90"}``: ``trainer``; ``honest`` or, with
  NAT, ``honest public`` and ``honest NATed``; with several link classes also ``honest
  U/D Mbit/s`` per (uplink, downlink) pair (these overlap the NAT classes); and ``corrupt``,
  ``stall``, ``liar`` when present. Whether every kind of peer pulls its weight
* ``overlay_depth``: ``median`` and ``max`` hops from the trainer over the honest rollouts;
  times the one-way latency, how long an announcement takes to reach them
* ``trainer_connections``: ``neighbours``, the rollouts connected to the trainer (its
  ``trainer_peers``, and any rollout with nobody else to reach), and ``served``, those it sent
  chunks to (all versions): what a swarm of any size asks of the trainer's host
* ``simulator``: what the run cost, to tell what limits a larger one: ``us_per_event``,
  ``peak_rss_bytes`` (the process's peak) and ``rss_growth_bytes`` (how far the run raised
  it), ``rss_bytes_per_1000_peers`` (that growth per 1,000 rollouts), ``simulated_s`` (the
  virtual clock at the end, all versions)
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

from simulations.peerclasses import PHASES, upload_ratios
from simulations.swarm_sim import HONEST, TRAINER, SwarmSim, VersionResult

# each term of the Kumar-Ross bound, as ``summary.md`` names it
TERMS = {
    "trainer_uplink": "the trainer's uplink, F/u_s",
    "slowest_downlink": "the slowest honest downlink, F/d_min",
    "swarm_uplink": "the swarm's total uplink, N*F/(u_s + sum u_i)",
}


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
        "simulated_s": sim.clock.now,
    }


def build(sim: SwarmSim, wall_clock_s: float, rss_before: int = 0) -> dict[str, Any]:
    res: list[VersionResult] = sim.results
    payload = sim.sc.payload_bytes
    last = [r.completion_s[-1] if r.converged == r.honest else float("inf") for r in res]
    bounds = [r.lower_bound_s for r in res]
    ratios = [c / b for c, b in zip(last, bounds)]
    up = [r.trainer_upload_bytes for r in res]
    false_bans = [b for b in sim.bans if b.role not in ("corrupt", "stall", "liar")]
    sent = sim.net.bytes_sent
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
        "lower_bound_terms_s": bound_terms(sim),
        "honest_unconverged": [r.honest - r.converged for r in res],
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
            "trainer": sent[0],
            "honest": [sent[p.idx] for p in sim.peers[1:] if p.role == HONEST],
        },
        "upload_per_class": {k: spread(v) for k, v in upload_ratios(sim).items()},
        "overlay_depth": overlay_depth(sim),
        "trainer_connections": trainer_connections(sim),
        "wall_clock_s": wall_clock_s,
        "events": sim.clock.events_run,
        "simulator": simulator_section(sim, wall_clock_s, rss_before),
        **({"nat": nat_section(sim, last)} if sim.sc.nat_fraction > 0 else {}),
    }


def bound_terms(sim: SwarmSim) -> dict[str, Any]:
    """The three terms of the Kumar-Ross bound (``SwarmSim.bounds`` takes their max) and the
    name of the one that sets it: what the physics allows and why."""
    f, us = sim.sc.payload_bytes, sim.peers[TRAINER].uplink
    honest = sim.honest
    terms: dict[str, Any] = {
        "trainer_uplink": f / us,
        "slowest_downlink": f / min(p.downlink for p in honest),
        "swarm_uplink": len(honest) * f / (us + sum(p.uplink for p in honest)),
    }
    terms["binding"] = max(TERMS, key=lambda k: terms[k])
    return terms


def spread(values: list[float]) -> dict[str, float]:
    """Count, mean and 10th/50th/90th percentiles (inclusive: one value is all of them)."""
    cuts = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else []
    p10, p50, p90 = (cuts[0], cuts[4], cuts[8]) if cuts else (values[0],) * 3
    return {
        "peers": len(values),
        "mean": statistics.fmean(values),
        "p10": p10,
        "p50": p50,
        "p90": p90,
    }


def overlay_depth(sim: SwarmSim) -> dict[str, float]:
    """Hops from the trainer to the honest rollouts: an announcement relayed hop by hop
    reaches a peer one latency per hop after the publication."""
    depths = [sim.depth[p.idx] for p in sim.honest]
    return {"median": statistics.median(depths), "max": max(depths)}


def trainer_connections(sim: SwarmSim) -> dict[str, int]:
    """The rollouts the trainer is connected to, and those it sent chunks to."""
    served = {requester for uploader, requester in sim.served if uploader == TRAINER}
    return {"neighbours": len(sim.peers[TRAINER].neighbors), "served": len(served)}


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
        f"- trainer: connected to {report['trainer_connections']['neighbours']} rollouts, sent"
        f" chunks to {report['trainer_connections']['served']}",
        f"- bans: {report['bans']} (false bans: {report['false_bans']})",
        f"- wall clock: {report['wall_clock_s']:.1f} s for {report['events']:,} events"
        f" ({report['simulator']['us_per_event']:.0f} us each); the run raised the process's"
        f" peak RSS by {report['simulator']['rss_growth_bytes'] / 1e6:.0f} MB"
        f" ({report['simulator']['rss_bytes_per_1000_peers'] / 1e6:.0f} MB per 1,000 peers)",
        *(_nat_lines(report) if "nat" in report else []),
        *_lag_lines(report),
        *_upload_lines(report),
        *limits_lines(report),
        "",
    ]
    return "\n".join(lines)


def _upload_lines(report: dict[str, Any]) -> list[str]:
    """``upload_per_class`` as a table: who carried the swarm."""
    lines = [
        "",
        "Upload per class of peer, over the payload (all versions):",
        "",
        "| class | peers | mean | p10 | p50 | p90 |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in report["upload_per_class"].items():
        stats = " | ".join(f"{c[k]:.2f}" for k in ("mean", "p10", "p50", "p90"))
        lines.append(f"| {name} | {c['peers']} | {stats} |")
    return lines


def limits_lines(report: dict[str, Any]) -> list[str]:
    """ "What limited this run": the physics (the bound's binding term), the time beyond it
    (by ``Lag`` phase), convergence, and the machine (the simulator's cost); every statement
    computed from the report."""
    return [
        "",
        "## What limited this run",
        "",
        f"- Bound: {_bound_sentence(report)}",
        f"- Beyond the bound: {_beyond_sentence(report)}",
        f"- Start-up: {_startup_sentence(report)}",
        f"- Convergence: {_convergence_sentence(report)}",
        f"- Simulator: {_cost_sentence(report)}",
    ]


def _bound_sentence(report: dict[str, Any]) -> str:
    """Which term of the Kumar-Ross bound binds, the others beside it; and the NAT-aware
    bound where it is higher."""
    terms = report["lower_bound_terms_s"]
    binding = terms["binding"]
    others = "; ".join(f"{TERMS[k]} = {terms[k]:.3f} s" for k in TERMS if k != binding)
    text = f"{terms[binding]:.3f} s, set by {TERMS[binding]} (the others: {others})."
    nat = report.get("nat")
    if nat and max(nat["lower_bound_s"]) > max(report["lower_bound_s"]):
        text += (
            f" NAT raises it to {max(nat['lower_bound_s']):.3f} s (NATed peers no punch "
            f"reaches fetch from public uplinks only); worst completion x"
            f"{nat['ratio_to_bound']:.2f} of that."
        )
    return text


def _worst_version(report: dict[str, Any]) -> int:
    """The index of the version with the highest completion / bound ratio."""
    ratios = report["ratio_to_bound"]["per_version"]
    return max(range(len(ratios)), key=lambda i: ratios[i])


def _beyond_sentence(report: dict[str, Any]) -> str:
    """The worst version's last peer against the bound, and where its and the median
    peer's downlink sat idle (``Lag`` phases), with the part of that the bound forces."""
    i = _worst_version(report)
    last, bound = report["completion_time_s"]["per_version"][i], report["lower_bound_s"][i]
    lag = report["lag_s"][i]
    if last == float("inf") or not lag["last"]:
        return f"version {i + 1} (the worst): not every honest peer converged."
    idle = sum(lag["last"].values())
    forced = max(bound - (last - idle), 0.0)  # the bound less the last peer's F/d
    return (
        f"version {i + 1} (the worst): the last honest peer took {last:.3f} s, x"
        f"{last / bound:.2f} the bound, {last - bound:.3f} s over (the bound is "
        f"{bound / last:.0%} of its time). Its downlink sat idle {idle:.3f} s beyond F/d "
        f"({_phases(lag['last'])}), {forced:.3f} s of which the bound forces; the median "
        f"peer's: {_phases(lag['median'])}."
    )


def _startup_sentence(report: dict[str, Any]) -> str:
    """The median peer's wait for its first chunk against the announcement's latency."""
    starts = [lag["median"]["start"] for lag in report["lag_s"] if lag["median"]]
    if not starts:
        return "no honest peer converged, so no start-up lag is known."
    depth = report["overlay_depth"]
    hop_s = report["scenario"]["latency_ms"] / 1e3
    median, most = (hop_s * depth[k] for k in ("median", "max"))
    return (
        f"the median peer's first chunk landed {max(starts):.3f} s after publication (the "
        f"latest over versions); one-way latency x overlay depth is {median:.3f} s at the "
        f"median depth ({depth['median']:g}), {most:.3f} s at the most ({depth['max']:g})."
    )


def _phases(lag: dict[str, float]) -> str:
    """Three ``Lag`` phases and the largest of them."""
    values = " / ".join(f"{lag[k]:.3f}" for k in PHASES)
    return f"start / filling / tail {values} s, most in {max(PHASES, key=lambda k: lag[k])}"


def _convergence_sentence(report: dict[str, Any]) -> str:
    """Honest peers that missed a version, and false bans."""
    missed = report["honest_unconverged"]
    bans = report["false_bans"]
    ban_text = f"{bans} false ban(s) of honest peers or the trainer" if bans else "no false bans"
    if not any(missed):
        return f"every honest peer converged in every version; {ban_text}."
    per = ", ".join(f"v{i + 1}: {n}" for i, n in enumerate(missed) if n)
    return (
        f"honest peers that did not converge within the time limit, of "
        f"{report['honest_peers']}: {per}; {ban_text}."
    )


def _cost_sentence(report: dict[str, Any]) -> str:
    """What the simulator cost: events, time per event, memory per 1,000 peers."""
    cost = report["simulator"]
    simulated = cost["simulated_s"]
    return (
        f"{report['events']:,} events in {report['wall_clock_s']:.1f} s of wall clock"
        f" ({cost['us_per_event']:.0f} us each) for {simulated:.2f} s simulated"
        f" ({report['wall_clock_s'] / simulated if simulated else 0:.3g} s per simulated s);"
        f" peak RSS {cost['peak_rss_bytes'] / 1e6:.0f} MB, of which the run added"
        f" {cost['rss_bytes_per_1000_peers'] / 1e6:.1f} MB per 1,000 peers."
    )


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


def write(sim: SwarmSim, report: dict[str, Any], out: Path, with_plots: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "summary.md").write_text(summary_md(report))
    if with_plots:
        from simulations import plots  # matplotlib only when plotting

        plots.write_all(sim, report, out)
