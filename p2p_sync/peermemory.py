"""What a node's downloads measured of its peers, handed to its next download.

Why: a new :class:`p2p_sync.swarm.Scheduler` knows nothing of its sources until their first
replies. Until then it keeps ``initial_requests_per_peer`` requests at each (not its
bandwidth-delay product) and waits ``request_timeout_s`` (not a few typical chunk times)
before asking elsewhere. At internet latency that ramp costs round trips, and every version
of a running swarm pays it again: each is a new download from the same neighbours, as is a
download restarted after an outage or a restart of the node. What the last download measured
is the best first guess, and the scheduler goes on measuring from there (EWMAs), so a guess
gone stale fades within a few chunks. Simulated, 100 peers at 20 ms / 1 Gbit/s, the second
version: x1.279 of the bound against x1.289 (simulations/README.md, "Peer memory").

What is kept, per peer: its delivery rate and smallest round trip (neither depends on the
payload); and the typical chunk time of the last chunk size seen (time-outs). Not kept: failures
(a new download judges afresh; bans are the node's, ``node.peering``), have-maps (a new payload,
or news the feeds bring again). Sans-I/O and bounded: at most ``limit`` peers, the least
recently measured dropped first; :meth:`dumps` / :meth:`loads` carry it across restarts (the
node writes it to its data dir after each download). It is the node's own file, but a hint
only: one that does not parse is an error the node logs and forgets (a cold start), never a
reason not to start.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from p2p_sync.errors import PeerMemoryError
from p2p_sync.swarm import PeerStats, Scheduler, SwarmConfig

FORMAT = 1
MAX_URL = 512  # a peer name longer than this is not one this node wrote


@dataclass(frozen=True)
class Measured:
    """One peer's service as last measured: bytes/s delivered, smallest round trip (s)."""

    rate: float
    rtt: float | None


@dataclass
class PeerMemory:
    """The node's measurements of its peers, oldest first, at most ``limit`` of them."""

    limit: int = 256
    peers: dict[str, Measured] = field(default_factory=dict)
    chunk_bytes: int = 0  # the chunk size ``chunk_time`` was measured with (0: none)
    chunk_time: float | None = None

    def scheduler(
        self, n_chunks: int, config: SwarmConfig, have: Iterable[int], chunk_bytes: int
    ) -> Scheduler:
        """A scheduler for one payload that starts from what was measured."""
        known = {p: PeerStats(m.rate, rtt=m.rtt) for p, m in self.peers.items()}
        same = chunk_bytes > 0 and chunk_bytes == self.chunk_bytes
        ct = self.chunk_time if same else None
        return Scheduler(n_chunks, config, have, chunk_bytes, known=known, chunk_time=ct)

    def learn(self, sched: Scheduler) -> None:
        """Keep what ``sched`` measured (it finished, stalled, or the node is stopping); a
        peer it banned is forgotten."""
        for peer, st in sched.stats.items():
            now = Measured(st.throughput, st.rtt)
            if peer in sched.banned:
                self.peers.pop(peer, None)
            elif (st.throughput or st.rtt is not None) and now != self.peers.get(peer):
                self.peers.pop(peer, None)  # re-inserted: the most recently measured last
                self.peers[peer] = now
        while len(self.peers) > self.limit:
            del self.peers[next(iter(self.peers))]
        if sched.typical_chunk_time is not None and sched.chunk_bytes:
            self.chunk_bytes, self.chunk_time = sched.chunk_bytes, sched.typical_chunk_time

    def dumps(self) -> bytes:
        doc = {
            "format": FORMAT,
            "chunk_bytes": self.chunk_bytes,
            "chunk_time": self.chunk_time,
            "peers": [[p, m.rate, m.rtt] for p, m in self.peers.items()],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes, limit: int = 256) -> PeerMemory:
        """Parse what :meth:`dumps` wrote; anything else raises :class:`PeerMemoryError`."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PeerMemoryError(f"peer memory: not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise PeerMemoryError(f"peer memory: not format {FORMAT}")
        chunk_bytes, chunk_time = doc.get("chunk_bytes"), doc.get("chunk_time")
        if type(chunk_bytes) is not int or chunk_bytes < 0:
            raise PeerMemoryError(f"peer memory: chunk_bytes {chunk_bytes!r}")
        if chunk_time is not None and not _seconds(chunk_time):
            raise PeerMemoryError(f"peer memory: chunk_time {chunk_time!r}")
        rows = doc.get("peers")
        if not isinstance(rows, list):
            raise PeerMemoryError("peer memory: peers is not a list")
        memory = cls(limit, {}, chunk_bytes, chunk_time)
        for row in rows[-limit:] if limit else []:
            peer, measured = _row(row)
            memory.peers[peer] = measured
        return memory


def _seconds(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and x >= 0


def _row(row: Any) -> tuple[str, Measured]:
    """One ``[peer, rate, rtt]`` row, checked."""
    if not (isinstance(row, list) and len(row) == 3):
        raise PeerMemoryError(f"peer memory: row {row!r} is not [peer, rate, rtt]")
    peer, rate, rtt = row
    if not isinstance(peer, str) or not 0 < len(peer) <= MAX_URL:
        raise PeerMemoryError(f"peer memory: peer name {str(peer)[:60]!r}")
    if not _seconds(rate) or (rtt is not None and not _seconds(rtt)):
        raise PeerMemoryError(f"peer memory: {peer}: rate {rate!r}, rtt {rtt!r}")
    return peer, Measured(float(rate), None if rtt is None else float(rtt))
