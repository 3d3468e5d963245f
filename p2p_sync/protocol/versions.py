"""Versions: what a trainer publishes per step, and the cheapest way for a peer to catch up.

Sans-I/O and clock-free: pure functions over small records, so the node and the simulator run
the same planning code.

Publishing (trainer side), per version v:

* the 1-step patch v-1 -> v (every v > 0);
* a full snapshot (anchor) when v % anchor_every == 0 (v0 is always one), so newcomers and peers
  too far behind start from it;
* merged catch-up patches v-s -> v for each span s in ``catchup_spans`` with v % s == 0. The
  bases are aligned, like a skip list: a peer at any version reaches the head in O(log gap)
  patches (1-step hops up to an aligned version, then ever longer spans).

Planning (peer side): a shortest path by total bytes (then by hops) over the announced artifacts,
from the local (version, state hash), or from nothing for a newcomer, to the head. A patch is an
edge only from the exact state it was made for (base version AND base state hash): a peer never
plans to apply a patch to weights it was not made for. Snapshots are edges from anywhere, but
only forward: a peer never goes back to an older version.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from p2p_sync.errors import BaseMismatchError, NoPathError

PATCH, SNAPSHOT = "patch", "snapshot"


@dataclass(frozen=True)
class PublishPolicy:
    """Everything the trainer decides when it publishes a version (``[publish]`` in a node's
    config): which artifacts besides the 1-step patch, how they are chunked and coded, how long
    their manifests live, and how its uploads are super-seeded."""

    anchor_every: int = 10
    catchup_spans: tuple[int, ...] = (4, 16)
    chunk_size: int = 0  # 0: picked from each payload's size (p2p_sync.trust.chunks.chunk_size_for)
    # 1 codes positions by gaps alone: no scan of the base, the shortest file -> hand-off on a
    # CPU node at 100 Mbit/s and 1 Gbit/s (0.95B on two cores: 4.2 s against 10-14 s for the
    # class-coded formats, whose 1.38x smaller patch saves 0.7 s at 100 Mbit/s); 2 codes them
    # by the base's exponent classes (zstd), 3 by class per segment with no zstd (the format a
    # GPU codes and applies; docs/performance.md)
    patch_format: int = 1
    lifetime_s: int = 7 * 86400  # manifests expire (and are re-signed) after this
    # super-seeding: chunks handed to one requester at a time at first (in a small swarm
    # doubled each time it fetched half, up to half a fair share: p2p_sync.protocol.seeding)
    seed_outstanding: int = 8
    reseed_after_s: float = 2.0  # a chunk handed out but not fetched is offered again after
    # a requester with no chunk request at the seed for this many times the 90th percentile of
    # live requesters' idle gaps loses what it was handed and did not fetch (0: only
    # reseed_after_s frees it; see p2p_sync.protocol.seeding)
    seed_quiet_factor: float = 2.0
    # uploads a trainer serves at once (its data plane's slots, for http.max_concurrent_uploads;
    # 0: download.max_sources). Its requesters share their downlinks among that many sources
    # each once they trade among themselves, so a seed serving fewer at once leaves an uplink
    # as fast as theirs partly idle, and the swarm waits on the seed (simulated, 1,000 peers at
    # 1 Gbit/s and 20 ms: 16 at once x1.57 the bound, the seed's uplink at 80-90% in the second
    # half; 32 at once x1.51; 64 spread each chunk over more, slower uploads)
    seed_uploads: int = 0
    # chunks of a follower's first hand-out sent right behind the announcement and its
    # manifest, on the same connection, at most (0: none): the trainer's uplink carries them
    # while the followers' first requests are on their way, idle otherwise for a round trip at
    # every version's start; as many in all as the measured round trip holds at the measured
    # upload rate, one per follower first (p2p_sync.protocol.seeding.chunks_behind;
    # docs/decisions/2026-11-27-chunks-behind-the-announcement.md)
    push_chunks: int = 2
    watch_interval_s: float = 0.02  # how often --watch looks for new weights files

    @property
    def based(self) -> bool:
        """Whether patches name positions by the base's exponent classes (formats 2 and 3)."""
        return self.patch_format in (2, 3)

    @property
    def segmented(self) -> bool:
        """Whether patches take format 3's segmented frames."""
        return self.patch_format == 3

    def __post_init__(self) -> None:
        if self.anchor_every < 1 or any(s < 2 for s in self.catchup_spans):
            raise ValueError("anchor_every must be >= 1 and catch-up spans >= 2")
        if self.push_chunks < 0:
            raise ValueError("push_chunks must be >= 0")
        if self.seed_quiet_factor < 0:
            raise ValueError("seed_quiet_factor must be >= 0")
        if self.patch_format not in (1, 2, 3):
            raise ValueError("patch_format must be 1, 2 or 3")
        if self.chunk_size and not 16 * 1024 <= self.chunk_size <= 64 * 2**20:
            raise ValueError("chunk_size must be 0 (by payload size) or 16 KiB to 64 MiB")


def to_publish(version: int, policy: PublishPolicy) -> list[tuple[str, int | None]]:
    """(kind, base_version) of every artifact to publish for ``version``."""
    out: list[tuple[str, int | None]] = []
    if version % policy.anchor_every == 0:
        out.append((SNAPSHOT, None))
    if version > 0:
        out.append((PATCH, version - 1))
    for span in sorted(set(policy.catchup_spans)):
        if version >= span and version % span == 0:
            out.append((PATCH, version - span))
    return out


@dataclass(frozen=True, order=True)
class Artifact:
    """What the planner needs to know of one announced artifact (from its verified manifest)."""

    version: int
    kind: str
    base_version: int | None
    base_state: str | None
    target_state: str
    size: int
    ident: str = field(default="", compare=False)


@dataclass(frozen=True)
class PeerState:
    """A peer's accepted weights: version and state hash (None, None for a newcomer)."""

    version: int | None = None
    state_hash: str | None = None

    def after(self, artifact: Artifact) -> PeerState:
        """The state after applying ``artifact``; refuses one made for another base."""
        if artifact.kind == PATCH and (
            artifact.base_version != self.version or artifact.base_state != self.state_hash
        ):
            raise BaseMismatchError(
                f"patch to v{artifact.version} needs base v{artifact.base_version}, "
                f"peer is at v{self.version}"
            )
        if self.version is not None and artifact.version <= self.version:
            raise BaseMismatchError(f"v{artifact.version} is not ahead of v{self.version}")
        return PeerState(artifact.version, artifact.target_state)


Node = tuple[int | None, str | None]


def _edges(node: Node, artifacts: list[Artifact]) -> Iterable[Artifact]:
    version, state = node
    for a in artifacts:
        if version is not None and a.version <= version:
            continue
        if a.kind == SNAPSHOT or (a.base_version == version and a.base_state == state):
            yield a


def plan(
    local: PeerState, artifacts: Iterable[Artifact], head: int | None = None
) -> list[Artifact]:
    """The cheapest (bytes, then hops) valid sequence of artifacts from ``local`` to ``head``.

    ``head`` defaults to the newest announced version. Returns [] if already there; raises
    NoPathError if no valid chain exists.
    """
    arts = sorted(set(artifacts))
    if head is None:
        head = max((a.version for a in arts), default=local.version)
    if local.version == head:
        return []
    path = _cheapest_path((local.version, local.state_hash), head, arts)
    if path is None:
        raise NoPathError(f"no announced chain leads from v{local.version} to v{head}")
    return path


def _cheapest_path(start: Node, head: int, arts: list[Artifact]) -> list[Artifact] | None:
    """Dijkstra from ``start`` to any state of version ``head``, cost (bytes, hops); equal
    costs leave the queue in push order, so the plan is deterministic. None: no chain."""
    queue: list[tuple[int, int, int, Node]] = [(0, 0, 0, start)]
    best: dict[Node, tuple[int, int]] = {start: (0, 0)}
    back: dict[Node, tuple[Node, Artifact]] = {}
    tie = 0
    while queue:
        cost, hops, _, node = heapq.heappop(queue)
        if best.get(node, (cost, hops)) < (cost, hops):
            continue
        if node[0] == head:
            return _path(back, node)
        for a in _edges(node, arts):
            nxt, key = (a.version, a.target_state), (cost + a.size, hops + 1)
            if key < best.get(nxt, (1 << 62, 0)):
                best[nxt], back[nxt] = key, (node, a)
                tie += 1
                heapq.heappush(queue, (*key, tie, nxt))
    return None


def _path(back: dict[Node, tuple[Node, Artifact]], node: Node) -> list[Artifact]:
    out = []
    while node in back:
        node, artifact = back[node][0], back[node][1]
        out.append(artifact)
    return out[::-1]
