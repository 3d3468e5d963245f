"""Node configuration: one dataclass holding every setting, loaded from TOML, overridden by flags.

Errors name the field: ``config: peers: 'ftp://x' is not http://host:port``.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from p2p_sync.errors import ConfigError  # noqa: F401 (re-exported)
from p2p_sync.transport.http import valid_peer_url

ROLES = ("trainer", "rollout", "bootstrap")
MULTIADDR = re.compile(r"^(/[A-Za-z0-9.\-_:\[\]]+)+$")


@dataclass(frozen=True)
class NodeConfig:
    role: str = "rollout"
    data_dir: Path = Path("p2psync-data")
    listen: str = "127.0.0.1:0"
    advertise_host: str | None = None
    swarm: str = "default"
    key: Path | None = None
    trust: tuple[str, ...] = ()
    threshold: int = 1
    peers: tuple[str, ...] = ()
    watch: Path | None = None
    watch_interval_s: float = 0.02  # trainer: how often --watch looks for new files
    export: Path | None = None
    on_update: str | None = None
    device: str = "auto"
    chunk_size: int = 256 * 1024
    patch_format: int = 2  # trainer: 2 codes positions by the base's exponents (smaller), 1 is
    # faster to encode and decode on a CPU (see README: what a version costs)
    anchor_every: int = 10
    checkpoint_every: int = 10  # full weights written every N versions (else one log line each)
    catchup_spans: tuple[int, ...] = (4, 16)
    manifest_lifetime_s: int = 7 * 86400
    poll_interval_s: float = 1.0
    poll_fanout: int = 8  # peers asked per poll round (the --peers given, then random others)
    have_poll_s: float = 0.2
    max_peers: int = 64
    max_unproven_peers: int = 32  # of max_peers: slots for peers not yet proven by verified bytes
    peer_max_failures: int = 5  # failures in a row before a peer is dropped (until named again)
    store_max_gb: float = 4.0  # chunk packs kept on disk (the newest anchor and its chain stay)
    reseed_after_s: float = 2.0
    progress: bool = False
    max_upload_mbps: float = 0.0  # cap on chunk upload, Mbit/s (0: none)
    # Swarm knobs (p2p_sync.swarm / seeding / transport.http; `p2psync simulate` takes the same
    # names): defaults suit small swarms; configs/simulations/*.toml show large-swarm values.
    max_requests_per_peer: int = 8
    min_requests_per_peer: int = 2
    max_requests_total: int = 64
    min_request_timeout_s: float = 2.0  # adaptive request timeout floor (see p2p_sync.swarm)
    stall_timeout_s: float = 30.0  # a chunk no reachable peer holds for this long: re-plan
    max_concurrent_uploads: int = 16
    upload_queue: int = 64
    seed_outstanding: int = 8  # trainer: chunks handed to one requester at a time
    # libp2p control plane (transport/p2p.py): discovery and gossip announcements
    p2p: bool = True  # False (--no-p2p): HTTP only, peers from --peers
    p2p_listen: str | None = None  # multiaddr; default: a free TCP port on the --listen host
    bootstrap: tuple[str, ...] = ()  # multiaddrs with /p2p/<peer-id>
    p2p_max_connections: int = 16
    p2p_max_rejects: int = 3  # rejected announcements before the sender is blacklisted
    p2p_refresh_s: float = 30.0  # Kademlia self-lookup period
    p2p_start_timeout_s: float = 30.0
    announce_max_age_s: int = 600  # older announcements are rejected as replays
    announce_per_s: float = 2.0  # trainer's gossip rate (py-libp2p drops > 10 msg/s per peer)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)


_PATHS = {"data_dir", "key", "watch", "export"}
_TUPLES = {"trust", "peers", "catchup_spans", "bootstrap"}


def _coerce(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name in _PATHS:
        return Path(value)
    if name in _TUPLES:
        items = value.split(",") if isinstance(value, str) else list(value)
        items = [i.strip() if isinstance(i, str) else i for i in items]
        return (
            tuple(int(i) for i in items)
            if name == "catchup_spans"
            else tuple(i for i in items if i)
        )
    return value


def _check(cfg: NodeConfig) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"config: {name}: {why}")

    if cfg.role not in ROLES:
        raise bad("role", f"{cfg.role!r} is not one of {', '.join(ROLES)}")
    try:
        host, port = cfg.host_port
        if not 0 <= port < 65536:
            raise ValueError
    except ValueError:
        raise bad("listen", f"{cfg.listen!r} is not HOST:PORT") from None
    for peer in cfg.peers:
        if not valid_peer_url(peer):
            raise bad("peers", f"{peer!r} is not http://host:port")
    if cfg.role == "trainer" and cfg.key is None:
        raise bad("key", "a trainer needs --key (create one with p2psync keygen)")
    if cfg.role == "rollout" and not cfg.trust:
        raise bad("trust", "a rollout needs --trust (the trainer's public key or .pub file)")
    if cfg.patch_format not in (1, 2):
        raise bad("patch_format", "must be 1 or 2")
    if not 16 * 1024 <= cfg.chunk_size <= 64 * 2**20:
        raise bad("chunk_size", "must be between 16 KiB and 64 MiB")
    if cfg.anchor_every < 1 or any(s < 2 for s in cfg.catchup_spans):
        raise bad("anchor_every", "must be >= 1 (and catch-up spans >= 2)")
    for name in (
        "max_requests_per_peer",
        "min_requests_per_peer",
        "max_requests_total",
        "max_concurrent_uploads",
        "upload_queue",
        "seed_outstanding",
        "poll_fanout",
        "checkpoint_every",
        "max_peers",
        "max_unproven_peers",
        "peer_max_failures",
    ):
        if getattr(cfg, name) < 1:
            raise bad(name, "must be >= 1")
    if not cfg.store_max_gb > 0:
        raise bad("store_max_gb", "must be positive")
    if cfg.max_upload_mbps < 0:
        raise bad("max_upload_mbps", "must be >= 0 (0 means no cap)")
    for name in (
        "poll_interval_s",
        "have_poll_s",
        "watch_interval_s",
        "reseed_after_s",
        "min_request_timeout_s",
        "stall_timeout_s",
        "p2p_refresh_s",
        "p2p_start_timeout_s",
        "announce_per_s",
        "announce_max_age_s",
    ):
        if not getattr(cfg, name) > 0:
            raise bad(name, "must be positive")
    _check_p2p(cfg, bad)


def _check_p2p(cfg: NodeConfig, bad: Any) -> None:
    for addr in cfg.bootstrap:
        if not MULTIADDR.match(addr) or "/p2p/" not in addr:
            raise bad("bootstrap", f"{addr!r} is not a multiaddr ending in /p2p/<peer-id>")
    if cfg.p2p_listen is not None and not MULTIADDR.match(cfg.p2p_listen):
        raise bad("p2p_listen", f"{cfg.p2p_listen!r} is not a multiaddr like /ip4/HOST/tcp/PORT")
    if cfg.role == "bootstrap" and not cfg.p2p:
        raise bad("p2p", "a bootstrap node is a libp2p node: drop --no-p2p")
    if cfg.role == "bootstrap" and not cfg.trust:
        raise bad("trust", "a bootstrap needs --trust (to check announcements before relaying)")
    if cfg.p2p_max_connections < 1 or cfg.p2p_max_rejects < 1:
        raise bad("p2p_max_connections", "connection and reject limits must be >= 1")


def load(path: Path | None, overrides: dict[str, Any]) -> NodeConfig:
    """Settings from the TOML file at ``path`` (if any), then non-None ``overrides``."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"config: cannot read {path} ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: {path} is not valid TOML ({exc})") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(NodeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config: {unknown[0]}: unknown setting")
    cfg = NodeConfig()
    try:
        cfg = replace(cfg, **{k: _coerce(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config: bad value ({exc})") from None
    for f in fields(NodeConfig):
        value, default = getattr(cfg, f.name), getattr(NodeConfig(), f.name)
        if default is not None and not isinstance(value, type(default)):
            if not (isinstance(default, float) and isinstance(value, int)):
                raise ConfigError(f"config: {f.name}: expected {type(default).__name__}")
    _check(cfg)
    return cfg
