"""Chunks a peer pushes to us unasked: wait for them, and stop waiting once a push is overdue.

Pull costs a relay generation three one-way latencies (have-map news, request, last byte) plus
the uploader's queue; a parent that forwards each chunk as it arrives (a push tree, as
SplitStream stripes a stream over many trees) costs one. A download that was promised chunks by
a pusher (:class:`p2p_sync.protocol.swarm.PeerPushes`) must not also request them, or every chunk
would
cross its downlink twice; but a pusher can crash, lie, fall behind or never have the chunk, and
then waiting forever is worse than pulling. So :class:`PushWait` keeps, per expected chunk, who
pushes it, and gives up in two ways:

* **a stopped pusher**: someone (any peer) has claimed an expected chunk for ``patience`` and the
  pusher pushed nothing in that time. All its chunks are released (the scheduler emits
  :class:`p2p_sync.protocol.swarm.PushStopped`: the caller may subscribe elsewhere). A pusher that
  never
  gets the chunks is thus noticed once other peers have them, not after a fixed long timeout;
* **a lagging chunk**: the pusher itself claimed the chunk ``patience`` ago and has not pushed
  it (its uplink is shared by too many children): that chunk alone is released and pulled,
  from another holder when one is free (a pull request to the same crowded uplink would wait
  there too, and then cross it twice if the push follows).

``patience`` = ``factor`` x the pusher's typical gap between two pushes (an EWMA; the median of
the other pushers' before it has pushed twice), at least ``floor_s``: a live stream pushes
every few gaps, so a pusher silent for four of them is not one to wait for. Claims by a peer
that lies cost at most one early fall-back to pulling, never a wrong chunk (every chunk is
checked against the signed manifest whoever sends it).

Sans-I/O: times are passed in; the scheduler owns one instance per download.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class PushWait:
    """Expected pushes of one download. ``pusher``: chunk index -> the peer pushing it."""

    floor_s: float = 0.25
    factor: float = 4.0
    alpha: float = 0.3
    pusher: dict[int, str] = field(default_factory=dict)
    _claimed: dict[int, float] = field(default_factory=dict)  # by anyone: since when
    _pusher_claimed: dict[int, float] = field(default_factory=dict)  # by its pusher: since
    _last: dict[str, float] = field(default_factory=dict)  # last push (or the promise)
    _gap: dict[str, float] = field(default_factory=dict)  # EWMA of gaps between pushes
    _pushed: set[str] = field(default_factory=set)  # pushers that pushed at least once
    lagged: dict[int, str] = field(default_factory=dict)  # released for lag: ask others first

    def expect(self, peer: str, indices: Iterable[int], now: float) -> None:
        """``peer`` promised to push ``indices`` (the caller passes only missing chunks)."""
        for i in indices:
            self.pusher[i] = peer
        self._last.setdefault(peer, now)

    def claimed(self, peer: str, indices: Iterable[int], now: float) -> None:
        """``peer`` says it holds ``indices`` (a have-map, or part of one)."""
        if not self.pusher:
            return  # no push expected (the usual case: every have-map answer asks)
        for i in indices:
            owner = self.pusher.get(i)
            if owner is not None:
                self._claimed.setdefault(i, now)
                if owner == peer:
                    self._pusher_claimed.setdefault(i, now)

    def arrived(self, peer: str, index: int, now: float) -> None:
        """Chunk ``index`` was verified, from ``peer`` (pushed or not): nothing to wait for."""
        if not self.pusher and not self.lagged:
            return  # nothing expected (the usual case; ``_claimed`` keys are ``pusher``'s)
        if self.pusher.get(index) == peer:
            if peer in self._pushed:
                gap, old = now - self._last[peer], self._gap.get(peer)
                self._gap[peer] = gap if old is None else self.alpha * gap + (1 - self.alpha) * old
            self._pushed.add(peer)
            self._last[peer] = now
        self._forget(index)
        self.lagged.pop(index, None)

    def pushed_any(self, peer: str) -> bool:
        """Whether ``peer`` ever pushed us a chunk (a slow pusher, not a dead or lying one)."""
        return peer in self._pushed

    def drop(self, peer: str) -> bool:
        """Stop waiting for ``peer`` (it left, was banned, stopped); ``True`` if it owed us."""
        mine = [i for i, p in self.pusher.items() if p == peer]
        for i in mine:
            self._forget(i)
        return bool(mine)

    def deadlines(self) -> list[float]:
        """When something next becomes overdue (for the scheduler's ``next_timer``)."""
        if not self._claimed and not self._pusher_claimed:
            return []  # nothing expected is claimed (asked after every event: the usual case)
        return [*self._stopped_at().values(), *self._lagging_at().values()]

    def expire(self, now: float) -> list[str]:
        """Release what is overdue at ``now``; returns the pushers found stopped."""
        stopped = [peer for peer, t in self._stopped_at().items() if t <= now]
        for peer in stopped:
            self.drop(peer)
        for i, t in self._lagging_at().items():
            if t <= now:
                self.lagged[i] = self.pusher[i]
                self._forget(i)
        return stopped

    def _patience(self, peer: str) -> float:
        gap = self._gap.get(peer)
        if gap is None:
            gaps = sorted(self._gap.values())
            gap = gaps[len(gaps) // 2] if gaps else 0.0
        return max(self.floor_s, self.factor * gap)

    def _stopped_at(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, since in self._claimed.items():
            peer = self.pusher[i]
            t = max(since, self._last[peer]) + self._patience(peer)
            out[peer] = min(out.get(peer, t), t)
        return out

    def _lagging_at(self) -> dict[int, float]:
        return {i: t + self._patience(self.pusher[i]) for i, t in self._pusher_claimed.items()}

    def _forget(self, index: int) -> None:
        self.pusher.pop(index, None)
        self._claimed.pop(index, None)
        self._pusher_claimed.pop(index, None)
