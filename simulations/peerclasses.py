"""Classes of peer a simulation report compares, and the phases of a peer's lost time:
shared by the report's figures (``report``) and its plots (``plots``)."""

from __future__ import annotations

import dataclasses

from simulations.swarm_sim import HONEST, MBPS, TRAINER, Lag, Peer, SwarmSim

PHASES = tuple(f.name for f in dataclasses.fields(Lag))  # start, filling, tail
ADVERSARIES = ("corrupt", "stall", "liar")


def peer_classes(sim: SwarmSim) -> dict[str, list[Peer]]:
    """The classes of peer whose upload the report compares (``upload_per_class``): the
    trainer, honest rollouts (public and NATed apart when any is NATed), each link class
    when there are several, then each kind of adversary present."""
    rollouts = sim.peers[1:]
    honest = [p for p in rollouts if p.role == HONEST]
    classes = {"trainer": [sim.peers[TRAINER]]}
    if any(p.nat for p in honest):
        classes["honest public"] = [p for p in honest if not p.nat]
        classes["honest NATed"] = [p for p in honest if p.nat]
    else:
        classes["honest"] = honest
    links = sorted({(p.uplink, p.downlink) for p in honest}, reverse=True)
    for up, down in links if len(links) > 1 else []:
        name = f"honest {up / MBPS:g}/{down / MBPS:g} Mbit/s"
        classes[name] = [p for p in honest if (p.uplink, p.downlink) == (up, down)]
    for role in ADVERSARIES:
        if members := [p for p in rollouts if p.role == role]:
            classes[role] = members
    return {k: v for k, v in classes.items() if v}


def upload_ratios(sim: SwarmSim) -> dict[str, list[float]]:
    """Each class's bytes uploaded per peer over the payload (all versions), per peer."""
    payload = sim.sc.payload_bytes * max(len(sim.results), 1)
    sent = sim.net.bytes_sent
    return {k: [sent[p.idx] / payload for p in ps] for k, ps in peer_classes(sim).items()}
