"""Download one payload from many peers: the asyncio driver of the sans-I/O scheduler.

It turns :class:`p2p_sync.protocol.swarm.Scheduler` actions into requests on a :class:`ChunkSource`
and
their outcomes into scheduler events; it sleeps until the scheduler's own next deadline
(:meth:`~p2p_sync.protocol.swarm.Scheduler.next_timer`), never on a fixed tick. Every chunk is
verified
against the signed manifest before it reaches the :class:`ChunkSink` (and so before it is
relayed); bytes that fail the hash get the serving peer banned, by the scheduler's rule.

Where the bytes come from is the source's business: a peer's data plane
(:class:`DataPlaneSource`, over HTTP or the in-memory network of tests), libp2p streams or
relays tomorrow; the driver, the scheduler and the verification are the same for all of them.

Outcomes: :func:`download` returns once every chunk is in the sink, verified on re-read; it
raises :class:`~p2p_sync.errors.DownloadStalledError` when the scheduler reports that some
chunk was not delivered within ``stall_timeout_s`` by any peer claiming it, or has had no
reachable source for as long (the caller re-plans),
:class:`~p2p_sync.errors.StoreFullError` as soon as a verified chunk finds the disk full (the
chunks stored so far stay: the caller tries again once there is room, from where it stopped),
and :class:`~p2p_sync.errors.StoreError` when stored chunks keep failing their hash on disk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from p2p_sync.errors import (
    ChunkError,
    DownloadStalledError,
    PeerBusyError,
    PeerError,
    StoreError,
    StoreFullError,
)
from p2p_sync.protocol import sourcing
from p2p_sync.protocol.havelog import LOG_ID
from p2p_sync.protocol.schedule_events import (
    Action,
    CancelRequest,
    ChunkCorrupted,
    ChunkFailed,
    ChunkMoving,
    ChunkVerified,
    DownloadCompleted,
    DownloadStalled,
    Event,
    PeerBanned,
    PeerBusy,
    PeerHad,
    PeerLost,
    PeerPushes,
    RequestChunk,
    TimerFired,
)
from p2p_sync.protocol.swarm import Scheduler
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.transport.client import PeerClient
from p2p_sync.transport.messages import CHUNK_ROUTE, MAX_RUN, chunks_url
from p2p_sync.trust.chunks import verify_chunk
from p2p_sync.trust.manifest import Manifest

# events taken into one scheduling decision at most: those that queued up while the loop was
# busy (have-map news from many followers, mostly), each applied, then one decision for all
MAX_BATCH = 256
Timed = tuple[list[int], "HaveCursor", float | None]  # an answer, and the round trip it took


async def timed(
    feed: AsyncIterator[tuple[list[int], HaveCursor]], first: bool
) -> AsyncIterator[Timed]:
    """``feed``'s answers, the first timed as a round trip when it answers a first ask
    (``first``: answered at once; a later ask is held until there is news)."""
    asked = time.monotonic()
    async with aclosing(feed) as answers:
        async for have, after in answers:
            yield have, after, time.monotonic() - asked if first else None
            first = False


@dataclass(frozen=True)
class HaveCursor:
    """Where a follower of one peer's have-map stands: ``known`` entries of the peer's have
    log ``log`` (``p2p_sync.protocol.havelog``; None: whole lists), -1 before the first answer."""

    known: int = -1
    log: str | None = None
    # carried along, not a position: what the answer that led here said the peer pushes
    # us (its "pushed": forwarded chunks on their way, not to be requested)
    pushed: frozenset[int] = frozenset()

    def query(self) -> str:
        """``GET /have``'s query, a feed: answered at once on the first ask, else once there
        is news; then every later answer on the same response, as news comes."""
        if self.known < 0:
            return "?feed=1"
        return f"?known={self.known}" + (f"&log={self.log}" if self.log else "") + "&feed=1"


class ChunkSource(Protocol):
    """Where chunks come from. Errors: :class:`PeerBusyError` (no upload slot: try later),
    :class:`PeerError` (anything else); the driver verifies every byte it is given."""

    def peers(self) -> list[str]:
        """Peers worth asking now (the directory's usable ones)."""
        ...

    def usable(self, peer: str) -> bool:
        """Whether ``peer`` is still among :meth:`peers` (asked at every have-map answer: a
        lookup, not a sorted list)."""
        ...

    def owed(self, peer: str) -> bool:
        """Follow ``peer`` even beyond ``max_sources``, and ask it first (``PeerHad.owed``):
        it can upload to nobody but the peers that follow it (behind NAT, while this node is
        public)."""
        ...

    async def chunk(
        self, peer: str, m: Manifest, index: int, moved: Callable[[int], None] | None = None
    ) -> bytes:
        """Chunk ``index`` of ``m`` from ``peer``, at most one byte over its length; ``moved``
        is told how many of its bytes are in as they arrive, where the transport knows."""
        ...

    def chunks(self, peer: str, m: Manifest, indices: list[int]) -> AsyncIterator[bytes]:
        """Chunks ``indices`` of ``m`` from ``peer`` in one request, each as soon as its bytes
        are in, in that order; fewer if the peer stops early (it lacks the next one)."""
        ...

    def runs(self, peer: str) -> bool:
        """Whether several chunks go to ``peer`` in one request (else one request each)."""
        ...

    def have_feed(
        self, peer: str, m: Manifest, since: HaveCursor
    ) -> AsyncIterator[tuple[list[int], HaveCursor]]:
        """Chunks ``peer`` holds that ``since`` did not say (all of them first, on the first
        ask, ``since.known < 0``: at once; else once there is more), then each later batch
        as it comes, each with where the next question would start; ends whenever the peer
        ends it (the caller asks again from there)."""
        ...

    def pushed(self, peer: str, m: Manifest) -> tuple[list[int] | None, list[int]]:
        """The have-map ``peer`` pushed with its announcement of ``m`` (the trainer hands a
        follower its chunks that way), if any: the first answer, without asking; and the
        chunks of it sent behind the announcement (they come by :meth:`pushes`)."""
        ...

    def pushes(self, m: Manifest) -> AsyncIterator[tuple[str, int, bytes]]:
        """(peer, index, bytes) of every chunk of ``m`` pushed behind an announcement, as it
        comes, unverified, until the caller stops iterating."""
        ...

    def seed(self, peer: str) -> bool:
        """Whether ``peer`` is known to hand out chunks as a seed does (its announcement
        carried an offer); the driver also counts a peer whose have-map answers are offers
        (whole lists, no log) as one."""
        ...

    def early(self, peer: str, m: Manifest) -> AsyncIterator[Timed] | None:
        """A have feed of ``peer`` opened before ``m`` was here (the node heard of the version
        and asked its peers' have-maps while it fetched the manifest), if there is one: its
        answers so far, then each later one, as :meth:`have_feed` gives them, the first with
        the round trip it took (less the time ``peer`` held it: ``held_ms``); taken once."""
        ...


class ChunkSink(Protocol):
    """Where verified chunks go (the store)."""

    def have_indices(self, manifest: Manifest) -> list[int]: ...

    def put_chunk(self, data: bytes, digest: str | None = None) -> str:
        """Keep a verified chunk; :class:`StoreFullError` when the disk is full."""
        ...

    def verify_pack(self, m: Manifest) -> bool: ...


class DownloadListener(Protocol):
    """What the node learns from a download: who served verified bytes, who cheated, and
    the chunks a seed handed it, to pass on (``SwarmConfig.forward_seed_chunks``)."""

    def served(self, peer: str, nbytes: int) -> None: ...

    def misbehaved(self, peer: str, reason: str) -> None: ...

    def forward(self, index: int, data: bytes, source: str) -> None:
        """Chunk ``index`` (verified, stored) came from ``source``, a seed: push it unasked
        to some of the peers following us. Must not block: the driver's loop calls it."""
        ...


class DataPlaneSource:
    """A peer client (HTTP, or in memory) as a chunk source: ``GET /chunk/{sha}`` and
    ``GET /have/{digest}``."""

    def __init__(self, client: PeerClient, peers: Callable[[], list[str]]) -> None:
        self.client, self._peers = client, peers

    def peers(self) -> list[str]:
        return self._peers()

    def usable(self, peer: str) -> bool:
        return peer in self._peers()

    def owed(self, peer: str) -> bool:
        return False

    def pushed(self, peer: str, m: Manifest) -> tuple[list[int] | None, list[int]]:
        return None, []

    async def pushes(self, m: Manifest) -> AsyncIterator[tuple[str, int, bytes]]:
        return  # nothing is pushed to a bare client
        yield

    def early(self, peer: str, m: Manifest) -> AsyncIterator[Timed] | None:
        return None  # a bare client hears of nothing before it is given the manifest

    def seed(self, peer: str) -> bool:
        return False  # only its have-map answers tell

    async def chunk(
        self, peer: str, m: Manifest, index: int, moved: Callable[[int], None] | None = None
    ) -> bytes:
        # one byte over the expected length, so an oversized body is seen and punished
        return await self.client.get_bytes(
            f"{peer}{CHUNK_ROUTE}{m.chunks[index]}", m.chunk_length(index) + 1, moved
        )

    def chunks(self, peer: str, m: Manifest, indices: list[int]) -> AsyncIterator[bytes]:
        url = peer + chunks_url([m.chunks[i] for i in indices])
        return self.client.get_parts(url, [m.chunk_length(i) for i in indices])

    def runs(self, peer: str) -> bool:
        """Over HTTP only. A ``p2p://`` peer is reached over libp2p, often through a relay
        whose connection also times the hole punch (DCUtR measures its round trip there): a
        long reply queued on it skewed that timing, and the per-request cost that runs save
        is small next to libp2p's per-byte cost."""
        return not peer.startswith("p2p://")

    async def have_feed(
        self, peer: str, m: Manifest, since: HaveCursor
    ) -> AsyncIterator[tuple[list[int], HaveCursor]]:
        url = f"{peer}/have/{m.digest}{since.query()}"
        async with aclosing(self.client.get_feed(url)) as answers:
            async for res in answers:
                have, since = self.answer(peer, res, since)
                yield have, since

    @staticmethod
    def answer(peer: str, res: Any, since: HaveCursor) -> tuple[list[int], HaveCursor]:
        """One have-map answer, judged: its indices and where the next one starts."""
        if not (isinstance(res, dict) and isinstance(res.get("have"), list)):
            raise PeerError(f"{peer}: malformed have-map")
        have = [i for i in res["have"] if isinstance(i, int)]
        log, start = res.get("log"), res.get("from", 0)
        if log is None:  # a whole list (a seed's offer)
            return have, HaveCursor(len(have))
        if not (isinstance(log, str) and LOG_ID.match(log)) or start not in (0, since.known):
            raise PeerError(f"{peer}: malformed have-map (log {log!r} from {start!r})")
        pushed = res.get("pushed")
        listed = pushed if isinstance(pushed, list) else []
        promised = frozenset(i for i in listed if type(i) is int) & frozenset(have)
        return have, HaveCursor(start + len(have), log, promised)


class Download:
    """One payload in flight: a scheduler, its requests and one have-map follower per peer."""

    def __init__(
        self,
        m: Manifest,
        source: ChunkSource,
        sink: ChunkSink,
        listener: DownloadListener,
        config: SwarmConfig,
        unserved: Mapping[int, Collection[str]] | None = None,
    ) -> None:
        self.m, self.source, self.sink, self.listener = m, source, sink, listener
        self.config = config
        record = {i: set(peers) for i, peers in (unserved or {}).items()}
        self.sched = Scheduler(len(m.chunks), config, sink.have_indices(m), m.chunk_size, record)
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        # every request in flight, by (peer, chunk): a run of chunks asked at once shares a task
        self.requests: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.followers: dict[str, asyncio.Task[None]] = {}
        self.done = asyncio.Event()
        self.stalled: DownloadStalled | None = None
        self.full: StoreFullError | None = None  # the sink's disk is full: this download ends
        self.seeds: set[str] = set()  # peers whose have-map answers were offers
        self.forwarded: set[int] = set()  # chunks passed on (each once)

    async def _get(self, peer: str, index: int) -> None:
        try:
            data = await self.source.chunk(peer, self.m, index, self._meter(peer, index))
            verify_chunk(self.m, index, data)
        except PeerBusyError:
            return self.events.put_nowait(PeerBusy(peer, index))
        except PeerError:
            return self.events.put_nowait(ChunkFailed(peer, index))
        except ChunkError:
            return self.events.put_nowait(ChunkCorrupted(peer, index))
        self._stored(peer, index, data)

    def _meter(self, peer: str, index: int) -> Callable[[int], None]:
        """What a transfer of chunk ``index`` from ``peer`` tells as its bytes come in: one
        :class:`ChunkMoving` a quarter of ``stall_timeout_s`` at most (none for a transfer
        that ends sooner, as nearly all do), so a slow chunk that keeps moving is not taken
        for one that never comes."""
        loop = asyncio.get_running_loop()
        every = self.config.stall_timeout_s / 4
        due = loop.time() + every

        def moved(nbytes: int) -> None:
            nonlocal due
            now = loop.time()
            if now >= due:
                due = now + every
                self.events.put_nowait(ChunkMoving(peer, index, nbytes))

        return moved

    async def _get_run(self, peer: str, indices: list[int]) -> None:
        """Chunks ``indices`` from ``peer`` in one request, each verified, stored and
        reported as it arrives. One the scheduler cancelled meanwhile (timed out, or won
        elsewhere) is kept if still missing: its bytes are here anyway. A reply that stops
        early says the peer lacks the next chunk, nothing of those after it: they are asked
        again (at most once each: the run shrinks every time)."""
        task = asyncio.current_task()
        pending, got = indices, 0
        try:
            while pending:
                got = 0
                async for data in self.source.chunks(peer, self.m, pending):
                    index = pending[got]
                    got += 1
                    verify_chunk(self.m, index, data)
                    if self.requests.get((peer, index)) is task or index in self.sched.missing:
                        self._stored(peer, index, data)
                if got < len(pending):
                    self.events.put_nowait(ChunkFailed(peer, pending[got]))  # it lacks it
                    got += 1
                pending = [i for i in pending[got:] if self.requests.get((peer, i)) is task]
        except PeerBusyError:
            self._report(PeerBusy, peer, pending[got:])
        except PeerError:
            self._report(ChunkFailed, peer, pending[got:])
        except ChunkError:
            self.events.put_nowait(ChunkCorrupted(peer, pending[got - 1]))

    async def _take_pushes(self) -> None:
        """Chunks pushed behind an announcement: each verified (bytes failing the hash get
        the pusher banned, as from a request), stored and reported, once: also one the node
        stored already as it landed (``p2p_sync.runtime.learning``), so its bytes count as
        downloaded."""
        async for peer, index, data in self.source.pushes(self.m):
            if index >= len(self.m.chunks):
                continue
            try:
                verify_chunk(self.m, index, data)
            except ChunkError:
                self.events.put_nowait(ChunkCorrupted(peer, index))
                continue
            self._stored(peer, index, data)

    def _report(
        self, event: type[PeerBusy | ChunkFailed | ChunkCorrupted], peer: str, indices: list[int]
    ) -> None:
        for i in indices:
            self.events.put_nowait(event(peer, i))

    def _stored(self, peer: str, index: int, data: bytes) -> None:
        # inline: a 256 KiB page-cache write (~0.25 ms) beats a thread hop under a busy loop
        try:
            self.sink.put_chunk(data, self.m.chunks[index])
        except StoreFullError as exc:  # nowhere to keep it: end the download (``run``)
            self.full = self.full or exc
            self.done.set()
            self.events.put_nowait(TimerFired())  # wakes the loop, which sees ``done``
            return
        self.listener.served(peer, len(data))
        self.events.put_nowait(ChunkVerified(peer, index, len(data)))
        if self.config.forward_seed_chunks and self._rare_from_seed(peer, index):
            self.forwarded.add(index)
            self.listener.forward(index, data, peer)

    def _rare_from_seed(self, peer: str, index: int) -> bool:
        """Whether chunk ``index`` (verified, its event not handled yet) came from a seed and
        none of the other peers we follow claims it: a fresh hand-out, worth forwarding. A
        chunk the seed hands out again (a slow swarm gets many) is one peers here already
        hold; pushing those would be wasted uplink (16 rollouts with 10 Mbit/s uplinks, 2 MiB
        chunks: x6.2 of the bound, against x1.6 without forwarding)."""
        holders = self.sched.holders.get(index)  # None: not missing (a second copy)
        if holders is None or index in self.forwarded or holders - {peer}:
            return False
        return peer in self.seeds or self.source.seed(peer)

    async def _follow(self, peer: str) -> None:
        """Long-poll one peer's have-map: each answer comes as soon as it holds more."""
        since, failures, owed = HaveCursor(), 0, self.source.owed(peer)
        pushed, pushing = self.source.pushed(peer, self.m)
        if pushing:  # on their way behind the announcement: wait for them, do not ask
            self.events.put_nowait(PeerPushes(peer, frozenset(pushing)))
        if pushed is not None:  # no round trip measured: the chunk replies will measure it
            since = HaveCursor(len(pushed))
            self.events.put_nowait(PeerHad(peer, frozenset(pushed), None, owed))
        early = self.source.early(peer, self.m)
        if early is not None:  # asked while the manifest came: its answers, then ours
            try:
                got, _ = await self._consume(peer, early, owed)
                since = got or since
            except PeerError:
                pass  # asked again below, from where it left us
        while not self.done.is_set() and failures < self.config.have_failures:
            if not self.source.usable(peer):
                break
            try:
                since, answers = await self._feed(peer, since, owed)
            except PeerError:
                answers = 0
            if not answers:  # failed, or ended without an answer: back off, bounded
                failures += 1
                await asyncio.sleep(self.config.have_poll_s * failures)
                continue
            failures = 0
        self.events.put_nowait(PeerLost(peer))  # gone, dropped or silent: its claims lapse

    async def _feed(self, peer: str, since: HaveCursor, owed: bool) -> tuple[HaveCursor, int]:
        """Follow one have feed of ``peer`` until it ends, we are done or ``peer`` is no
        longer usable; where it left us, and how many answers it brought."""
        feed = timed(self.source.have_feed(peer, self.m, since), since.known < 0)
        got_since, answers = await self._consume(peer, feed, owed)
        return got_since or since, answers

    async def _consume(
        self, peer: str, feed: AsyncIterator[Timed], owed: bool
    ) -> tuple[HaveCursor | None, int]:
        """Turn one feed's answers into events until it ends, we are done or ``peer`` is no
        longer usable; where it left us (None: no answer), and how many answers it brought."""
        answers, since = 0, None
        async with aclosing(feed) as answers_in:
            async for have, after, rtt in answers_in:
                answers += 1
                since = after
                if after.log is None:  # a whole list: a seed's offer
                    self.seeds.add(peer)
                if after.pushed:  # on their way, forwarded: wait for them, do not ask
                    self.events.put_nowait(PeerPushes(peer, after.pushed))
                # what it held before stays claimed (PeerHad adds): only the news is sent
                self.events.put_nowait(PeerHad(peer, frozenset(have), rtt, owed))
                if self.done.is_set() or not self.source.usable(peer):
                    break
        return since, answers

    async def _watch_peers(self) -> None:
        """Follow up to ``max_sources`` usable peers, the source's preferred first, and every
        peer it is ``owed``; one lost (or no longer usable) makes room for the next (peers
        come and go during a download)."""
        while not self.done.is_set():
            usable = self.source.peers()
            live = {p for p, t in self.followers.items() if not t.done() and p in usable}
            for peer in usable:
                if not sourcing.takes(len(live), self.config.max_sources, self.source.owed(peer)):
                    continue
                if peer not in live:
                    self.followers[peer] = asyncio.create_task(self._follow(peer))
                    live.add(peer)
            await asyncio.sleep(self.config.have_poll_s)

    def _act(self, actions: list[Action]) -> None:
        runs: dict[str, list[int]] = {}  # a peer's chunks asked at once go in one request
        for a in actions:
            if isinstance(a, RequestChunk):
                runs.setdefault(a.peer, []).append(a.index)
            elif isinstance(a, CancelRequest):
                task = self.requests.pop((a.peer, a.index), None)
                if task is not None and task not in self.requests.values():
                    task.cancel()  # the last chunk it still carried
            elif isinstance(a, PeerBanned):
                self.listener.misbehaved(a.peer, a.reason)
            elif isinstance(a, DownloadStalled):
                self.stalled = a
                self.done.set()
            elif isinstance(a, DownloadCompleted):
                self.done.set()
        for peer, indices in runs.items():
            size = MAX_RUN if self.source.runs(peer) else 1  # what one request may name
            for at in range(0, len(indices), size):
                self._start(peer, indices[at : at + size])

    def _start(self, peer: str, indices: list[int]) -> None:
        if len(indices) == 1:
            task = asyncio.create_task(self._get(peer, indices[0]))
        else:
            task = asyncio.create_task(self._get_run(peer, indices))
        keys = [(peer, i) for i in indices]
        for key in keys:
            self.requests[key] = task

        def forget(_t: asyncio.Task[None]) -> None:
            for key in keys:
                if self.requests.get(key) is task:
                    del self.requests[key]

        task.add_done_callback(forget)

    async def _next_event(self, loop: asyncio.AbstractEventLoop) -> Event:
        """The next event, or a timer event at the scheduler's next deadline."""
        wake = self.sched.next_timer(loop.time())
        if wake is None:
            return await self.events.get()
        try:
            async with asyncio.timeout_at(wake):
                return await self.events.get()
        except TimeoutError:
            return TimerFired()

    async def run(self) -> None:
        """Drive the scheduler until it completes or stalls; always reaps every task."""
        loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(self._watch_peers())
        pushes = asyncio.create_task(self._take_pushes())
        try:
            self._act(self.sched.handle(TimerFired(), loop.time()))
            while not self.done.is_set():
                batch = [await self._next_event(loop)]
                while len(batch) < MAX_BATCH and not self.events.empty():
                    batch.append(self.events.get_nowait())  # queued while we were busy
                self._act(self.sched.handle_many(batch, loop.time()))
        finally:
            self.done.set()
            pending = [watcher, pushes, *self.requests.values(), *self.followers.values()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self.full is not None:
            raise self.full
        if self.stalled is not None:
            raise self._stalled_error(self.stalled)

    def _stalled_error(self, stall: DownloadStalled) -> DownloadStalledError:
        peers = {p for disowned in stall.disowned.values() for p in disowned}
        why = f"; {len(peers)} peer(s) claimed them and did not serve them" if peers else ""
        return DownloadStalledError(
            f"{self.m.digest[:16]} v{self.m.version}: {len(stall.indices)} chunk(s) with no "
            f"reachable source serving them for {self.config.stall_timeout_s:g} s{why}",
            self.m.digest,
            stall.indices,
            stall.disowned,
        )


async def download(
    m: Manifest,
    source: ChunkSource,
    sink: ChunkSink,
    listener: DownloadListener,
    config: SwarmConfig,
    unserved: Mapping[int, Collection[str]] | None = None,
) -> None:
    """Fetch every missing chunk of ``m`` into ``sink``; on return it is all there, verified.
    ``unserved``: peers whose claims of a chunk no longer count (an earlier download of ``m``
    stalled on it with them: :func:`p2p_sync.protocol.stalls.carry_unserved`)."""
    for _attempt in range(config.max_attempts):
        await Download(m, source, sink, listener, config, unserved).run()
        if await asyncio.to_thread(sink.verify_pack, m):
            return
        # a stored chunk vanished or rotted on disk: fetch what is missing again
    raise StoreError(
        f"{m.digest}: chunks stored for this payload keep failing "
        f"their hash on disk ({config.max_attempts} downloads)"
    )
