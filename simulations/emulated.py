"""Emulated tier: a real swarm in network namespaces over tbf-shaped links.

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

Every host is a process on this machine, so the CPUs can set the pace instead of the links.
While each version spread (from the trainer's publication to the last rollout holding it) the
table reports the share of the machine's cores busy ("CPU busy") and how long each node
waited, runnable, for a core ("CPU wait s", the mean over the trainer and the rollouts): at
most what the CPUs, not the links, took from the version (``CpuSample``).

``--delay-ms`` adds a one-way propagation delay between every two hosts (``simulations.delayline``
forwards the frames instead of a bridge); the lower bound ignores it (it is a bandwidth bound).

Volunteers behind NAT: ``--nat 0,0,0,1,1,2,2,3`` gives each rollout's NAT group (0:
public, k: behind router k, shared by its group: ``TopologyConfig.nat``). A NATed node can only
serve over the libp2p connections it opened, so a NAT run puts a public bootstrap node on host 1
(``--bootstrap``, implied by ``--nat``), turns libp2p on for every node and has the trainer and
the rollouts join through it (``--trainer-nat K`` puts the trainer behind router K too: a
trainer on a lab or home network). The bootstrap holds no weights: the bound counts only the
trainer and the rollouts. The report adds each rollout's place, its reachability verdict and
its upload::

    python -m simulations.emulated --nat 0,0,0,1,1,2,2,3 --delay-ms 20   # 10 hosts
    python -m simulations.emulated --nat 0,0,0,0,0,0,0,0 --delay-ms 20   # the same, all public

"relayed/F" is what public nodes forwarded between NATed peers (circuit relay v2) per version.
NATed peers behind different NATs first meet through a relay, then punch a hole (DCUtR) a few
seconds into a download; ``--punch-wait 20`` waits up to 20 s for one after each version until
one is seen, so the later versions show the swarm as long-running volunteers have it::

    python -m simulations.emulated --nat 1,2 --mbps 40 --payload-mb 4 --punch-wait 20

Outages: ``--outage-s 0.4 --outage-after-s 0.5`` cuts the last rollout off the network for 0.4 s,
0.5 s into every version (the delay line drops every frame from or to it, so it needs
``--delay-ms``); its node runs on, as through a Wi-Fi or home-line blip. The report says when it
had each version against the other rollouts, to set beside the simulator's churn::

    python -m simulations.emulated --mbps 25 --payload-mb 5 --delay-ms 20 --outage-s 0.4

Needs root and iproute2 (see ``simulations.netns``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from p2p_sync.weights.statehash import state_hash
from simulations.localswarm import Placement, Proc, Swarm, get_json, wait_for
from simulations.netns import Host, LinkShape, RateSample, Topology, TopologyConfig, measure_rate
from simulations.private import PrivateSwarm, get_json_tls


@dataclass(frozen=True)
class EmulationConfig:
    """One emulated run. Every limit lives here."""

    hosts: int = 8  # 1 trainer (+ 1 bootstrap) + the rollouts
    mbps: float = 100.0  # every host's uplink and downlink
    payload_mb: float = 20.0  # MB (10^6 B) of weights, all rewritten every version
    versions: int = 3
    tensors: int = 4  # the payload is split over this many tensors
    chunk_size: int = 0  # the trainer's: 0 = by payload (p2p_sync.trust.chunks.chunk_size_for)
    burst_bytes: int = 64 * 1024
    latency_ms: float = 20.0  # tbf's queue limit (LinkShape.latency_ms), not a delay
    delay_ms: float = 0.0  # one-way propagation delay between any two hosts (TopologyConfig)
    rate_probe_mb: float = 0.0  # measure one host-to-host transfer first (0: skip)
    start_timeout_s: float = 120.0  # every node process up
    verdict_timeout_s: float = 60.0  # then (libp2p on) every node's reachability verdict
    # After each version until the first hole punch (DCUtR) is seen, wait up to this long for
    # one, so later versions show NAT-to-NAT pairs as long-running volunteers have them (a
    # punch needs a relayed connection first: two NATed peers that traded in a version, then a
    # few seconds; peers that have not met yet meet in the next); 0: do not wait.
    punch_wait_s: float = 0.0
    version_timeout_s: float = 300.0  # one version from publish to every rollout
    poll_s: float = 0.05  # /status polling period (bounds the timing resolution)
    anchor_every: int = 10_000  # no anchor snapshots: each version is one 1-step patch
    # A public bootstrap node on host 1 (no weights). With it libp2p is on for every node and
    # the trainer and the rollouts join through it (volunteers behind NAT can only serve over
    # libp2p connections they opened); without it every node runs --no-p2p: the HTTP data plane
    # with --peers is all there is, and libp2p would only add start-up time and CPU.
    bootstrap: bool = False
    # nat[i]: NAT group of rollout i (0: public; k > 0: behind NAT router k, shared by every
    # rollout of group k, one home LAN); rollouts beyond len(nat) are public. Needs bootstrap.
    nat: tuple[int, ...] = ()
    # NAT group of the trainer (0: public; k: behind router k, with the rollouts of group k
    # if any): a trainer on a home or lab network. Needs bootstrap.
    trainer_nat: int = 0
    node_args: tuple[str, ...] = ()  # more flags for every node
    # a private swarm: every node admitted under the trainer's key as admin, every link
    # (TLS data plane, libp2p) members only (``simulations.private``)
    private: bool = False
    seed: int = 0
    # An outage in every version: the last rollout's host is cut off the network (every frame
    # from or to it lost, silently: a Wi-Fi or home-line blip; the node keeps running) for
    # ``outage_s``, ``outage_after_s`` after the trainer published (0: none). Needs delay_ms.
    outage_s: float = 0.0
    outage_after_s: float = 0.5

    @property
    def payload_bytes(self) -> int:
        return int(self.payload_mb * 1e6)

    @property
    def first_rollout(self) -> int:
        """Host index of the first rollout: after the trainer (0) and the bootstrap (1)."""
        return 2 if self.bootstrap else 1

    @property
    def rollouts(self) -> int:
        return self.hosts - self.first_rollout

    def nat_of(self, rollout: int) -> int:
        """NAT group of the ``rollout``-th rollout (0: public)."""
        return self.nat[rollout] if rollout < len(self.nat) else 0

    def flags(self) -> tuple[str, ...]:
        """Flags every node gets (the trainer and rollouts also --bootstrap, once it is up)."""
        return self.node_args if self.bootstrap else ("--no-p2p", *self.node_args)

    def check(self) -> None:
        """ValueError naming what cannot be run."""
        if self.rollouts < 1:
            raise ValueError(f"{self.hosts} hosts leave no rollout (a trainer, a bootstrap?)")
        if len(self.nat) > self.rollouts:
            raise ValueError(f"nat has {len(self.nat)} entries for {self.rollouts} rollouts")
        if (any(self.nat) or self.trainer_nat) and not self.bootstrap:
            raise ValueError("rollouts behind NAT serve over libp2p: they need the bootstrap")
        if self.outage_s < 0 or self.outage_after_s < 0:
            raise ValueError("outage_s and outage_after_s must be >= 0")
        if self.outage_s and not (self.delay_ms and not self.nat_of(self.rollouts - 1)):
            raise ValueError(
                "an outage needs delay_ms > 0 (the delay line) and a public last rollout"
            )

    def link(self) -> LinkShape:
        return LinkShape(self.mbps, None, self.burst_bytes, self.latency_ms)

    def topology(self) -> TopologyConfig:
        """The trainer and the bootstrap public, each rollout where ``nat`` puts it."""
        nat = (self.trainer_nat, 0, *self.nat) if any(self.nat) or self.trainer_nat else ()
        cut = (self.hosts - 1,) if self.outage_s else ()
        return TopologyConfig(
            self.hosts, self.link(), delay_ms=self.delay_ms, nat=nat, cut_hosts=cut
        )


@dataclass(frozen=True)
class Outage:
    """One version's outage, in seconds after the trainer published."""

    cut_s: float  # the last rollout cut off
    joined_s: float  # and joined again
    got_s: float  # it had the version
    others_s: float  # the last of the other rollouts had it


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
    relayed: int = 0  # bytes that public nodes relayed (circuit relay v2) during this version
    steps: dict[str, float] = field(default_factory=dict)  # STEPS: median rollout's seconds
    outage: Outage | None = None  # the last rollout's (``EmulationConfig.outage_s``)
    cpu_busy: float = float("nan")  # share of this machine's cores busy while distributed
    cpu_wait_s: float = float("nan")  # meanwhile, each node's mean wait for a core (CpuSample)

    @property
    def ratio(self) -> float:
        """Distribution time over the lower bound (1.0 is optimal)."""
        return self.distribution_s / self.lower_bound_s


@dataclass(frozen=True)
class NodeReport:
    """One node at the end of the run: where it sat, what it concluded, what it served."""

    name: str
    nat: int  # 0: public; k: behind NAT router k
    verdict: str | None  # its reachability verdict (/status), None if it did not answer
    uploaded: int  # chunk bytes served over the whole run: HTTP, channels, libp2p streams
    channel_uploaded: int  # of which over reverse channels it opened (behind NAT)
    streams_uploaded: int  # of which over libp2p streams (behind NAT: relayed, or no channel)
    downloaded: int
    hole_punched: int = 0  # relayed connections it turned direct (DCUtR, either side)
    hole_punches: int = 0  # DCUtR exchanges it started
    members_refused: int | None = None  # libp2p peers it refused membership (None: open)

    @classmethod
    def of(cls, proc: Proc, nat: int) -> NodeReport:
        """From the node's own /status: it alone knows its verdict and what it served."""
        doc = proc.status() or {}
        verdict = (doc.get("reachability") or {}).get("verdict")
        p2p = doc.get("p2p") or {}
        streams, punched = p2p.get("streams_bytes_uploaded", 0), p2p.get("hole_punched", 0)
        channels = (doc.get("reverse") or {}).get("bytes_uploaded", 0)
        up, down = doc.get("bytes_uploaded", 0), doc.get("bytes_downloaded", 0)
        tries = p2p.get("hole_punches", 0)
        refused = (p2p.get("membership") or {}).get("refused")
        return cls(proc.name, nat, verdict, up, channels, streams, down, punched, tries, refused)


@dataclass
class EmulationResult:
    cfg: EmulationConfig
    versions: list[VersionResult] = field(default_factory=list)
    converged: bool = False  # every rollout's state hash equals the last version's
    link: RateSample | None = None
    delay_line: str | None = None  # the delay line's counters (frames, drops), if it ran
    trainer: NodeReport | None = None
    rollouts: list[NodeReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what went wrong without stopping the run
    punched_after: int | None = None  # the version after which a hole punch was first seen
    tcp: dict | None = None  # the trainer's data plane: congestion control, idle restart

    def mean_upload(self, nated: bool) -> float | None:
        """Mean bytes uploaded per NATed (or per public) rollout; None if there is none."""
        ups = [r.uploaded for r in self.rollouts if bool(r.nat) == nated]
        return statistics.mean(ups) if ups else None

    @property
    def trainer_upload_ratio(self) -> float | None:
        """The trainer's upload over the payloads it published (1.0: each chunk once)."""
        payload = sum(v.payload for v in self.versions)
        return self.trainer.uploaded / payload if self.trainer and payload else None


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


def placement(topo: Topology, host: Host, members: PrivateSwarm | None = None) -> Placement:
    """Run a node inside ``host``, listening on its address; poll it from inside too (in a
    private swarm, over TLS as a member)."""

    def get(url: str) -> dict | None:
        if members is not None:
            return topo.call(host, get_json_tls, url, members.tls)
        return topo.call(host, get_json, url)

    return Placement(tuple(topo.exec_argv(host)), f"{host.ip}:0", get)


def _start_bootstrap(swarm: Swarm, topo: Topology, cfg: EmulationConfig) -> tuple[str, ...]:
    """The bootstrap node on host 1, if any: the flags that make a node join through it."""
    if not cfg.bootstrap:
        return ()
    boot = swarm.start_bootstrap(
        at=placement(topo, topo.hosts[1], swarm.members), extra=cfg.node_args
    )
    wait_for(lambda: boot.multiaddr() is not None, cfg.start_timeout_s, "the bootstrap's address")
    return ("--bootstrap", str(boot.multiaddr()))


def _start(swarm: Swarm, topo: Topology, cfg: EmulationConfig) -> tuple[Proc, list[Proc]]:
    """Bootstrap (if any) and trainer, then every rollout in parallel (each pays a torch
    import); rollouts know the trainer by its URL, and the swarm through the bootstrap."""
    flags = cfg.flags() + _start_bootstrap(swarm, topo, cfg)
    trainer = swarm.start_trainer(
        cfg.anchor_every, placement(topo, topo.hosts[0], swarm.members), flags
    )
    hosts = topo.hosts[cfg.first_rollout :]
    pool = concurrent.futures.ThreadPoolExecutor(len(hosts))
    deadline = time.monotonic() + cfg.start_timeout_s
    try:
        futures = [
            pool.submit(
                swarm.start_rollout,
                f"r{h.index}",
                [trainer.url],
                None,
                placement(topo, h, swarm.members),
                flags,
            )
            for h in hosts
        ]
        return trainer, [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]
    finally:
        # no waiting: a start still blocked on a silent process ends when the topology's
        # cleanup kills that process
        pool.shutdown(wait=False, cancel_futures=True)


def _await_verdicts(procs: list[Proc], cfg: EmulationConfig) -> str | None:
    """Wait (bounded) until every node knows whether peers can dial it, so v0 is not timed
    while NATed nodes still name themselves nothing; what is still unknown, on a timeout."""

    def unknown() -> list[str]:
        docs = {p.name: (p.status() or {}).get("reachability") or {} for p in procs}
        return [n for n, r in docs.items() if r.get("verdict") in (None, "unknown")]

    try:
        wait_for(lambda: not unknown(), cfg.verdict_timeout_s, "reachability verdicts", 0.2)
    except AssertionError:
        return f"reachability still unknown after {cfg.verdict_timeout_s:g} s: {unknown()}"
    return None


def _punched(rollouts: list[Proc], cfg: EmulationConfig) -> bool:
    """Wait (bounded) until a rollout has turned a relayed connection direct: whether one did."""

    def punched() -> bool:
        return any(_p2p(p).get("hole_punched", 0) > 0 for p in rollouts)

    try:
        wait_for(punched, cfg.punch_wait_s, "a hole punch", 0.2)
    except AssertionError:
        return False
    return True


# What a failed hole punch leaves in a node's py-libp2p log: the addresses each side offered,
# where it dialed and how each dial ended (the CI machine is the one place a punch has failed)
DCUTR_LOG = "relay.circuit_v2.dcutr:DEBUG"
_DCUTR_WORDS = ("Advertising", "Error", "Timeout", "Failed", "failed", "Maximum", "Attempting")


def _dcutr_trail(proc: Proc, keep: int = 12) -> list[str]:
    """The last ``keep`` telling lines of ``proc``'s DCUtR log (none if it kept no log)."""
    path = proc.data_dir.parent / f"{proc.name}.libp2p.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    telling = [
        line
        for line in lines
        if ("dcutr" in line or "transport.tcp" in line) and any(w in line for w in _DCUTR_WORDS)
    ]
    return [line[:300] for line in telling][-keep:]


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


def lower_bound(topo: Topology, payload: int, first_rollout: int = 1) -> float:
    """Kumar-Ross bound (s) for ``payload`` bytes from host 0 to the hosts from
    ``first_rollout`` on (the ones between, the bootstrap, hold no weights: they neither upload
    nor need the payload), at their tbf rates (Mbit/s counted on Ethernet frames, so payload
    bytes alone can only reach ~96% of it)."""
    receivers = topo.hosts[first_rollout:]
    up = [h.shape.mbps * 1e6 / 8 for h in receivers]
    down = min(h.shape.down for h in receivers) * 1e6 / 8
    return kumar_ross(payload, topo.hosts[0].shape.mbps * 1e6 / 8, up, down)


def _counters(procs: list[Proc], key: str) -> list[int]:
    return [(p.status() or {}).get(key, 0) for p in procs]


def _p2p(proc: Proc) -> dict:
    """The libp2p part of a node's /status (empty if it has none or did not answer)."""
    return (proc.status() or {}).get("p2p") or {}


def _relayed(procs: list[Proc]) -> int:
    """Bytes relayed for others so far, all of ``procs`` together."""
    return sum(_p2p(p).get("relayed_bytes", 0) for p in procs)


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


def _arrivals(
    swarm: Swarm, procs: list[Proc], v: int
) -> tuple[dict[str, float], dict[str, CpuSample], Callable[[], bool]]:
    """When each node first showed version ``v``, and a :class:`CpuSample` of ``procs`` then
    (filled in by the returned poll, which says whether all have it); a node process that
    exits meanwhile fails the run, naming its log."""
    seen: dict[str, float] = {}
    cpu: dict[str, CpuSample] = {}
    pids = [p.popen.pid for p in procs]

    def reached() -> bool:
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited ({p.popen.returncode}) during v{v}; "
                    f"see {swarm.root / p.name}.log"
                )
            if p.name not in seen and (p.status() or {}).get("version") == v:
                # the clock read once the answer is in: a node's own hand-off time is never
                # later (read before the questions, a late answer in a pass was dated early)
                seen[p.name], cpu[p.name] = time.monotonic(), CpuSample.take(pids)
        return len(seen) == len(procs)

    return seen, cpu, reached


@dataclass(frozen=True)
class CpuSample:
    """The machine's CPU seconds so far over all its cores (busy, total), and how long the
    node processes have waited, runnable, for a core (their threads' run-queue delay).

    Every emulated host is a process on this machine, so the CPUs can set the pace instead of
    the links. Busy cores alone do not show it (work that could wait keeps them busy too);
    run-queue delay shows how long the nodes wanted a core and had none, an upper bound on
    what the CPUs took from the version (whether a wait delayed it depends on whether the
    waiting node was on its critical path: at 25 Mbit/s the nodes wait ~1.2 s of a 2.3 s
    version and still agree with the simulator within 20%). Linux counts guest time inside
    user time, so the guest fields are left out of the sum; run-queue delay is read from
    ``/proc/PID/task/*/schedstat`` (nan where the kernel does not keep it; a thread that
    ends between two samples takes its share with it)."""

    busy: float
    total: float
    waited: float

    @classmethod
    def take(cls, pids: list[int]) -> CpuSample:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = t.user + t.nice + t.system + t.idle
        total += sum(getattr(t, k, 0.0) for k in ("iowait", "irq", "softirq", "steal"))
        return cls(total - idle, total, sum(_run_queue_wait(pid) for pid in pids))

    def since(self, start: CpuSample, nodes: int) -> tuple[float, float]:
        """Share of the cores busy from ``start`` to this sample, and the mean seconds each
        of ``nodes`` node processes waited for a core meanwhile."""
        total = self.total - start.total
        busy = (self.busy - start.busy) / total if total > 0 else float("nan")
        return busy, (self.waited - start.waited) / nodes


def _run_queue_wait(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent runnable but waiting for a core."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        files = [t / "schedstat" for t in tasks.iterdir()]
    except OSError:
        return float("nan")
    waited = 0.0
    for f in files:
        try:
            waited += int(f.read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return waited


def _one_version(
    swarm: Swarm,
    topo: Topology,
    trainer: Proc,
    rollouts: list[Proc],
    v: int,
    weights: dict,
    cfg: EmulationConfig,
    relays: list[Proc],
) -> VersionResult:
    """Publish ``weights`` as version ``v``, time it until every rollout holds it."""
    up0, down0 = _counters([trainer], "bytes_uploaded")[0], _counters(rollouts, "bytes_downloaded")
    relayed0 = _relayed(relays)
    seen, cpu, reached = _arrivals(swarm, [trainer, *rollouts], v)
    t0 = time.monotonic()
    cut: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stop = threading.Event()
        if cfg.outage_s:
            outage = pool.submit(_outage, topo, seen, trainer.name, cfg, (stop, cut))
        try:
            swarm.publish(weights)
            wait_for(
                reached, cfg.version_timeout_s, f"every rollout to reach v{v}", step=cfg.poll_s
            )
        finally:
            stop.set()  # a run failing before the outage began: none begins
        procs = [trainer, *rollouts]  # from publication to the last one's hand-off:
        cpu_busy, cpu_wait = CpuSample.take([p.popen.pid for p in procs]).since(
            cpu[trainer.name], len(procs)
        )
        if cfg.outage_s:
            outage.result()  # its errors are the run's
    done = max(seen.values())
    payload = _payload_of(trainer, v)
    return VersionResult(
        version=v,
        payload=payload,
        end_to_end_s=done - t0,
        distribution_s=done - seen[trainer.name],
        lower_bound_s=lower_bound(topo, payload, cfg.first_rollout),
        trainer_up=_counters([trainer], "bytes_uploaded")[0] - up0,
        rollouts_down=sum(_counters(rollouts, "bytes_downloaded")) - sum(down0),
        relayed=_relayed(relays) - relayed0,
        steps=_steps(trainer, rollouts, v),
        outage=_outcome(seen, trainer.name, rollouts[-1].name, cut) if cut else None,
        cpu_busy=cpu_busy,
        cpu_wait_s=cpu_wait,
    )


def _outage(
    topo: Topology,
    seen: dict[str, float],
    trainer: str,
    cfg: EmulationConfig,
    stop_cut: tuple[threading.Event, list[float]],
) -> None:
    """Cut the last rollout off ``outage_after_s`` after the trainer showed the version
    (``seen``, polled by the caller), for ``outage_s``, noting both moments; none if
    ``stop`` is set first (the version ended or failed)."""
    stop, cut = stop_cut
    while trainer not in seen:
        if stop.wait(cfg.poll_s / 2):
            return
    if stop.wait(max(0.0, seen[trainer] + cfg.outage_after_s - time.monotonic())):
        return
    topo.cut_off(True)
    cut.append(time.monotonic())
    try:
        time.sleep(cfg.outage_s)
    finally:
        topo.cut_off(False)
        cut.append(time.monotonic())


def _outcome(seen: dict[str, float], trainer: str, last: str, cut: list[float]) -> Outage:
    """The outage's moments and who had the version when, after the trainer published."""
    t0 = seen[trainer]
    others = max((t for name, t in seen.items() if name not in (trainer, last)), default=t0)
    return Outage(cut[0] - t0, cut[1] - t0, seen[last] - t0, others - t0)


def run_in(topo: Topology, root: Path, cfg: EmulationConfig) -> EmulationResult:
    """The run itself, on a topology already built (the caller owns its cleanup): trainer on
    host 0, the bootstrap (if any) on host 1, a rollout on each other host; ``cfg``'s topology
    fields are not used here."""
    cfg.check()
    result = EmulationResult(cfg)
    if cfg.rate_probe_mb > 0:
        nbytes = int(cfg.rate_probe_mb * 1e6)
        result.link = measure_rate(topo, topo.hosts[0], topo.hosts[1], nbytes)  # both public
    versions = random_versions(cfg)
    debug = DCUTR_LOG if cfg.punch_wait_s else None
    swarm = Swarm(root, chunk_size=cfg.chunk_size, libp2p_debug=debug, private=cfg.private)
    try:
        trainer, rollouts = _start(swarm, topo, cfg)
        note = _await_verdicts([trainer, *rollouts], cfg) if cfg.bootstrap else None
        result.notes += [note] if note else []
        relays = [*swarm.procs]  # the bootstrap too: every public node may relay
        for v, weights in enumerate(versions):
            vr = _one_version(swarm, topo, trainer, rollouts, v, weights, cfg, relays)
            result.versions.append(vr)
            if cfg.punch_wait_s > 0 and result.punched_after is None and _punched(rollouts, cfg):
                result.punched_after = v
        want = state_hash(versions[-1]).hex()
        result.converged = all((p.status() or {}).get("state_hash") == want for p in rollouts)
        result.trainer = NodeReport.of(trainer, cfg.trainer_nat)
        result.tcp = (trainer.status() or {}).get("tcp")
        result.rollouts = [NodeReport.of(p, cfg.nat_of(i)) for i, p in enumerate(rollouts)]
        if cfg.punch_wait_s > 0 and result.punched_after is None:
            tries = ", ".join(f"{r.name} {r.hole_punches}" for r in result.rollouts)
            result.notes.append(
                f"no rollout punched a hole within {cfg.punch_wait_s:g} s (tries: {tries})"
                + "".join(f"\n  {r.name}: {line}" for r in rollouts for line in _dcutr_trail(r))
            )
    finally:
        swarm.stop()
    return result


def run(cfg: EmulationConfig, root: Path) -> EmulationResult:
    """Build the shaped topology, run the swarm in it, delete the topology whatever happens."""
    cfg.check()
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
    "relayed/F",
    "CPU busy",
    "CPU wait s",
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
        f"{r.relayed / r.payload:.2f}",
        f"{r.cpu_busy:.0%}",
        f"{r.cpu_wait_s:.2f}",
    )
    return "  ".join(f"{x:>12}" for x in cells)


def _setup(c: EmulationConfig) -> str:
    """The run's one-line description: who runs where, the links, the payload."""
    nated = sum(1 for i in range(c.rollouts) if c.nat_of(i))
    trainer = f"1 trainer{f' (behind NAT {c.trainer_nat})' if c.trainer_nat else ''}"
    who = f"{trainer}{' + 1 bootstrap' if c.bootstrap else ''} + {c.rollouts} rollouts"
    where = f" ({nated} behind {len(set(c.nat) - {0})} NATs)" if nated else ""
    chunk = f"{c.chunk_size // 1024} KiB" if c.chunk_size else "by payload"
    return (
        f"{c.hosts} hosts ({who}{where}) at {c.mbps:g} Mbit/s up and down, {c.delay_ms:g} ms "
        f"one-way delay, {c.payload_mb:g} MB payload, chunk {chunk}, "
        f"libp2p {'on' if c.bootstrap else 'off'}"
    )


def _mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def uploads(result: EmulationResult) -> list[str]:
    """Per rollout: public or behind which NAT, its verdict, what it uploaded; then the mean
    upload of NATed and of public rollouts and the trainer's upload over the payload."""
    head = ("rollout", "where", "verdict", "up MB", "HTTP MB", "channels MB", "streams MB")
    lines = ["  ".join(f"{h:>12}" for h in (*head, "down MB", "punched/tries"))]
    for r in [result.trainer] * bool(result.trainer and result.trainer.nat) + result.rollouts:
        cells = (r.name, f"NAT {r.nat}" if r.nat else "public", r.verdict or "-")
        http = r.uploaded - r.channel_uploaded - r.streams_uploaded  # behind NAT: its LAN's
        cells += (_mb(r.uploaded), _mb(http), _mb(r.channel_uploaded), _mb(r.streams_uploaded))
        cells += (_mb(r.downloaded), f"{r.hole_punched}/{r.hole_punches}")
        lines.append("  ".join(f"{x:>12}" for x in cells))
    nated, public = result.mean_upload(True), result.mean_upload(False)
    share = f" ({nated / public:.2f}x)" if nated is not None and public else ""
    ratio = result.trainer_upload_ratio
    lines.append(
        f"mean upload per rollout: NATed {_mb(nated)} MB, public {_mb(public)} MB{share}; "
        f"trainer upload / payload: {'-' if ratio is None else f'{ratio:.2f}'}"
    )
    return lines


def table(result: EmulationResult) -> str:
    """Plain-text report, one row per version, then the breakdown and the uploads."""
    lines = [_setup(result.cfg), *result.notes]
    if result.link is not None:
        s = result.link
        lines.append(
            f"link check: {s.goodput_mbps:.1f} Mbit/s TCP goodput = {s.wire_mbps:.1f} "
            f"Mbit/s on the wire (configured {s.configured_mbps:g})"
        )
    if result.tcp is not None:  # a host default of BBR never restarts idle connections
        restart = {True: "restart in slow start", False: "resume warm", None: "unknown"}
        lines.append(
            f"TCP: {result.tcp.get('congestion')} (idle connections "
            f"{restart[result.tcp.get('idle_restart')]})"
        )
    lines.append("  ".join(f"{h:>12}" for h in _HEAD))
    lines.extend(_row(r) for r in result.versions)
    lines.append("where the time went (median rollout, ms; last: the last rollout's hand-off)")
    names = [name for name, _, _ in STEPS] + ["last"]
    lines.append("  ".join(f"{h:>10}" for h in ["version", *names]))
    for r in result.versions:
        cells = [f"{r.steps[n] * 1000:.0f}" if n in r.steps else "-" for n in names]
        lines.append("  ".join(f"{x:>10}" for x in [f"v{r.version}", *cells]))
    for r in result.versions:
        if (o := r.outage) is not None:
            bound = r.lower_bound_s
            lines.append(
                f"v{r.version} outage: the last rollout cut off {o.cut_s:.2f}-{o.joined_s:.2f} s "
                f"after publish, had the version at {o.got_s:.2f} s ({o.got_s / bound:.2f}x the "
                f"bound); the other rollouts by {o.others_s:.2f} s ({o.others_s / bound:.2f}x)"
            )
    lines.extend(uploads(result) if result.rollouts else [])
    if result.delay_line is not None:
        lines.append(result.delay_line)
    lines.append(f"every rollout bit-exact with the trainer: {result.converged}")
    return "\n".join(lines)


def nat_layout(text: str) -> tuple[int, ...]:
    """``--nat 0,0,0,1,1,2,2,3``: each rollout's NAT group, in order (0: public)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of groups: {text!r}"
        ) from None


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = EmulationConfig()
    ap.add_argument("--hosts", type=int, help=f"all of them (default: {d.hosts}, or by --nat)")
    ap.add_argument("--mbps", type=float, default=d.mbps)
    ap.add_argument("--payload-mb", type=float, default=d.payload_mb)
    ap.add_argument("--versions", type=int, default=d.versions)
    ap.add_argument("--chunk-kb", type=int, default=0, help="0: the trainer's (by payload)")
    ap.add_argument("--delay-ms", type=float, default=d.delay_ms, help="one-way, between hosts")
    ap.add_argument("--rate-probe-mb", type=float, default=10.0, help="0: skip the link check")
    ap.add_argument("--bootstrap", action="store_true", help="a bootstrap host; libp2p on")
    ap.add_argument(
        "--nat",
        type=nat_layout,
        default=(),
        help="each rollout's NAT group, e.g. 0,0,0,1,1,2,2,3 (0: public); implies --bootstrap",
    )
    ap.add_argument(
        "--trainer-nat",
        type=int,
        default=0,
        help="the trainer's NAT group (0: public; k: behind router k); implies --bootstrap",
    )
    ap.add_argument(
        "--punch-wait",
        type=float,
        default=d.punch_wait_s,
        help="after each version until one is seen, wait up to this long for a hole punch",
    )
    ap.add_argument(
        "--tcp-congestion",
        default="",
        help="every node's TCP congestion control (--tcp-congestion; default: the host's)",
    )
    ap.add_argument(
        "--outage-s",
        type=float,
        default=d.outage_s,
        help="cut the last rollout off the network this long in every version (needs --delay-ms)",
    )
    ap.add_argument(
        "--outage-after-s",
        type=float,
        default=d.outage_after_s,
        help="seconds after the trainer published that the outage begins",
    )
    ap.add_argument("--private", action="store_true", help="a private swarm: members only")
    ap.add_argument("--keep", type=Path, help="keep node data and logs in this directory")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    bootstrap = args.bootstrap or bool(args.nat) or bool(args.trainer_nat)
    hosts = args.hosts or (1 + bootstrap + len(args.nat) if args.nat else EmulationConfig.hosts)
    cfg = EmulationConfig(
        hosts=hosts,
        mbps=args.mbps,
        payload_mb=args.payload_mb,
        versions=args.versions,
        chunk_size=args.chunk_kb * 1024,
        rate_probe_mb=args.rate_probe_mb,
        delay_ms=args.delay_ms,
        bootstrap=bootstrap,
        nat=args.nat,
        punch_wait_s=args.punch_wait,
        trainer_nat=args.trainer_nat,
        node_args=("--tcp-congestion", args.tcp_congestion) if args.tcp_congestion else (),
        outage_s=args.outage_s,
        outage_after_s=args.outage_after_s,
        private=args.private,
    )
    try:
        cfg.check()
    except ValueError as exc:
        print(f"emulated: error: {exc}", file=sys.stderr)
        return 2
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
