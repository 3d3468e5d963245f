"""Node configuration: one tree of frozen dataclasses, and the checks a node makes of it.

The top level holds what an operator sets per node (role, addresses, keys, peers, files). Every
limit lives in a section, and each section is the very dataclass the code it bounds takes, so
nothing is copied field by field and no limit is a bare number in code:

==============  ===========================================  ================================
TOML table      dataclass                                    bounds
==============  ===========================================  ================================
``[publish]``   :class:`p2p_sync.protocol.versions.PublishPolicy`     the trainer's artifacts,
chunks,
                                                             coding, manifest lifetime, seeding
``[download]``  :class:`p2p_sync.protocol.swarmconfig.SwarmConfig`    one download: scheduler +
driver
                                                             (a simulation embeds it too)
``[http]``      :class:`p2p_sync.transport.limits.HttpLimits`     the data plane, both sides
``[directory]`` :class:`p2p_sync.protocol.peers.PeerLimits`           the peer table and polling
``[store]``     :class:`p2p_sync.store.StoreLimits`          disk budget (bytes, versions,
                                                             files), checkpoints
``[manifest]``  :class:`p2p_sync.trust.manifest.ManifestLimits`    manifests peers offer
``[announce]``  :class:`p2p_sync.trust.announce.AnnounceLimits`    announcements, gossip rate
``[libp2p]``    :class:`Libp2pLimits`                        the libp2p host
``[reachability]`` :class:`p2p_sync.protocol.reachability.ReachabilityLimits`  auto / public /
private,
                                                             dial-back questions and answers
``[relay]``     :class:`p2p_sync.protocol.reachability.RelayBounds`   circuit relay offered /
reserved
==============  ===========================================  ================================

Settings are read into it by :mod:`p2p_sync.runtime.configfile` (a TOML file, keyword
arguments, flags); :func:`check` refuses what cannot work. Errors name the field:
``config: peers: 'ftp://x': the scheme must be http, https or p2p ...``,
``config: download.max_requests_total: must be >= 1``; a setting from before the tree names
where it went.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from p2p_sync.errors import ConfigError, MalformedPeerUrlError
from p2p_sync.protocol.peers import PeerLimits, peer_name
from p2p_sync.protocol.reachability import MODES, ReachabilityLimits, RelayBounds
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.settings import check_numbers
from p2p_sync.store import StoreLimits
from p2p_sync.transport import tcp
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.trust.announce import AnnounceLimits
from p2p_sync.trust.manifest import ManifestLimits
from p2p_sync.trust.membership import MembershipLimits
from p2p_sync.trust.trusted import TrustLimits
from p2p_sync.weights.threads import usable_cores

__all__ = ["ConfigError", "Libp2pLimits", "NodeConfig", "check"]

ROLES = ("trainer", "rollout", "bootstrap")
MULTIADDR = re.compile(r"^(/[A-Za-z0-9.\-_:\[\]]+)+$")


@dataclass(frozen=True)
class Libp2pLimits:
    """Bounds of the libp2p host (the fields of ``transport.p2p.P2PSettings`` of that name)."""

    max_connections: int = 16
    max_rejects: int = 3  # rejected announcements before the sender is blacklisted
    refresh_s: float = 30.0  # Kademlia self-lookup period
    start_timeout_s: float = 30.0


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
    export: Path | None = None
    on_update: str | None = None
    device: str = "auto"
    # threads for per-tensor work (diff, coding, apply, restore); 0: one per usable core.
    # With weights on a GPU fewer can be faster: an H100's 7B format-1 apply took 1.5-1.8 s
    # with 4 and 2.1-2.4 s with 16 (the adds queue on the one device).
    workers: int = 0
    progress: bool = False
    p2p: bool = True  # False (--no-p2p): HTTP only, peers from --peers
    p2p_listen: str | None = None  # multiaddr; default: a free TCP port on the --listen host
    bootstrap: tuple[str, ...] = ()  # multiaddrs with /p2p/<peer-id>
    # a private swarm (``p2p_sync.trust.membership``): members only, the data plane over TLS
    private: bool = False
    swarm_ca: Path | None = None  # the swarm CA certificate (p2psync swarm init)
    admission: Path | None = None  # this node's admission (p2psync admit)
    revocations: Path | None = None  # the admin's signed revocation list
    publish: PublishPolicy = field(default_factory=PublishPolicy)
    download: SwarmConfig = field(default_factory=SwarmConfig)
    http: HttpLimits = field(default_factory=HttpLimits)
    directory: PeerLimits = field(default_factory=PeerLimits)
    store: StoreLimits = field(default_factory=StoreLimits)
    manifest: ManifestLimits = field(default_factory=ManifestLimits)
    announce: AnnounceLimits = field(default_factory=AnnounceLimits)
    libp2p: Libp2pLimits = field(default_factory=Libp2pLimits)
    reachability: ReachabilityLimits = field(default_factory=ReachabilityLimits)
    relay: RelayBounds = field(default_factory=RelayBounds)
    membership: MembershipLimits = field(default_factory=MembershipLimits)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)

    @property
    def threads(self) -> int:
        """Threads for per-tensor work: ``workers``, or one per usable core when 0."""
        return self.workers or usable_cores()

    @property
    def trust_limits(self) -> TrustLimits:
        return TrustLimits(manifest=self.manifest, announce=self.announce)


SECTIONS = {f.name for f in fields(NodeConfig) if f.default_factory is not MISSING}
_ZERO_OK = {
    "download.seed",
    "download.request_bytes",  # 0: one chunk a request
    "download.forward_seed_chunks",  # 0: pass nothing on unasked
    "publish.chunk_size",  # 0: picked from each payload's size
    "publish.seed_uploads",  # 0: download.max_sources
    "publish.push_chunks",  # 0: no chunk behind an announcement
    "http.max_upload_mbps",
    "manifest.clock_skew_s",
    "announce.clock_skew_s",
    "reachability.links",  # 0: serve peers over libp2p streams only, behind NAT
    "reachability.max_channels",  # 0: take no reverse channels
    "store.max_versions",  # 0: only what replay and newcomers need
}
# ---------------------------------------------------------------- checks


def _bad(name: str, why: str) -> ConfigError:
    return ConfigError(f"config: {name}: {why}")


def _check_numbers(cfg: NodeConfig) -> None:
    """Every numeric limit in a section is positive (counts >= 1), unless 0 means "none"."""
    for section in sorted(SECTIONS):
        zero_ok = frozenset(n.partition(".")[2] for n in _ZERO_OK if n.startswith(section + "."))
        try:
            check_numbers(section, getattr(cfg, section), zero_ok)
        except ValueError as exc:
            raise ConfigError(f"config: {exc}") from None


def _check_roles(cfg: NodeConfig) -> None:
    if cfg.role not in ROLES:
        raise _bad("role", f"{cfg.role!r} is not one of {', '.join(ROLES)}")
    if cfg.role == "trainer" and cfg.key is None:
        raise _bad("key", "a trainer needs --key (create one with p2psync keygen)")
    if cfg.role == "rollout" and not cfg.trust:
        raise _bad("trust", "a rollout needs --trust (the trainer's public key or .pub file)")
    if cfg.role == "bootstrap" and not cfg.p2p:
        raise _bad("p2p", "a bootstrap node is a libp2p node: drop --no-p2p")
    if cfg.role == "bootstrap" and not cfg.trust:
        raise _bad("trust", "a bootstrap needs --trust (to check announcements before relaying)")


def _check_addresses(cfg: NodeConfig) -> None:
    try:
        _, port = cfg.host_port
        if not 0 <= port < 65536:
            raise ValueError
    except ValueError:
        raise _bad("listen", f"{cfg.listen!r} is not HOST:PORT") from None
    for peer in cfg.peers:
        try:
            peer_name(peer)
        except MalformedPeerUrlError as exc:
            raise _bad(
                "peers", f"{exc} (http://host:port, https://host:port or p2p://<peer id>)"
            ) from None
    if cfg.reachability.mode not in MODES:
        mode = cfg.reachability.mode
        raise _bad("reachability.mode", f"{mode!r} is not one of {', '.join(MODES)}")
    for addr in cfg.bootstrap:
        if not MULTIADDR.match(addr) or "/p2p/" not in addr:
            raise _bad("bootstrap", f"{addr!r} is not a multiaddr ending in /p2p/<peer-id>")
    if cfg.p2p_listen is not None and not MULTIADDR.match(cfg.p2p_listen):
        raise _bad("p2p_listen", f"{cfg.p2p_listen!r} is not a multiaddr like /ip4/HOST/tcp/PORT")
    _check_congestion(cfg.http.tcp_congestion)


def _check_congestion(name: str) -> None:
    """A congestion control the kernel offers ("" or a host that does not say: not checked)."""
    offered = tcp.available()
    if name and offered is not None and name not in offered:
        have = " ".join(sorted(offered))
        raise _bad("http.tcp_congestion", f"{name!r} is not offered by this kernel ({have})")


def _check_private(cfg: NodeConfig) -> None:
    """A private node names its three membership files; an open one names none."""
    files = {"swarm_ca": cfg.swarm_ca, "admission": cfg.admission, "revocations": cfg.revocations}
    missing = [name for name, path in files.items() if path is None]
    if cfg.private and missing:
        raise _bad(
            "private",
            f"a private swarm needs {', '.join(missing)} (p2psync swarm init, p2psync admit)",
        )
    if not cfg.private and len(missing) < len(files):
        raise _bad("private", "membership files are given but private is not set")


def check(cfg: NodeConfig) -> None:
    """Raise ConfigError naming the first setting that cannot work."""
    _check_roles(cfg)
    _check_addresses(cfg)
    _check_numbers(cfg)
    _check_private(cfg)
    if cfg.workers < 0:
        raise _bad("workers", f"{cfg.workers} must be >= 0 (0: one thread per usable core)")
    if cfg.directory.max_unproven > cfg.directory.max_peers:
        raise _bad("directory.max_unproven", "must be <= directory.max_peers")
    if cfg.directory.retry_min_s > cfg.directory.retry_max_s:
        raise _bad("directory.retry_min_s", "must be <= directory.retry_max_s")
