"""libp2p control plane: identity, bootstrap, Kademlia discovery and gossipsub announcements.

py-libp2p 0.8.1 is Trio-native and the node is asyncio, so each node runs ONE libp2p host in a
dedicated thread under ``trio.run`` and talks to it through a small bridge (architecture guide,
section 3: ~110 us a call, asyncio loop lag unaffected). asyncio -> Trio: ``TrioToken.
run_sync_soon`` starts the call in the host's nursery; Trio -> asyncio: ``loop.
call_soon_threadsafe`` hands results and events back. Nothing else crosses the thread boundary.

Only standard libp2p protocols run on the host (TCP + Noise + yamux, identify, ping, Kademlia
``/ipfs/kad/1.0.0``, gossipsub ``/meshsub/1.x``), so other libp2p implementations can join the
control plane. Bulk chunk bytes never flow here (HTTP is 10x cheaper, see transport/http.py).

How a node finds the swarm and its data plane:

- It dials its ``--bootstrap`` multiaddrs, adds them to its Kademlia routing table and runs a
  self lookup; Kademlia answers carry standard *signed peer records* (libp2p envelopes, signed by
  each peer's libp2p identity key) which py-libp2p verifies before storing.
- Each node advertises its HTTP data-plane URL as an extra address of its own peer record,
  ``/ip4/<host>/tcp/<port>/http``. So the URL travels inside the record its libp2p identity
  signed, and an intermediary cannot point peers at someone else's server. Those addresses are
  never dialed as libp2p addresses (a dial filter drops them).
- It keeps at most ``max_connections`` libp2p connections, topping up from the routing table.
- It dials its bootstrap peers every ``maintain_s`` until linked (py-libp2p would refuse a peer
  for 60 s after one failed dial). The self lookup and the top-up run beside that tick, so the
  peers a bootstrap link brings are known (and asked for dial-backs) at once, not after a
  lookup that waits on a dead address.

Announcements are judged by ``p2p_sync.trust.announce.judge`` inside gossipsub's validation step, so
a forged or replayed message is never forwarded; its sender is blacklisted after
``max_rejects`` rejected messages. A private swarm's host admits members only, on every
connection and stream (``transport.p2p_gate``: gossip, DHT, records, data, relay, hole
punching). Its libp2p identity: ``transport.identity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from p2p_sync.errors import P2PError  # noqa: F401 (re-exported)
from p2p_sync.protocol.reachability import RelayBounds
from p2p_sync.transport import multiaddrs, relay, streams
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.gossip import GossipValidator, Judge, OnAccept, OnKnown
from p2p_sync.transport.identity import load_or_create_identity
from p2p_sync.transport.multiaddrs import http_multiaddr, rehost, url_from_multiaddr
from p2p_sync.transport.p2p_gate import MemberCredentials, MembershipGate

log = logging.getLogger("p2psync.p2p")


@dataclass(frozen=True)
class P2PSettings:
    """Everything the libp2p host needs; every limit lives here."""

    listen: str  # multiaddr, e.g. /ip4/127.0.0.1/tcp/0
    identity_path: Path
    topic: str
    http_url: str | None = None  # advertised in the signed peer record
    advertise_host: str | None = None  # the host others dial, when listening on 0.0.0.0 or NAT
    bootstrap: tuple[str, ...] = ()
    max_connections: int = 16
    max_rejects: int = 3  # rejected messages before a peer is blacklisted
    maintain_s: float = 1.0  # dial / harvest tick
    refresh_s: float = 30.0  # Kademlia self-lookup period
    dial_timeout_s: float = 5.0
    start_timeout_s: float = 30.0
    seen_digests: int = 4096  # bounded memory of accepted digests (for Ignore)
    dht: bool = True  # False: a leaf that runs no Kademlia and links only to its bootstrap peers
    relay: RelayBounds = field(default_factory=RelayBounds)  # circuit relay v2 (transport.relay)


# ---------------------------------------------------------------- host


class P2PHost:
    """One libp2p host in its own Trio thread; every public method is called from asyncio."""

    def __init__(
        self,
        settings: P2PSettings,
        judge: Judge,
        on_accept: OnAccept,
        on_peer_url: Callable[[str, bool], None],
        known: Callable[[str], bool] = lambda digest: False,
        on_known: OnKnown | None = None,
        member: MemberCredentials | None = None,  # a private swarm's: gate every peer
    ) -> None:
        s = self.settings = settings
        self.gate = GossipValidator(  # on_known: genuine news we already had, and when
            judge, on_accept, known, on_known, self._to_loop, s.max_rejects, s.seen_digests
        )
        self._on_peer_url, self.member = on_peer_url, member
        self.key_pair = load_or_create_identity(settings.identity_path)
        self.peer_id = str(ID.from_pubkey(self.key_pair.public_key))
        self.addr: str | None = None
        self._urls: dict[str, str] = {}  # peer id -> HTTP URL from its signed record
        self._data: streams.StreamServer | None = None  # answers /p2psync/data streams
        # advertised in the signed peer record when set; behind NAT: reserve relay slots
        self.http_url, self.behind_nat = settings.http_url, False
        self._tasks: set[asyncio.Future[Any]] = set()  # stream requests being answered here
        self.lookups = 0  # Kademlia self lookups run (one every ``refresh_s``)
        self._unreached: set[ID] = set()  # bootstrap peers whose last dial failed (logged once)
        self._snapshot: dict[str, int] = {"connected": 0, "routing_table": 0, "blacklisted": 0}
        self.connected_ids: list[str] = []  # peer ids connected now (snapshot, each tick)
        self._init_thread_state()

    def _init_thread_state(self) -> None:
        """The Trio thread, the handles that bridge to it and the libp2p objects living in it:
        none until :meth:`start` runs the thread."""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._host: Any = None
        self._pubsub: Any = None
        self._dht: Any = None
        self._relay: relay.BoundedRelay | None = None
        self._relay_client: relay.RelayClient | None = None
        self._puncher: relay.HolePuncher | None = None
        self._gate: MembershipGate | None = None  # a private swarm's (``transport.p2p_gate``)
        self.streams = streams.StreamPool()  # idle data streams to peers, for the next request

    # ------------------------------------------------------------ asyncio side

    async def start(self) -> str:
        """Start the host; returns its dialable multiaddr (with ``/p2p/<peer-id>``)."""
        self._loop = asyncio.get_running_loop()
        if not os.environ.get("LIBP2P_DEBUG"):  # py-libp2p's own logs, when asked for
            logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its failures reach us
        ready: asyncio.Future[str] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="libp2p", daemon=True)
        self._thread.start()
        try:
            self.addr = await asyncio.wait_for(ready, self.settings.start_timeout_s)
        except (TimeoutError, Exception) as exc:
            await self.stop()
            raise P2PError(f"libp2p did not start: {type(exc).__name__} {exc}") from None
        return self.addr

    async def stop(self) -> None:
        """Cancel everything in the Trio thread and join it (sockets closed, no thread left)."""
        if self._thread is None:
            return
        if self._token is not None and self._stop is not None:
            try:
                self._token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:
                pass
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join, self.settings.start_timeout_s)
        if thread.is_alive():
            log.warning("libp2p thread did not stop within %ss", self.settings.start_timeout_s)

    async def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``await fn(*args)`` in the Trio thread and return its result here (the bridge)."""
        loop, token, nursery = self._loop, self._token, self._nursery
        if loop is None or token is None or nursery is None:
            raise P2PError("libp2p is not running")
        future: asyncio.Future[Any] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        async def runner() -> None:
            try:
                result = await fn(*args)
            except Exception as exc:  # handed to the caller, not lost in the Trio thread
                loop.call_soon_threadsafe(settle, False, exc)
            else:
                loop.call_soon_threadsafe(settle, True, result)

        try:
            token.run_sync_soon(nursery.start_soon, runner)
        except trio.RunFinishedError:
            raise P2PError("libp2p has stopped") from None
        return await future

    async def with_host(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await fn(libp2p_host, *args)`` in the Trio thread (see :meth:`call`)."""
        return await self.call(fn, self._host, *args)

    def advertise(self, http_url: str | None, behind_nat: bool = False) -> None:
        """Put ``http_url`` in the signed peer record (None: none, the node is not reachable
        over HTTP; py-libp2p signs a new record when its addresses change). A node with a
        reachable URL offers relay service; one ``behind_nat`` reserves relay slots."""
        self.http_url, self.behind_nat = http_url, behind_nat
        if self._token is not None:  # the relay's handlers change in the Trio thread
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._apply_relay_role)

    def _apply_relay_role(self) -> None:
        if self._relay is not None and self._relay_client is not None:
            self._relay.offer(self.http_url is not None)
            self._relay_client.active = self.behind_nat

    @property
    def libp2p(self) -> Any:
        """The py-libp2p host (use it in the Trio thread only)."""
        return self._host

    async def reach(self, peer: ID, timeout: float) -> bool:
        """Trio side: a connection to ``peer``, directly or through one of our relays."""
        assert self._relay_client is not None
        return await self._relay_client.connect(peer, timeout, self._bootstrap_ids)

    def serve_data(self, router: DataRouter) -> None:
        """Answer data-plane requests on libp2p streams with ``router`` (until then, such
        streams are reset)."""
        self._data = streams.StreamServer(router, self)

    async def publish(self, data: bytes) -> None:
        await self.call(self._pubsub.publish, self.settings.topic, data)

    def status(self) -> dict[str, Any]:
        """Counters, plus a snapshot the Trio thread refreshes every maintenance tick (so this
        thread never iterates py-libp2p's structures while they change)."""
        return {
            "peer_id": self.peer_id,
            "addr": self.addr,
            **self._snapshot,
            "lookups": self.lookups,
            "http_peers": len(self._urls),
            "accepted": self.gate.counts["accept"],
            "rejected": self.gate.counts["reject"],
            "ignored": self.gate.counts["ignore"],
            "relay_offered": bool(self._relay and self._relay.offering),
            "relayed_bytes": self._relay.relayed_bytes if self._relay else 0,
            "relay_reservations": len(self._relay_client.reserved) if self._relay_client else 0,
            "hole_punches": self._puncher.tried if self._puncher else 0,
            "hole_punched": self._puncher.punched if self._puncher else 0,
            "streams_answered": self._data.answered if self._data else 0,
            "streams_bytes_uploaded": self._data.bytes_uploaded if self._data else 0,
            "membership": self._gate.status() if self._gate else None,
        }

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand a validation result to the node's asyncio loop (from the Trio thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    async def _in_loop(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Trio side: run ``await fn(*args)`` on the node's asyncio loop and wait for its
        result (the reverse of :meth:`call`); its errors end there, logged (result None)."""
        loop, token, done = self._loop, trio.lowlevel.current_trio_token(), trio.Event()
        assert loop is not None

        outcome: list[Any] = []

        def finished(task: asyncio.Future[Any]) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.debug("stream handler: %r", task.exception())
            elif not task.cancelled():
                outcome.append(task.result())
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        def start() -> None:
            task = asyncio.ensure_future(fn(*args))
            self._tasks.add(task)  # the loop holds tasks weakly: keep each until it ends
            task.add_done_callback(finished)

        loop.call_soon_threadsafe(start)
        await done.wait()
        return outcome[0] if outcome else None

    async def _on_data_stream(self, stream: Any) -> None:
        """Data-plane requests on a stream, one after another: read here, answered by the
        node's router; the stream ends when the requester closes it or leaves it idle."""
        server = self._data
        if server is None:
            await streams.reset(stream)
            return
        peer = str(stream.muxed_conn.peer_id)
        while True:
            try:
                req = await streams.next_request(stream, peer, server.router.limits)
            except Exception as exc:  # malformed, too big, too slow: nothing reaches the router
                log.debug("bad data stream: %r", exc)
                await streams.reset(stream)
                return
            if req is None:
                with contextlib.suppress(Exception):
                    await stream.close()
                return
            if not await self._in_loop(server.answer, stream, req):
                return  # not delivered: the stream was reset

    def _take_snapshot(self) -> None:
        connected = self._host.get_connected_peers()
        self.connected_ids = [str(p) for p in connected[: self.settings.max_connections * 2]]
        self._snapshot = {
            "connected": len(connected),
            "routing_table": self._dht.get_routing_table_size() if self._dht else 0,
            "blacklisted": len(self._pubsub.get_blacklisted_peers()),
            "mesh_peers": len(self._pubsub.router.mesh.get(self.settings.topic, ())),
        }

    # ------------------------------------------------------------ Trio side

    def _run(self, ready: asyncio.Future[str]) -> None:
        loop = self._loop
        assert loop is not None

        def fail(exc: BaseException) -> None:
            if not ready.done():
                ready.set_exception(P2PError(f"{type(exc).__name__}: {exc}"))

        try:
            trio.run(self._main, ready)
        except BaseException as exc:  # reported to start(); the thread ends cleanly
            loop.call_soon_threadsafe(fail, exc)
            log.debug("libp2p thread ended: %r", exc)
        finally:
            self._token = self._nursery = None

    def _new_host(self) -> Any:
        s = self.settings
        conn = ConnectionConfig(
            max_connections=s.max_connections * 2,
            high_watermark=s.max_connections * 2,
            low_watermark=s.max_connections,
            min_connections=1,
            max_connections_per_peer=1,
            dial_timeout=s.dial_timeout_s,
        )

        def advertised(addrs: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
            url = self.http_url
            extra = [multiaddr.Multiaddr(http_multiaddr(url))] if url else []
            return [*rehost(addrs, s.advertise_host), *extra]

        return new_host(key_pair=self.key_pair, addrs_factory=advertised, connection_config=conn)

    async def _main(self, ready: asyncio.Future[str]) -> None:
        host = self._host = self._new_host()
        if self.member is not None:  # first: every stream handler below is gated
            self._gate = MembershipGate(host, self.member).install()
        gossipsub = GossipSub(
            protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11, PROTOCOL_ID],
            degree=6,
            degree_low=4,
            degree_high=12,
            heartbeat_interval=1,
            heartbeat_initial_delay=0.1,
            do_px=False,
        )
        pubsub = self._pubsub = Pubsub(host, gossipsub)
        dht = self._dht = KadDHT(host, DHTMode.SERVER) if self.settings.dht else None
        multiaddrs.never_dial_http(host)
        host.set_stream_handler(streams.PROTOCOL, self._on_data_stream)
        self._start_relay(host)
        self._stop = trio.Event()
        try:
            await self._serve(host, pubsub, gossipsub, dht, ready)
        finally:
            pubsub.seen_messages.stop()  # py-libp2p's seen-cache sweeper is a real thread

    async def _serve(self, host: Any, pubsub: Any, gossipsub: Any, dht: Any, ready: Any) -> None:
        assert self._stop is not None and self._loop is not None
        async with (
            self._gate.running() if self._gate is not None else contextlib.nullcontext(),
            host.run(listen_addrs=[multiaddr.Multiaddr(self.settings.listen)]),
            background_trio_service(pubsub),
            background_trio_service(gossipsub),
            background_trio_service(dht) if dht is not None else contextlib.nullcontext(),
            background_trio_service(self._relay),
            background_trio_service(self._puncher),
            trio.open_nursery() as nursery,
        ):
            await pubsub.wait_until_ready()
            pubsub.set_topic_validator(self.settings.topic, self._validate, False)
            subscription = await pubsub.subscribe(self.settings.topic)
            self._token, self._nursery = trio.lowlevel.current_trio_token(), nursery
            nursery.start_soon(self._drain, subscription)
            nursery.start_soon(self._maintain)
            self._loop.call_soon_threadsafe(_resolve, ready, self._dialable(host))
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _start_relay(self, host: Any) -> None:
        """Circuit relay v2: offered once reachable, used once behind NAT (``advertise``)."""
        bounds = self.settings.relay
        self._relay = relay.BoundedRelay(host, relay.relay_limits(bounds), bounds.mbps)
        self._relay_client = relay.RelayClient(host, self._relay, bounds.reservations)
        self._puncher = relay.HolePuncher(host, self.settings.dial_timeout_s)
        self._apply_relay_role()

    def _dialable(self, host: Any) -> str:
        for addr in host.get_addrs():
            names = {p.name for p in addr.protocols()}
            if "tcp" in names and "http" not in names:
                return str(addr)
        raise P2PError("host has no dialable TCP address")

    async def _drain(self, subscription: Any) -> None:
        """Delivered messages were already handed over by the validator; keep the queue empty."""
        while True:
            await subscription.get()

    def _validate(self, forwarder: ID, msg: Any) -> bool:
        """Gossipsub validation hook: Accept forwards, anything else drops (Reject penalizes)."""
        if self._host is not None and forwarder == self._host.get_id():
            return True  # our own publication
        outcome = self.gate.validate(
            bytes(msg.data), str(forwarder), self._urls.get(str(forwarder))
        )
        if outcome.blacklist and self._pubsub is not None:
            if not self._pubsub.is_peer_blacklisted(forwarder):
                log.warning(
                    "blacklisted %s after %d rejected messages", forwarder, self.gate.max_rejects
                )
                self._pubsub.add_to_blacklist(forwarder)
                self._take_snapshot()
        return outcome.forward

    async def _maintain(self) -> None:
        """Keep joined: bootstrap dials, relay slots when behind NAT, periodic Kademlia
        refresh, bounded top-up, URL harvest. The refresh and the top-up dial peers that may
        be gone (each waits up to a dial timeout), so they run beside the tick, one of each at
        a time: what a tick harvests is never held up by a dead entry."""
        next_refresh = 0.0
        background: set[str] = set()  # steps running beside the tick
        while True:
            if self._gate is not None:
                self._gate.recheck()  # a revocation list changed: revoked members leave
            await self._dial_bootstrap()
            self._harvest_urls()  # what the links brought (the bootstrap's: at once)
            self._take_snapshot()
            assert self._relay_client is not None and self._nursery is not None
            await self._relay_client.maintain(
                self._nursery, self.settings.dial_timeout_s, self._bootstrap_ids
            )
            if self._dht is not None:
                await self._feed_routing_table()
                if trio.current_time() >= next_refresh and "refresh" not in background:
                    self._beside(background, "refresh", self._refresh)
                    next_refresh = trio.current_time() + self.settings.refresh_s
                if "top-up" not in background:
                    self._beside(background, "top-up", self._top_up)
            await trio.sleep(self.settings.maintain_s)

    def _beside(self, running: set[str], name: str, step: Callable[[], Awaitable[None]]) -> None:
        """Run ``step`` in the background, noted in ``running`` until it returns."""

        async def run() -> None:
            try:
                await step()
            finally:
                running.discard(name)

        assert self._nursery is not None
        running.add(name)
        self._nursery.start_soon(run)

    async def _refresh(self) -> None:
        """A Kademlia self lookup, bounded."""
        assert self._dht is not None
        with trio.move_on_after(self.settings.dial_timeout_s * 2):
            await self._dht.refresh_routing_table()
        self.lookups += 1

    @functools.cached_property
    def _bootstrap(self) -> list[Any]:
        """The ``--bootstrap`` peers (PeerInfo), parsed once."""
        return [info_from_p2p_addr(multiaddr.Multiaddr(a)) for a in self.settings.bootstrap]

    @property
    def _bootstrap_ids(self) -> tuple[ID, ...]:
        return tuple(info.peer_id for info in self._bootstrap)

    async def _dial_bootstrap(self) -> None:
        connected = set(self._host.get_connected_peers())
        for info in self._bootstrap:
            if info.peer_id in connected or not self._may_dial(info.peer_id):
                continue
            failure: str | None = f"no answer in {self.settings.dial_timeout_s:.0f} s"
            # py-libp2p refuses to dial a peer for 60 s after a failed dial (its negative
            # cache); a bootstrap peer is the node's way in, retried here every tick instead
            self._host.get_network().unblock_peer(info.peer_id)
            with trio.move_on_after(self.settings.dial_timeout_s):
                try:
                    await self._host.connect(info)
                    if self._dht is not None:
                        await self._dht.add_peer(info.peer_id)
                    failure = None
                except Exception as exc:  # unreachable for now: retried next tick
                    failure = _reason(exc)
            self._note_bootstrap(info.peer_id, failure)

    def _note_bootstrap(self, peer: ID, failure: str | None) -> None:
        """Say once when a bootstrap peer cannot be reached, and once when it can again: a
        node alone with no bootstrap link is the first thing an operator must hear about."""
        if failure is not None and peer not in self._unreached:
            self._unreached.add(peer)
            log.warning(
                "bootstrap %s unreachable (%s); retrying every %.0f s",
                peer,
                failure,
                self.settings.maintain_s,
            )
        elif failure is None and peer in self._unreached:
            self._unreached.discard(peer)
            log.info("bootstrap %s reached", peer)

    async def _feed_routing_table(self) -> None:
        """Peers that dialed us go into the routing table, so lookups can return them (in a
        private swarm, admitted ones only)."""
        peers = [p for p in self._host.get_connected_peers() if self._is_member(p)]
        for peer in peers[: self.settings.max_connections * 2]:
            try:
                await self._dht.add_peer(peer)
            except Exception as exc:
                log.debug("routing table add %s: %s", peer, exc)

    async def _top_up(self) -> None:
        """Dial known peers until ``max_connections`` are connected (a bounded set); the
        bootstrap peers are the tick's to dial."""
        host = self._host
        linked = host.get_connected_peers()
        skip, budget = {*linked, *self._bootstrap_ids}, self.settings.max_connections - len(linked)
        for peer in list(host.get_peerstore().peers_with_addrs()):
            if budget <= 0:
                return
            if peer in skip or not self._may_dial(peer):
                continue
            if all(url_from_multiaddr(str(a)) for a in host.get_peerstore().addrs(peer)):
                continue  # only a data-plane address: nothing libp2p can dial
            with trio.move_on_after(self.settings.dial_timeout_s):
                try:
                    await host.get_network().dial_peer(peer)
                    budget -= 1
                except Exception as exc:
                    log.debug("dial %s: %s", peer, exc)

    def _is_member(self, peer: ID) -> bool:
        """Every peer of an open swarm; a private swarm's admitted ones."""
        return self._gate is None or self._gate.is_member(peer)

    def _may_dial(self, peer: ID) -> bool:
        """Not ourselves, nor a peer blacklisted or refused membership."""
        gate, pubsub = self._gate, self._pubsub
        refused = pubsub.is_peer_blacklisted(peer) or (gate is not None and gate.is_refused(peer))
        return peer != self._host.get_id() and not refused

    def _harvest_urls(self) -> None:
        """HTTP URLs from signed peer records (verified by py-libp2p when they were consumed),
        each with whether its signer is one of the operator's ``--bootstrap`` peers (named by
        key in the node's config: as trusted as a ``--peers`` URL)."""
        store = self._host.get_peerstore()
        named = set(self._bootstrap_ids)
        for peer in store.peer_ids():
            envelope = store.get_peer_record(peer)
            if envelope is None or peer == self._host.get_id() or not self._is_member(peer):
                continue
            for addr in envelope.record().addrs:
                url = url_from_multiaddr(str(addr))
                if url is not None and self._urls.get(str(peer)) != url:
                    self._urls[str(peer)] = url
                    on = self._on_peer_url
                    self._loop.call_soon_threadsafe(on, url, peer in named)  # type: ignore[union-attr]


def _reason(exc: BaseException | None) -> str:
    """An error and what caused it (a dial's own exceptions sit under a generic one)."""
    parts: list[str] = []
    while exc is not None and len(parts) < 4:
        inner = getattr(exc, "exceptions", None)  # a MultiError or ExceptionGroup
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = inner[0] if inner else exc.__cause__
    return " <- ".join(parts)


def _resolve(future: asyncio.Future[str], value: str) -> None:
    if not future.done():
        future.set_result(value)
