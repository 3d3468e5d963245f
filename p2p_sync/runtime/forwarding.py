"""Chunks a seed handed this node, passed on unasked to peers following its have-map.

The trainer (a super-seed) hands each fresh chunk to one rollout first. Pulled from there, the
chunk's next hop costs three one-way latencies: the have-map news, the request, the bytes.
Pushed, it costs one. So a rollout that verified a chunk from a seed sends it at once to
``[download] forward_seed_chunks`` of the peers that follow its have-map for that payload (a
framed ``POST /announce`` naming the chunk in "pushing", the bytes behind the JSON: the
receiver's data plane takes it as it takes the trainer's chunks behind an announcement, checks
it against the signed manifest and bans a pusher whose bytes fail). Only chunks from a seed
are passed on, once, and only to peers reached over HTTP whose requests came from the host
their URL names (``DataRouter._have``): one forwarded chunk costs this node's uplink what a
request for it would, and the peers it goes to would pull it from someone anyway. Simulated
(1,000 peers, 100 MB, 1 Gbit/s, 20 ms): see ``simulations/README.md``.

Best effort and bounded: a chunk is passed on only while the node serves no more than
``forward_seed_chunks`` uploads (a busy uplink serves requests, which pull the chunk anyway;
pushes beside them slowed them: 32 rollouts on 100 Mbit/s with 1 MiB chunks sent 216 MB for
nothing instead of 154, simulated), and only if none of the other peers the download follows
claims it (``Download._rare_from_seed``: the seed hands some chunks out again, and those are
out in the swarm already); at most ``MAX_IN_FLIGHT`` pushes at once; a push that fails is
dropped (the peer pulls), and the peer is not tried again for that payload.
"""

from __future__ import annotations

import asyncio
import random

from p2p_sync.bounded import remember
from p2p_sync.errors import PeerError
from p2p_sync.runtime.ports import ForwardHost

MAX_IN_FLIGHT = 32  # forwarded chunks on their way at once
MAX_FAILED = 256  # (payload, peer) pairs a push failed for, remembered


class Forwarder:
    """One node's forwarded chunks."""

    def __init__(self, node: ForwardHost) -> None:
        self.node = node
        self.sent = 0  # chunks forwarded (pushes that were accepted)
        self.posts = 0  # pushes tried (sent, and those that failed)
        self.skipped = 0  # chunks not forwarded: the uplink busy, or too many pushes in flight
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: dict[tuple[str, str], None] = {}

    def forward(self, digest: str, index: int, data: bytes, source: str) -> None:
        """Push chunk ``index`` of ``digest`` (verified here) to some of its followers, unless
        this node serves more than ``forward_seed_chunks`` uploads now: its uplink is busy
        with requests, which the pushes would slow (and peers pull the chunk anyway)."""
        if self.node.transport.uploads_busy() > self.node.cfg.download.forward_seed_chunks:
            self.skipped += 1
            return
        for peer in self.targets(digest, source):
            if len(self._tasks) >= MAX_IN_FLIGHT:
                self.skipped += 1
                return
            self.node.view.pushing(digest, peer, index)  # before the news leaves: with it
            task = asyncio.create_task(self._push(peer, digest, index, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def targets(self, digest: str, source: str) -> list[str]:
        """Up to ``forward_seed_chunks`` peers following our have-map of ``digest``, drawn
        anew for each chunk: over HTTP, not ``source``, not banned, no push to them failed;
        none while this node names no HTTP URL of its own (none yet, or ``p2p://`` behind NAT:
        the receiver keeps a push only from the host its announcement names)."""
        node, count = self.node, self.node.cfg.download.forward_seed_chunks
        me = None if node.client is None else node.client.self_url
        if me is None or not me.startswith("http://"):
            return []  # unnamed, or named p2p:// (behind NAT): receivers keep no push of ours
        banned = node.peering.banned
        takers = [
            p
            for p in node.view.following(digest)
            if p.startswith("http://")
            and p not in (source, node.url)
            and p not in banned
            and (digest, p) not in self._failed
        ]
        return random.sample(takers, min(count, len(takers)))

    async def _push(self, peer: str, digest: str, index: int, data: bytes) -> None:
        assert self.node.client is not None
        pushing = {"pushing": [[digest, index, len(data)]]}
        self.posts += 1
        try:
            await self.node.client.announce(peer, [digest], pushing, [data])
        except PeerError:
            remember(self._failed, (digest, peer), None, MAX_FAILED)
            self.node.view.pushing(digest, peer, index, on=False)
            return
        self.sent += 1
        self.node.view.count_upload(len(data))

    def status(self) -> dict[str, int]:
        """``/status``'s "forwarded": chunks passed on, pushes that failed, and chunks not
        passed on (the uplink busy, or too many pushes in flight)."""
        return {"chunks": self.sent, "failed": self.posts - self.sent, "skipped": self.skipped}

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
