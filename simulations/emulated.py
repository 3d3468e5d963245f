"""Emulated tier (issue 6, item 3): a real swarm in network namespaces over tbf-shaped links.

Why: loopback runs every node at memory speed, so they say nothing about how the swarm uses
bandwidth. Here each node process (1 trainer + N-1 rollouts, started by ``simulations.localswarm``)
runs in its own namespace behind a link shaped to e.g. 100 Mbit/s each way
(``simulations.netns``), and every version's completion time is compared with the Kumar-Ross
lower bound for distributing F bytes from one seed to N receivers::

    T >= max(F / u_s, F / d_min, N * F / (u_s + sum u_i))

(u_s: the trainer's uplink, u_i: the rollouts' uplinks, d_min: the slowest downlink). F is the
payload each rollout must fetch for that version (the 1-step patch, or the snapshot for v0).

Payload: random bf16 tensors of ``payload_mb`` in total, every element rewritten each version
(exponent capped so no NaN/Inf), so each version's patch is about as large as the weights and
nearly incompressible: the worst case for the network, and a known F.

    python -m simulations.emulated --hosts 8 --mbps 100 --payload-mb 20 --versions 3 [--delay-ms 20]

``--delay-ms`` adds a one-way propagation delay between every two hosts (``simulations.delayline``
forwards the frames instead of a bridge); the lower bound ignores it (it is a bandwidth bound).

Needs root and iproute2 (see ``simulations.netns``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from p2p_sync.statehash import state_hash
from simulations.localswarm import Placement, Proc, Swarm, get_json, wait_for
from simulations.netns import Host, LinkShape, RateSample, Topology, TopologyConfig, measure_rate


@dataclass(frozen=True)
class EmulationConfig:
    """One emulated run. Every limit lives here."""

    hosts: int = 8  # 1 trainer + hosts-1 rollouts
    mbps: float = 100.0  # every host's uplink and downlink
    payload_mb: float = 20.0  # MB (10^6 B) of weights, all rewritten every version
    versions: int = 3
    tensors: int = 4  # the payload is split over this many tensors
    chunk_size: int = 0  # the trainer's: 0 = by payload (p2p_sync.chunks.chunk_size_for)
    burst_bytes: int = 64 * 1024
    latency_ms: float = 20.0  # tbf's queue limit (LinkShape.latency_ms), not a delay
    delay_ms: float = 0.0  # one-way propagation delay between any two hosts (TopologyConfig)
    rate_probe_mb: float = 0.0  # measure one host-to-host transfer first (0: skip)
    start_timeout_s: float = 120.0  # every node process up
    version_timeout_s: float = 300.0  # one version from publish to every rollout
    poll_s: float = 0.05  # /status polling period (bounds the timing resolution)
    anchor_every: int = 10_000  # no anchor snapshots: each version is one 1-step patch
    # flags for every node: the HTTP data plane with --peers is what this tier measures; libp2p
    # (discovery, gossip) would only add start-up time and CPU to every process
    node_args: tuple[str, ...] = ("--no-p2p",)
    seed: int = 0

    @property
    def payload_bytes(self) -> int:
        return int(self.payload_mb * 1e6)

    def link(self) -> LinkShape:
        return LinkShape(self.mbps, None, self.burst_bytes, self.latency_ms)

    def topology(self) -> TopologyConfig:
        return TopologyConfig(hosts=self.hosts, shape=self.link(), delay_ms=self.delay_ms)


@dataclass(frozen=True)
class VersionResult:
    """Figures of one version (times in seconds, sizes in bytes)."""

    version: int
    payload: int  # F: what each rollout had to fetch (payload_size of its manifest)
    end_to_end_s: float  # file dropped in the trainer's watch dir -> every rollout has it
    distribution_s: float  # trainer has published it -> every rollout has it
    lower_bound_s: float  # Kumar-Ross for F
    trainer_up: int  # trainer's chunk upload during this version
    rollouts_down: int  # sum of rollouts' chunk download during this version
    steps: dict[str, float] = field(default_factory=dict)  # STEPS: median rollout's seconds

    @property
    def ratio(self) -> float:
        """Distribution time over the lower bound (1.0 is optimal)."""
        return self.distribution_s / self.lower_bound_s


@dataclass
class EmulationResult:
    cfg: EmulationConfig
    versions: list[VersionResult] = field(default_factory=list)
    converged: bool = False  # every rollout's state hash equals the last version's
    link: RateSample | None = None
    delay_line: str | None = None  # the delay line's counters (frames, drops), if it ran


def kumar_ross(payload: int, seed_up: float, uploads: list[float], min_down: float) -> float:
    """Minimum time (s) to give ``payload`` bytes from one seed to ``len(uploads)`` receivers;
    rates in bytes/s (Kumar & Ross, "Peer-assisted file distribution", 2006)."""
    n = len(uploads)
    return max(payload / seed_up, payload / min_down, n * payload / (seed_up + sum(uploads)))


def random_versions(cfg: EmulationConfig) -> list[dict[str, torch.Tensor]]:
    """``cfg.versions`` state dicts of random bf16, every element different each version.

    Bit 14 (the exponent's top bit) is cleared so no value is NaN or Inf: |x| < 2."""
    gen = torch.Generator().manual_seed(cfg.seed)
    per = cfg.payload_bytes // 2 // cfg.tensors
    out = []
    for _ in range(cfg.versions):
        out.append(
            {
                f"layer{i}.weight": (
                    torch.randint(0, 2**16, (per,), generator=gen, dtype=torch.int32) & 0xBFFF
                )
                .to(torch.int16)
                .view(torch.bfloat16)
                for i in range(cfg.tensors)
            }
        )
    return out


def placement(topo: Topology, host: Host) -> Placement:
    """Run a node inside ``host``, listening on its address; poll it from inside too."""

    def get(url: str) -> dict | None:
        return topo.call(host, get_json, url)

    return Placement(tuple(topo.exec_argv(host)), f"{host.ip}:0", get)


def _start(swarm: Swarm, topo: Topology, cfg: EmulationConfig) -> tuple[Proc, list[Proc]]:
    """Trainer on host 0, then every rollout in parallel (each pays a torch import)."""
    trainer = swarm.start_trainer(cfg.anchor_every, placement(topo, topo.hosts[0]), cfg.node_args)
    pool = concurrent.futures.ThreadPoolExecutor(len(topo.hosts))
    deadline = time.monotonic() + cfg.start_timeout_s
    try:
        futures = [
            pool.submit(
                swarm.start_rollout,
                f"r{h.index}",
                [trainer.url],
                None,
                placement(topo, h),
                cfg.node_args,
            )
            for h in topo.hosts[1:]
        ]
        return trainer, [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
    finally:
        # no waiting: a start still blocked on a silent process ends when the topology's
        # cleanup kills that process
        pool.shutdown(wait=False, cancel_futures=True)


def _payload_of(trainer: Proc, version: int) -> int:
    """F: size of the artifact a follower fetches (the 1-step patch; v0: the snapshot)."""
    manifests = trainer.get(f"{trainer.url}/manifests?version={version}") or []
    if version == 0:
        wanted = [m["payload_size"] for m in manifests if m["kind"] == "snapshot"]
    else:
        wanted = [m["payload_size"] for m in manifests if m.get("base_version") == version - 1]
    if not wanted:
        raise RuntimeError(f"trainer lists no artifact for v{version}: {manifests}")
    return wanted[0]


def lower_bound(topo: Topology, payload: int) -> float:
    """Kumar-Ross bound (s) for ``payload`` bytes from host 0 to all others, at their tbf rates
    (Mbit/s counted on Ethernet frames, so payload bytes alone can only reach ~96% of it)."""
    up = [h.shape.mbps * 1e6 / 8 for h in topo.hosts]
    down = min(h.shape.down for h in topo.hosts[1:]) * 1e6 / 8
    return kumar_ross(payload, up[0], up[1:], down)


def _counters(procs: list[Proc], key: str) -> list[int]:
    return [(p.status() or {}).get(key, 0) for p in procs]


# where a version's time goes at a rollout: (name, from step, to step) of node/timeline.py's
# steps, "published" being the trainer's (stored and signed, about to announce)
STEPS = (
    ("announce", "published", "heard"),
    ("manifest", "heard", "learned"),
    ("have-map", "learned", "first_have"),
    ("1st chunk", "first_have", "first_chunk"),
    ("chunks", "first_chunk", "fetched"),
    ("apply", "fetched", "handed_off"),
)


def breakdown(published_at: float, timelines: list[dict[str, float]]) -> dict[str, float]:
    """Median over rollouts of each step's seconds (a step a rollout did not report: skipped),
    plus "last": when the last rollout handed off, after publication."""
    out = {}
    for name, a, b in STEPS:
        spans = [
            t[b] - (published_at if a == "published" else t[a])
            for t in timelines
            if b in t and (a == "published" or a in t)
        ]
        if spans:
            out[name] = statistics.median(spans)
    ends = [t["handed_off"] - published_at for t in timelines if "handed_off" in t]
    if ends:
        out["last"] = max(ends)
    return out


def _steps(trainer: Proc, rollouts: list[Proc], v: int) -> dict[str, float]:
    """The version's breakdown from the nodes' own clocks (/status), not from our polling."""
    published = ((trainer.status() or {}).get("last_publish") or {}).get("stored_at")
    timelines = []
    for p in rollouts:
        update = (p.status() or {}).get("last_update") or {}
        if update.get("version") == v:
            timelines.append(update.get("timeline") or {})
    return breakdown(published, timelines) if published else {}


def _one_version(
    swarm: Swarm,
    topo: Topology,
    trainer: Proc,
    rollouts: list[Proc],
    v: int,
    weights: dict,
    cfg: EmulationConfig,
) -> VersionResult:
    """Publish ``weights`` as version ``v``, time it until every rollout holds it."""
    up0, down0 = _counters([trainer], "bytes_uploaded")[0], _counters(rollouts, "bytes_downloaded")
    seen: dict[str, float] = {}

    def reached() -> bool:
        now = time.monotonic()
        for p in [trainer, *rollouts]:
            if p.popen.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited ({p.popen.returncode}) during v{v}; "
                    f"see {swarm.root / p.name}.log"
                )
            if p.name not in seen and (p.status() or {}).get("version") == v:
                seen[p.name] = now
        return len(seen) == 1 + len(rollouts)

    t0 = time.monotonic()
    swarm.publish(weights)
    wait_for(reached, cfg.version_timeout_s, f"every rollout to reach v{v}", step=cfg.poll_s)
    done = max(seen.values())
    payload = _payload_of(trainer, v)
    return VersionResult(
        version=v,
        payload=payload,
        end_to_end_s=done - t0,
        distribution_s=done - seen[trainer.name],
        lower_bound_s=lower_bound(topo, payload),
        trainer_up=_counters([trainer], "bytes_uploaded")[0] - up0,
        rollouts_down=sum(_counters(rollouts, "bytes_downloaded")) - sum(down0),
        steps=_steps(trainer, rollouts, v),
    )


def run_in(topo: Topology, root: Path, cfg: EmulationConfig) -> EmulationResult:
    """The run itself, on a topology already built (the caller owns its cleanup): trainer on
    host 0, a rollout on each other host; ``cfg``'s topology fields are not used here."""
    result = EmulationResult(cfg)
    if cfg.rate_probe_mb > 0:
        nbytes = int(cfg.rate_probe_mb * 1e6)
        result.link = measure_rate(topo, topo.hosts[0], topo.hosts[1], nbytes)
    versions = random_versions(cfg)
    swarm = Swarm(root, chunk_size=cfg.chunk_size)
    try:
        trainer, rollouts = _start(swarm, topo, cfg)
        for v, weights in enumerate(versions):
            result.versions.append(_one_version(swarm, topo, trainer, rollouts, v, weights, cfg))
        want = state_hash(versions[-1]).hex()
        result.converged = all((p.status() or {}).get("state_hash") == want for p in rollouts)
    finally:
        swarm.stop()
    return result


def run(cfg: EmulationConfig, root: Path) -> EmulationResult:
    """Build the shaped topology, run the swarm in it, delete the topology whatever happens."""
    if cfg.hosts < 2:
        raise ValueError("an emulated swarm needs at least 2 hosts (a trainer and a rollout)")
    with Topology(cfg.topology()) as topo:
        result = run_in(topo, root, cfg)
    if topo.delay_line_exit is not None:  # its counters, printed when it stopped
        result.delay_line = topo.delay_line_exit[1].strip()
    return result


_HEAD = (
    "version",
    "F (MB)",
    "lower bd s",
    "distrib. s",
    "x bound",
    "end-to-end s",
    "trainer up/F",
    "rollouts down/F",
)


def _row(r: VersionResult) -> str:
    cells = (
        f"v{r.version}",
        f"{r.payload / 1e6:.2f}",
        f"{r.lower_bound_s:.2f}",
        f"{r.distribution_s:.2f}",
        f"{r.ratio:.2f}",
        f"{r.end_to_end_s:.2f}",
        f"{r.trainer_up / r.payload:.2f}",
        f"{r.rollouts_down / r.payload:.2f}",
    )
    return "  ".join(f"{x:>12}" for x in cells)


def table(result: EmulationResult) -> str:
    """Plain-text report, one row per version."""
    c = result.cfg
    lines = [
        f"{c.hosts} hosts (1 trainer + {c.hosts - 1} rollouts) at {c.mbps:g} Mbit/s up and "
        f"down, {c.delay_ms:g} ms one-way delay, {c.payload_mb:g} MB payload, "
        f"chunk {f'{c.chunk_size // 1024} KiB' if c.chunk_size else 'by payload'}"
    ]
    if result.link is not None:
        s = result.link
        lines.append(
            f"link check: {s.goodput_mbps:.1f} Mbit/s TCP goodput = {s.wire_mbps:.1f} "
            f"Mbit/s on the wire (configured {s.configured_mbps:g})"
        )
    lines.append("  ".join(f"{h:>12}" for h in _HEAD))
    lines.extend(_row(r) for r in result.versions)
    lines.append("where the time went (median rollout, ms; last: the last rollout's hand-off)")
    names = [name for name, _, _ in STEPS] + ["last"]
    lines.append("  ".join(f"{h:>10}" for h in ["version", *names]))
    for r in result.versions:
        cells = [f"{r.steps[n] * 1000:.0f}" if n in r.steps else "-" for n in names]
        lines.append("  ".join(f"{x:>10}" for x in [f"v{r.version}", *cells]))
    if result.delay_line is not None:
        lines.append(result.delay_line)
    lines.append(f"every rollout bit-exact with the trainer: {result.converged}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = EmulationConfig()
    ap.add_argument("--hosts", type=int, default=d.hosts)
    ap.add_argument("--mbps", type=float, default=d.mbps)
    ap.add_argument("--payload-mb", type=float, default=d.payload_mb)
    ap.add_argument("--versions", type=int, default=d.versions)
    ap.add_argument("--chunk-kb", type=int, default=0, help="0: the trainer's (by payload)")
    ap.add_argument("--delay-ms", type=float, default=d.delay_ms, help="one-way, between hosts")
    ap.add_argument("--rate-probe-mb", type=float, default=10.0, help="0: skip the link check")
    ap.add_argument("--keep", type=Path, help="keep node data and logs in this directory")
    args = ap.parse_args(argv)
    cfg = EmulationConfig(
        hosts=args.hosts,
        mbps=args.mbps,
        payload_mb=args.payload_mb,
        versions=args.versions,
        chunk_size=args.chunk_kb * 1024,
        rate_probe_mb=args.rate_probe_mb,
        delay_ms=args.delay_ms,
    )
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run(cfg, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="p2psync-emu-") as tmp:
            result = run(cfg, Path(tmp))
    print(table(result))
    return 0 if result.converged else 1


if __name__ == "__main__":
    sys.exit(main())
