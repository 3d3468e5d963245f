"""Circuit relay v2 for nodes behind NAT: public nodes forward, NATed nodes reserve (Trio side).

Why: two volunteers behind different NATs cannot dial each other, so without help neither
ever serves the other, and a swarm that is half NATed loses a quarter of its pairs. A public
node (one whose HTTP URL a peer could dial back, ``p2p_sync.protocol.reachability``; a bootstrap
node
usually is one) offers libp2p's standard circuit relay v2 (``/libp2p/circuit/relay/0.2.0``,
so any libp2p implementation can use it); a NATed node reserves a slot on up to
``[relay] reservations`` of the relays it is connected to (its bootstrap peers first); a peer
that cannot reach it directly tries the relays it is connected to itself, bootstrap peers
first (a relay holding no reservation for it refuses at once), and opens its data-plane
streams (``transport.streams``) over the circuit. Circuit addresses are not advertised:
py-libp2p 0.8.1 cuts every advertised address at its first ``/p2p/`` component, and a swarm's
NATed nodes and their peers share the same bootstrap relays anyway.

A relay only forwards bytes it cannot read (Noise runs end to end over the circuit) and is
bounded by the node's ``[relay]`` settings (``p2p_sync.protocol.reachability.RelayBounds``):
``max_reservations`` peers holding a slot, at most ``max_circuits`` circuits to each (so
``max_reservations * max_circuits`` in all), ``data_mb`` and ``duration_s`` per circuit, and
``mbps`` over all circuits
together (py-libp2p 0.8.1 has no bandwidth limit of its own: :class:`BoundedRelay` meters every
piece it forwards through one token bucket).

Hole punching: once two peers are connected through a relay, each tries to replace that with
a direct connection (libp2p's standard DCUtR, ``/libp2p/dcutr``, py-libp2p's implementation):
they swap their predicted public addresses (the NAT's address a peer observed, with their own
listen port: the dial leaves from the listen port, SO_REUSEPORT, and most home routers keep a
port), and dial each other at the same moment (TCP simultaneous open). It works behind NATs
that map endpoint-independently and keep ports, and fails, leaving the relay in place, behind
symmetric ones (carrier-grade NAT often is); :class:`HolePuncher` counts both. A punched
connection carries data-plane streams without the relay's hops and bandwidth cap.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

from p2p_sync.bounded import remember
from p2p_sync.protocol.ratelimit import TokenBucket
from p2p_sync.protocol.reachability import RelayBounds

log = logging.getLogger("p2psync.p2p")
CIRCUIT = "p2p-circuit"
REFUSED_S = 5.0  # a peer that refused a reservation is asked again after this long (it may
# start offering relay any moment: once a peer dialed it back)


class BoundedRelay(CircuitV2Protocol):
    """py-libp2p's relay, offered only while :attr:`offering`, with one bandwidth cap over
    every circuit it carries."""

    def __init__(self, host: Any, limits: RelayLimits, mbps: float) -> None:
        super().__init__(host, limits=limits, allow_hop=False)  # hop: see ``offer``
        rate = mbps * 1e6 / 8
        self.bucket = TokenBucket(rate, max(rate / 20, 64 * 1024))
        self.offering = False
        self.relayed_bytes = 0

    def offer(self, offering: bool) -> None:
        """Serve the hop protocol (others reserve and relay here) or stop; a NATed node
        relays nothing: nobody could reach it. Peers see the change at their next identify;
        until then a request to a node that stopped is refused at once."""
        if offering and not self.offering:
            self.host.set_stream_handler(HOP_PROTOCOL, self._handle_hop_stream)
        elif self.offering and not offering:
            self.host.remove_stream_handler(HOP_PROTOCOL)
        self.offering = offering

    async def _read_stream_with_retry(self, stream: Any, *args: Any, **kwargs: Any) -> Any:
        """Every piece the relay forwards passes here: wait for its tokens first."""
        data = await super()._read_stream_with_retry(stream, *args, **kwargs)
        if data:
            self.relayed_bytes += len(data)
            await trio.sleep(self.bucket.reserve(len(data), time.monotonic()))
        return data


RELAYED_GRACE_S = 3.0  # after a punch, the relayed connection lives on this long
REARM_S = 5.0  # a peer whose tries all failed gets fresh ones this long after (doubling)
REARM_ROUNDS = 4  # fresh rounds of tries per peer, then the relay stays for good
MAX_REARMED = 1024  # peers whose rounds (and whether they drive) are remembered
YIELD_S = 12.0  # the side that leaves the drive to its peer starts itself after this long
# without a session from it (py-libp2p's loop ticks every 2 s, and its first dial, straight
# to the peer's advertised addresses, can take the whole 5 s dial timeout)


def drives(own: ID, peer: ID) -> bool:
    """Whether this side of a relayed pair starts the DCUtR exchange: the one with the lower
    peer ID. The spec has one side drive; py-libp2p drives from both, every 2 s from the
    host's start, so two peers started together open two sessions at the same moment, each
    side dials twice from its one listen port to the same address, and the dials collide
    (seen in netns runs: a whole round lost). Once both sides' tries fail together, their
    fresh rounds start together too."""
    return own.to_bytes() < peer.to_bytes()


class HolePuncher(DCUtRProtocol):
    """py-libp2p's DCUtR, counting the hole punches this node tried while it had only a
    relayed connection to the peer, and the exchanges (its own or the peer's) that left a
    direct connection.

    py-libp2p tries a peer 3 times, 2 s apart, then never again while the relayed connection
    lasts. A try is a timed simultaneous open: on a loaded CPU all three can miss their moment
    as surely as behind a symmetric NAT (seen in CI: no punch within 30 s). So a peer whose
    tries ran out gets fresh ones ``REARM_S`` later, doubling, ``REARM_ROUNDS`` times (~75 s
    in all): a few dials more where the NAT defeats them, the relay's hops and cap left
    behind where only the timing did.

    Only one side of a pair drives (:func:`drives`); the other answers, and starts itself
    only if no session came from the peer within ``YIELD_S`` (a peer that never drives: the
    spec lets the side that dialed through the relay wait)."""

    def __init__(self, host: Any, dial_timeout_s: float) -> None:
        super().__init__(host, dial_timeout=int(max(dial_timeout_s, 1)))
        self.tried = self.punched = 0
        self._rounds: dict[ID, int] = {}  # fresh rounds of tries given to each peer
        self._rearming: set[ID] = set()
        self._drivers: dict[ID, bool] = {}  # peers that opened a DCUtR session to us
        self._yielded: dict[ID, float] = {}  # peers we left the drive to, since when

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        if direct_connection(self.host, peer_id) is not None:
            return True  # nothing to punch (py-libp2p says True here too)
        if self._leaves_it_to(peer_id):
            return False  # no try spent: py-libp2p's loop asks again in 2 s
        self.tried += 1
        ok = await super().initiate_hole_punch(peer_id)
        if ok and direct_connection(self.host, peer_id) is not None:
            self.punched += 1
            self._rounds.pop(peer_id, None)
            log.info("hole punched: direct connection to %s", peer_id)
            self._retire_relayed(peer_id)
        elif self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS:
            self._rearm(peer_id)
        return ok

    async def _handle_dcutr_stream(self, stream: Any) -> None:
        """The peer drives: answer (py-libp2p), and count a punch that left a direct
        connection where there was only a relayed one."""
        peer_id = stream.muxed_conn.peer_id
        remember(self._drivers, peer_id, True, MAX_REARMED)
        relayed_only = direct_connection(self.host, peer_id) is None
        await super()._handle_dcutr_stream(stream)
        if relayed_only and direct_connection(self.host, peer_id) is not None:
            self.punched += 1
            log.info("hole punched (answering): direct connection to %s", peer_id)
            self._retire_relayed(peer_id)

    def _leaves_it_to(self, peer_id: ID) -> bool:
        """Whether to wait for the peer to drive, as :func:`drives` and ``YIELD_S`` say."""
        if drives(self.host.get_id(), peer_id):
            return False
        if peer_id in self._drivers:
            return True
        if peer_id not in self._yielded:
            remember(self._yielded, peer_id, trio.current_time(), MAX_REARMED)
        return trio.current_time() - self._yielded[peer_id] < YIELD_S

    def _rearm(self, peer_id: ID) -> None:
        rounds = self._rounds.get(peer_id, 0)
        if rounds >= REARM_ROUNDS or peer_id in self._rearming or self._nursery is None:
            return
        remember(self._rounds, peer_id, rounds + 1, MAX_REARMED)
        self._rearming.add(peer_id)
        self._nursery.start_soon(self._fresh_tries, peer_id, REARM_S * 2**rounds)

    async def _fresh_tries(self, peer_id: ID, delay: float) -> None:
        """After ``delay``, py-libp2p's loop may try ``peer_id`` again (if still relayed)."""
        try:
            await trio.sleep(delay)
            self._hole_punch_attempts.pop(peer_id, None)
        finally:
            self._rearming.discard(peer_id)

    def _retire_relayed(self, peer_id: ID) -> None:
        """Close the relayed connections to ``peer_id`` once requests already on them had
        ``RELAYED_GRACE_S`` to finish (py-libp2p waits a minute, and its stream selection may
        keep opening streams on the relayed one meanwhile: the relay's hops and bandwidth cap
        would stay on the pair). Its own check that the direct connection still works
        comes first."""
        if self._nursery is not None:
            self._nursery.start_soon(
                self._close_relayed_conns_after_grace, peer_id, RELAYED_GRACE_S
            )


def direct_connection(host: Any, peer: ID) -> Any:
    """A live connection to ``peer`` that no relay carries, or None."""
    for conn in host.get_network().get_connections(peer):
        relayed = conn.get_connection_type() is ConnectionType.RELAYED
        if not relayed and not any(_is_circuit(a) for a in conn.get_transport_addresses()):
            return conn
    return None


def relay_limits(bounds: RelayBounds) -> RelayLimits:
    """Our bounds in py-libp2p's terms (the bandwidth cap is :class:`BoundedRelay`'s)."""
    return RelayLimits(
        duration=int(bounds.duration_s),
        data=int(bounds.data_mb * 2**20),
        max_circuit_conns=bounds.max_circuits,
        max_reservations=bounds.max_reservations,
    )


class RelayClient:
    """A NATed node's side: reservations on relays, and dials through them."""

    def __init__(self, host: Any, protocol: CircuitV2Protocol, wanted: int) -> None:
        roles = RelayRole.STOP | RelayRole.CLIENT
        self.host, self.wanted = host, wanted
        self.transport = CircuitV2Transport(host, protocol, RelayConfig(roles=roles))
        self.reserved: set[ID] = set()  # relays holding a slot for us
        self.refused: dict[ID, float] = {}  # peer -> when it refused a reservation
        self.active = False  # reserve only while behind NAT
        self._dialing: dict[ID, trio.Event] = {}  # peers being reached now: one dial each

    async def maintain(
        self, nursery: trio.Nursery, timeout: float, first: tuple[ID, ...] = ()
    ) -> None:
        """Drop reservations on relays we lost; reserve on connected relays (``first``
        first) up to ``wanted``."""
        connected = set(self.host.get_connected_peers())
        self.reserved &= connected if self.active else set()
        if not self.active:
            return
        now = trio.current_time()
        self.refused = {p: t for p, t in self.refused.items() if now - t < REFUSED_S}
        for peer in self._relays(first):
            if len(self.reserved) >= self.wanted:
                return
            if peer not in self.reserved and peer not in self.refused:
                with trio.move_on_after(timeout):
                    await self._reserve(peer, nursery)
                if peer not in self.reserved:
                    self.refused[peer] = now

    async def _reserve(self, relay: ID, nursery: trio.Nursery) -> None:
        try:
            stream = await self.host.new_stream(relay, [HOP_PROTOCOL])
            ok = await self.transport.reserve(stream, relay, nursery)
            await stream.close()
        except Exception as exc:  # refused, full, gone: try another relay next tick
            log.debug("relay reservation on %s: %s", relay, exc)
            return
        if ok:
            self.reserved.add(relay)

    async def connect(self, peer: ID, timeout: float, first: tuple[ID, ...] = ()) -> bool:
        """Reach ``peer`` when no connection exists: directly for a third of ``timeout`` (the
        same LAN, a forwarded port), then through each relay we are connected to (``first``
        first: the bootstrap peers, where NATed nodes reserve), until one carries the circuit
        (a relay without a reservation for ``peer`` refuses at once). True if connected.

        One dial per peer at a time: requests that need the peer while a dial is under way
        wait for it. Each used to dial its own circuit, and a version's burst of requests
        left a pair with 8 relayed connections, py-libp2p's cap per peer: the hole punch's
        direct connection was then refused by the node's own connection limits."""
        network = self.host.get_network()
        if network.get_connections(peer):
            return True
        pending = self._dialing.get(peer)
        if pending is not None:
            with trio.move_on_after(timeout):
                await pending.wait()
            return bool(network.get_connections(peer))
        done = self._dialing[peer] = trio.Event()
        try:
            return await self._dial(peer, timeout, first)
        finally:
            del self._dialing[peer]
            done.set()

    async def _dial(self, peer: ID, timeout: float, first: tuple[ID, ...]) -> bool:
        network = self.host.get_network()
        with trio.move_on_after(min(timeout / 3, 1.0)):
            try:
                await network.dial_peer(peer)
                return True
            except Exception as exc:
                log.debug("direct dial %s: %s", peer, exc)
        for relay in self._relays(first)[: 2 * self.wanted]:
            address = _direct_addr(self.host, relay)
            if address is None:
                continue
            circuit = multiaddr.Multiaddr(f"{address}/{CIRCUIT}/p2p/{peer}")
            with trio.move_on_after(timeout):
                try:
                    await self.transport.dial(circuit)
                    return True
                except Exception as exc:
                    log.debug("relayed dial %s: %s", circuit, exc)
        return bool(network.get_connections(peer))

    def _relays(self, first: tuple[ID, ...]) -> list[ID]:
        """Connected peers that may relay, ``first`` first. Which ones offer it is not known
        for sure (the protocols a peer listed at identify may have changed since, as a node
        offers relay only once a peer could dial it back); one that does not refuses at once."""
        return sorted(self.host.get_connected_peers(), key=lambda p: p not in first)


def _is_circuit(addr: multiaddr.Multiaddr) -> bool:
    return any(p.name == CIRCUIT for p in addr.protocols())


def _with_peer(addr: multiaddr.Multiaddr, peer: ID) -> multiaddr.Multiaddr:
    """``<relay>/p2p-circuit`` -> ``<relay>/p2p-circuit/p2p/<peer>`` (the dialable form)."""
    text = str(addr)
    return addr if text.endswith(f"/p2p/{peer}") else multiaddr.Multiaddr(f"{text}/p2p/{peer}")


def _direct_addr(host: Any, relay: ID) -> multiaddr.Multiaddr | None:
    """The relay's address as we dialed it (with ``/p2p/<id>``), for our circuit addresses."""
    for conn in host.get_network().get_connections(relay):
        try:
            addrs = conn.get_transport_addresses()
        except Exception:
            addrs = []
        for addr in addrs:
            if not _is_circuit(addr):
                return addr.encapsulate(multiaddr.Multiaddr(f"/p2p/{relay}"))
    for addr in host.get_peerstore().addrs(relay):
        if not _is_circuit(addr) and "/tcp/" in str(addr) and "/http" not in str(addr):
            return addr.encapsulate(multiaddr.Multiaddr(f"/p2p/{relay}"))
    return None
