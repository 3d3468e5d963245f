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
out in the swarm already); at most ``MAX_IN_FLIGHT`` chunks on their way at once; a push that
fails is dropped (the peer pulls), and the peer is not tried again for that payload.

One push at a time goes to a peer: chunks for a peer already being pushed to wait, and leave
together in the next ``POST`` (up to what one announcement may carry). Over HTTP/1.1 each push
in flight holds a connection of its own, and a private swarm pays a TLS handshake for each new
one: bursts of pushes opened ~40 connections a rollout on loopback, two thirds of all.
"""

from __future__ import annotations

import asyncio
import random

from p2p_sync.bounded import remember
from p2p_sync.errors import PeerError
from p2p_sync.runtime.ports import ForwardHost
from p2p_sync.transport.announcement import MAX_PUSHED

MAX_IN_FLIGHT = 32  # forwarded chunks on their way (or waiting for their peer) at once
MAX_FAILED = 256  # (payload, peer) pairs a push failed for, remembered

Chunk = tuple[str, int, bytes]  # (payload digest, index, bytes)


class Forwarder:
    """One node's forwarded chunks."""

    def __init__(self, node: ForwardHost) -> None:
        self.node = node
        self.sent = 0  # chunks forwarded (pushes that were accepted)
        self.posts = 0  # chunks tried (sent, and those that failed)
        self.skipped = 0  # chunks not forwarded: the uplink busy, or too many pushes in flight
        self.batches = 0  # POSTs sent (each carries one or more chunks)
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: dict[tuple[str, str], None] = {}
        self._waiting: dict[str, list[Chunk]] = {}  # peer -> chunks behind its push in flight
        self._in_flight = 0  # chunks on their way or waiting

    def forward(self, digest: str, index: int, data: bytes, source: str) -> None:
        """Push chunk ``index`` of ``digest`` (verified here) to some of its followers, unless
        this node serves more than ``forward_seed_chunks`` uploads now: its uplink is busy
        with requests, which the pushes would slow (and peers pull the chunk anyway)."""
        if self.node.transport.uploads_busy() > self.node.cfg.download.forward_seed_chunks:
            self.skipped += 1
            return
        for peer in self.targets(digest, source):
            if self._in_flight >= MAX_IN_FLIGHT:
                self.skipped += 1
                return
            self.node.view.pushing(digest, peer, index)  # before the news leaves: with it
            self._in_flight += 1
            if peer in self._waiting:  # a push to it is on its way: this one rides the next
                self._waiting[peer].append((digest, index, data))
                continue
            self._waiting[peer] = []
            task = asyncio.create_task(self._push_to(peer, [(digest, index, data)]))
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

    async def _push_to(self, peer: str, batch: list[Chunk]) -> None:
        """Push ``batch`` to ``peer``, then whatever waited for it meanwhile, until none is
        left (each POST within what one announcement may carry)."""
        try:
            while batch:
                await self._post(peer, batch)
                self._in_flight -= len(batch)
                batch = self._next_batch(peer)
        finally:
            self._in_flight -= len(batch) + len(self._waiting.pop(peer, []))

    def _next_batch(self, peer: str) -> list[Chunk]:
        """The chunks waiting for ``peer`` that one announcement carries (``MAX_PUSHED``,
        ``max_push_bytes``); the rest keep waiting."""
        waiting, room = self._waiting[peer], self.node.cfg.http.max_push_bytes
        batch: list[Chunk] = []
        while waiting and len(batch) < MAX_PUSHED and (not batch or len(waiting[0][2]) <= room):
            batch.append(waiting.pop(0))
            room -= len(batch[-1][2])
        return batch

    async def _post(self, peer: str, batch: list[Chunk]) -> None:
        """One framed announcement carrying ``batch``; a failure drops its chunks (the peer
        pulls them) and marks each of their payloads as failed for that peer."""
        assert self.node.client is not None
        digests = list(dict.fromkeys(d for d, _, _ in batch))
        pushing = {"pushing": [[d, i, len(data)] for d, i, data in batch]}
        self.posts += len(batch)
        self.batches += 1
        try:
            await self.node.client.announce(peer, digests, pushing, [c[2] for c in batch])
        except PeerError:
            for digest, index, _ in batch:
                remember(self._failed, (digest, peer), None, MAX_FAILED)
                self.node.view.pushing(digest, peer, index, on=False)
            return
        self.sent += len(batch)
        self.node.view.count_upload(sum(len(c[2]) for c in batch))

    def status(self) -> dict[str, int]:
        """``/status``'s "forwarded": chunks passed on, pushes that failed, chunks not passed
        on (the uplink busy, or too many pushes in flight) and the POSTs that carried them."""
        return {
            "chunks": self.sent,
            "failed": self.posts - self.sent,
            "skipped": self.skipped,
            "posts": self.batches,
        }

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
