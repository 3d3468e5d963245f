"""What goes into the chunk scheduler (``protocol.swarm``) and what comes out: events, past
tense, that the node's download driver and the simulator feed it, and the actions they carry
out. Plain frozen records, so both sides build and read them the same way."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerHad:
    """``peer`` holds (at least) these chunks. ``rtt_s``: how long a request to it took to be
    answered when the answer came at once (the first have-map): a round-trip sample."""

    peer: str
    indices: frozenset[int]
    rtt_s: float | None = None
    owed: bool = False  # few can fetch from ``peer`` (behind NAT, we are public): ask it first


@dataclass(frozen=True)
class PeerPushes:
    """``peer`` will push us these chunks as it gets them, unasked (a push-tree parent)."""

    peer: str
    indices: frozenset[int]


@dataclass(frozen=True)
class PeerLost:
    peer: str


@dataclass(frozen=True)
class ChunkVerified:
    peer: str
    index: int
    nbytes: int


@dataclass(frozen=True)
class ChunkMoving:
    """``nbytes`` of chunk ``index`` have arrived so far on the request to ``peer`` (still in
    flight): a slow transfer that keeps moving is progress. Only bytes further into the chunk
    than any earlier request got count (a peer that sends half of it and falls silent, at
    every request, does not keep the chunk alive)."""

    peer: str
    index: int
    nbytes: int


@dataclass(frozen=True)
class ChunkCorrupted:
    peer: str
    index: int


@dataclass(frozen=True)
class ChunkFailed:
    peer: str
    index: int


@dataclass(frozen=True)
class PeerBusy:
    peer: str
    index: int


@dataclass(frozen=True)
class TimerFired:
    pass


Event = (
    PeerHad
    | PeerPushes
    | PeerLost
    | ChunkVerified
    | ChunkMoving
    | ChunkCorrupted
    | ChunkFailed
    | PeerBusy
    | TimerFired
)

# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class RequestChunk:
    peer: str
    index: int


@dataclass(frozen=True)
class CancelRequest:
    peer: str
    index: int


@dataclass(frozen=True)
class PeerBanned:
    peer: str
    reason: str


@dataclass(frozen=True)
class DownloadCompleted:
    pass


@dataclass(frozen=True)
class PushStopped:
    """``peer`` owed us pushed chunks and stopped pushing (or left, or was banned): they are
    requested like any other chunk now; the caller may ask another peer to push."""

    peer: str


@dataclass(frozen=True)
class DownloadStalled:
    """These missing chunks were not delivered within the stall limit of being asked for (or
    of their last progress), or have had no source while nothing moved for ``stall_timeout_s``.
    ``disowned``: the peers that lost standing for each of them with this stall (claimed it,
    or were asked for it, and did not deliver it); a chunk no peer had standing for is not
    named (see :func:`p2p_sync.protocol.stalls.carry_unserved`)."""

    indices: frozenset[int]
    disowned: dict[int, frozenset[str]] = field(default_factory=dict, compare=False)


Action = (
    RequestChunk | CancelRequest | PeerBanned | PushStopped | DownloadCompleted | DownloadStalled
)
