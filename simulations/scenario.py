"""Simulation scenarios: one frozen dataclass holding every knob, loaded from TOML.

A scenario file names any subset of the fields below; the rest keep their defaults. Errors
name the field: ``scenario: peers: must be >= 1``. Links can be made uneven with ``[[links]]``
tables, each giving a ``fraction`` of the rollout peers their own ``uplink_mbps`` /
``downlink_mbps`` (the rest keep the scenario-wide values).

Churn: in every version, ``churn_fraction`` of the honest rollouts go offline at a uniform time
within the version's lower bound and come back ``churn_downtime`` (as a fraction of that bound)
later with their store intact; half of them crash silently (peers notice by time-outs), half
exit (connections reset, peers notice at once). Adversaries never fetch; all of them claim
every chunk: ``corrupt`` peers serve bytes that fail the hash, ``stall`` peers accept requests
and never answer, ``liar`` peers answer "not found".

NAT: ``nat_fraction`` of the rollouts (drawn with ``seed``) are behind NAT: nobody can dial
them. They dial out to public peers (the trainer is public), and a connection, once open,
carries requests both ways. Two NATed peers connect only if both are among the
``punch_fraction`` of them whose NATs hole punching gets through (endpoint-independent
mapping that keeps ports; a home router usually, carrier-grade NAT usually not): they met
through a relay in an earlier version and punched a hole (DCUtR), so the overlay has the
direct connection. Relayed traffic itself is not modelled. See ``swarm_sim.py``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.settings import check_numbers, from_table
from p2p_sync.trust.chunks import chunk_size_for
from simulations.errors import ScenarioError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class LinkClass:
    fraction: float
    uplink_mbps: float
    downlink_mbps: float


@dataclass(frozen=True)
class Scenario:
    name: str = "scenario"
    peers: int = 100  # rollout peers (the trainer comes on top)
    payload_mb: float = 100.0  # one 1-step patch (MB = 1e6 bytes)
    versions: int = 1
    uplink_mbps: float = 1000.0
    downlink_mbps: float = 1000.0
    trainer_uplink_mbps: float = 1000.0
    latency_ms: float = 10.0  # one way, between any two nodes
    # the simulator's time resolution for a node's decisions: have news and chunks reaching a
    # follower within one window are taken in one scheduling decision at its end
    # (simulations/swarm_sim.py). Wider runs faster and moves results (docs/simulation.md)
    decision_window_ms: float = 1.0
    # TCP restarts a connection idle for an RTO in slow start (Linux's default,
    # net.ipv4.tcp_slow_start_after_idle = 1; simulations/network.py); false: warm connections
    slow_start: bool = False
    # a private swarm (mutual TLS on the HTTP data plane): a pair's first HTTP message waits
    # one more round trip, the TLS 1.3 handshake (simulations/swarm_sim.py)
    private: bool = False
    # a private swarm's connections stay open between versions (the node's [http]
    # tls_keepalive_s, 10 min: longer than a training step), so pairs that followed each other
    # in earlier versions start a version handshaken; false: every pair handshakes again each
    # version (a step longer than the keep-alive, or a swarm's very first version)
    warm_connections: bool = True
    churn_fraction: float = 0.0
    churn_downtime: float = 0.25
    corrupt_fraction: float = 0.0
    stall_fraction: float = 0.0
    liar_fraction: float = 0.0
    nat_fraction: float = 0.0  # rollouts behind NAT: they dial out, nobody dials them
    punch_fraction: float = 0.0  # of the NATed ones: behind a NAT that hole punching gets through
    seed: int = 0
    chunk_kb: int = 0  # the trainer's chunk size; 0: its default, picked from the payload size
    max_peers: int = 64  # overlay: neighbours of every rollout (the node's peer-list bound)
    trainer_peers: int = 64  # neighbours the trainer serves
    max_concurrent_uploads: int = 16  # concurrent uploads per node (the data plane's limit)
    seed_uploads: int = 0  # the trainer's: its [publish] seed_uploads (0: download.max_sources)
    upload_queue: int = 64  # requests waiting for a slot; beyond it: busy (HTTP 503)
    seed_outstanding: int = 8  # super-seeding: hand-outs per requester at first (then grown)
    # chunks a follower's announcement carries behind its manifest: [publish] push_chunks
    push_chunks: int = PublishPolicy.push_chunks
    reseed_after_s: float = 2.0
    seed_quiet_factor: float = 2.0  # a quiet owner loses its hand-outs (0: never)
    download: SwarmConfig = field(default_factory=SwarmConfig)  # the node's [download] table
    time_limit_factor: float = 50.0  # give up on a version after this many lower bounds
    # a dissemination the node does not run yet, modelled to decide whether to build it:
    # SplitStream-like push trees over the pull mesh (simulations/pushtree.py)
    push_tree: bool = False
    links: tuple[LinkClass, ...] = field(default=())

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_kb * 1024 or chunk_size_for(self.payload_bytes)

    @property
    def decision_window_s(self) -> float:
        return self.decision_window_ms / 1000

    @property
    def payload_bytes(self) -> int:
        return int(self.payload_mb * 1e6)

    @property
    def trainer_uploads(self) -> int:
        """The trainer's upload slots, as ``p2p_sync.runtime.trainer.TrainerNode`` sets them."""
        return self.seed_uploads or self.download.max_sources

    def swarm_config(self, seed: int) -> SwarmConfig:
        """The scenario's download settings with one peer's tie-break seed."""
        return replace(self.download, seed=seed)


def _bad(name: str, why: str) -> ScenarioError:
    return ScenarioError(f"scenario: {name}: {why}")


_POSITIVE = (
    "payload_mb",
    "uplink_mbps",
    "downlink_mbps",
    "trainer_uplink_mbps",
    "time_limit_factor",
    "reseed_after_s",
    "decision_window_ms",
)
_AT_LEAST_ONE = (
    "peers",
    "versions",
    "max_peers",
    "trainer_peers",
    "max_concurrent_uploads",
    "upload_queue",
    "seed_outstanding",
)
_FRACTIONS = (
    "churn_fraction",
    "corrupt_fraction",
    "stall_fraction",
    "liar_fraction",
    "nat_fraction",
    "punch_fraction",
)


def check(s: Scenario) -> Scenario:
    for name in _POSITIVE:
        if not getattr(s, name) > 0:
            raise _bad(name, "must be positive")
    for name in _AT_LEAST_ONE:
        if getattr(s, name) < 1:
            raise _bad(name, "must be >= 1")
    for name in _FRACTIONS:
        if not 0 <= getattr(s, name) <= 1:
            raise _bad(name, "must be between 0 and 1")
    for name in (
        "latency_ms",
        "churn_downtime",
        "chunk_kb",
        "seed_quiet_factor",
        "seed_uploads",
        "push_chunks",
    ):
        if getattr(s, name) < 0:
            raise _bad(name, "must be >= 0")
    if s.corrupt_fraction + s.stall_fraction + s.liar_fraction >= 1:
        raise _bad("corrupt_fraction", "adversaries must leave at least one honest peer")
    if sum(c.fraction for c in s.links) > 1:
        raise _bad("links", "fractions add up to more than 1")
    if s.push_tree and s.nat_fraction > 0:
        raise _bad("push_tree", "push trees are not modelled behind NAT yet (nat_fraction > 0)")
    try:
        check_numbers(
            "download", s.download, frozenset({"seed", "request_bytes", "forward_seed_chunks"})
        )
    except ValueError as exc:
        raise ScenarioError(f"scenario: {exc}") from None
    return s


def _links(value: Any) -> tuple[LinkClass, ...]:
    if not isinstance(value, list):
        raise _bad("links", "must be an array of tables ([[links]])")
    out = []
    for i, item in enumerate(value):
        try:
            cls = LinkClass(**item)
            ok = 0 <= cls.fraction <= 1 and cls.uplink_mbps > 0 and cls.downlink_mbps > 0
        except TypeError:
            ok = False
        if not ok:
            raise _bad(f"links[{i}]", "needs fraction in [0, 1] and positive uplink/downlink_mbps")
        out.append(cls)
    return tuple(out)


def from_dict(values: dict[str, Any], name: str = "scenario") -> Scenario:
    known = {f.name: f for f in fields(Scenario)}
    for key in values:
        if key not in known:
            raise _bad(key, "unknown setting")
    kwargs: dict[str, Any] = {"name": name}
    for key, value in values.items():
        if key == "links":
            kwargs[key] = _links(value)
            continue
        if key == "download":
            try:
                kwargs[key] = from_table(key, SwarmConfig(), value)
            except ValueError as exc:
                raise ScenarioError(f"scenario: {exc}") from None
            continue
        default = getattr(Scenario(), key)
        wrong_kind = isinstance(default, bool) != isinstance(value, bool)
        if wrong_kind or not isinstance(value, (type(default), int)):
            raise _bad(key, f"expected {type(default).__name__}, got {value!r}")
        if isinstance(default, int) and not isinstance(value, int):
            raise _bad(key, f"expected int, got {value!r}")
        kwargs[key] = type(default)(value) if isinstance(default, float) else value
    return check(replace(Scenario(), **kwargs))


def load(path: Path, **overrides: Any) -> Scenario:
    """The scenario in the TOML file at ``path``, with non-None ``overrides`` on top."""
    try:
        values = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ScenarioError(f"scenario: cannot read {path} ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario: {path} is not valid TOML ({exc})") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    name = values.pop("name", Path(path).stem)
    return from_dict(values, name)
