"""A private swarm's libp2p gate: members only, on every connection and every stream (Trio).

Each libp2p connection authenticates the remote peer id (Noise signs a fresh key with the
identity key: the per-connection challenge; a relayed connection is Noise end to end between
the two peers, so the relay sees ciphertext and has nothing to replay). Then each side shows
its admission on a stream of ``/p2psync/admission/1.0.0`` (the DER or PEM bytes, then EOF;
at most ``[membership] max_admission_bytes``), and the other judges it against that
authenticated peer id (``p2p_sync.trust.admitted``). Until a peer is admitted:

- every other stream it opens here waits (at most ``admission_timeout_s``) and is reset if it
  is not a member: no identify answer (it carries the signed record with the HTTP URL), no
  Kademlia answer, no gossip (gossipsub reads a peer's subscriptions and messages on the
  stream the peer opened, so a peer whose stream is reset gets nothing published either), no
  data-plane stream, no relay service (hop, stop), no hole punch;
- no stream other than the admission's is opened to it (identify, pubsub, Kademlia, relay
  reservations, data: ``host.new_stream`` waits for the verdict, then refuses): a member
  neither uses a non-member relay nor queries a non-member's DHT.

A peer that shows no valid admission within ``admission_timeout_s`` is disconnected and its
peer id refused for ``refused_s``: py-libp2p's muxer upgrade (right after Noise authenticated
the peer id) is refused for it, on direct, relayed and hole-punched connections alike, and
the host dials it no more meanwhile. :meth:`MembershipGate.recheck` (each maintenance tick)
adopts a changed revocation list and disconnects admitted peers revoked or expired since.
Multistream negotiation itself still answers a non-member (which protocol ids exist).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.transport.exceptions import MuxerUpgradeFailure

from p2p_sync.errors import MembershipError, NotAMemberError
from p2p_sync.transport.streams import reset
from p2p_sync.trust.admitted import PeerAdmissions
from p2p_sync.trust.membership import Membership

log = logging.getLogger("p2psync.p2p")
PROTOCOL = TProtocol("/p2psync/admission/1.0.0")


@dataclass(frozen=True)
class MemberCredentials:
    """What a private node's libp2p host needs: the swarm's membership, its own admission
    (the bytes it shows) and a call that adopts a changed revocation list file."""

    membership: Membership
    admission: bytes
    refresh: Callable[[float], None] = lambda now: None


class MembershipGate:
    """The gate on one py-libp2p host; :meth:`install` before the host runs."""

    def __init__(self, host: Any, credentials: MemberCredentials) -> None:
        self.host, self.credentials = host, credentials
        self.peers = PeerAdmissions(credentials.membership)
        self.limits = credentials.membership.limits
        self.admitted = 0  # admissions accepted
        self.refused: dict[str, int] = {}  # refusals by reason (error name); replaced whole
        self._waiting: dict[ID, trio.Event] = {}  # peers whose verdict someone awaits
        self._nursery: trio.Nursery | None = None
        self._new_stream = host.new_stream  # py-libp2p's, ungated

    def install(self) -> MembershipGate:
        """Hook the gate into the host: admission handler, inbound dispatch, outbound
        streams, the muxer upgrade and connection events."""
        host = self.host
        host.set_stream_handler(PROTOCOL, self._on_admission)
        negotiate = host.multiselect.negotiate

        async def gated_negotiate(communicator: Any, *args: Any) -> tuple[Any, Any]:
            protocol, handler = await negotiate(communicator, *args)
            if handler is None or protocol == PROTOCOL:
                return protocol, handler
            return protocol, self._guarded(handler)

        host.multiselect.negotiate = gated_negotiate
        host.new_stream = self._gated_new_stream
        self._gate_upgrades(host.get_network().upgrader)
        host.get_network().register_notifee(_Events(self))
        return self

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[MembershipGate]:
        """The nursery the exchanges run in (open before the host listens)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    def is_member(self, peer: ID) -> bool:
        """Whether ``peer`` is admitted now (False while its verdict is pending)."""
        try:
            return self.peers.member(str(peer), time.time()) is not None
        except MembershipError:
            return False

    def is_refused(self, peer: ID) -> bool:
        return self.peers.refused(str(peer), time.time()) is not None

    def status(self) -> dict[str, Any]:
        return {
            "members": len(self.peers.admitted()),
            "admitted": self.admitted,
            "refused": sum(self.refused.values()),
            "refused_by": self.refused,
        }

    def recheck(self) -> None:
        """Adopt a changed revocation list; disconnect members revoked or expired since."""
        now = time.time()
        self.credentials.refresh(now)
        for peer_id, why in self.peers.lapsed(now):
            self._refused_now(ID.from_base58(peer_id), why)

    # ------------------------------------------------------------ verdicts

    async def verdict(self, peer: ID) -> None:
        """Return once ``peer`` is admitted; the membership error if it is not a member
        (refused, or no admission within ``admission_timeout_s``)."""
        if self._pending(peer):
            event = self._waiting.setdefault(peer, trio.Event())
            with trio.move_on_after(self.limits.admission_timeout_s):
                await event.wait()
            if self._pending(peer):
                raise NotAMemberError(f"{peer} showed no admission in time")

    def _pending(self, peer: ID) -> bool:
        """True while ``peer`` has shown no admission; raises if it is refused (a refusal
        new now, its admission lapsed since, is counted and acted on)."""
        now = time.time()
        why = self.peers.refused(str(peer), now)
        if why is not None:
            raise why
        try:
            return self.peers.member(str(peer), now) is None
        except MembershipError as exc:
            self._refused_now(peer, exc)
            raise

    def _judge(self, peer: ID, admission: bytes) -> None:
        try:
            self.peers.judge(str(peer), admission, time.time())
        except MembershipError as exc:
            self._refused_now(peer, exc)
        else:
            self.admitted += 1
        self._wake(peer)

    def _refused_now(self, peer: ID, why: MembershipError) -> None:
        """Count and log a refusal, keep the peer out and disconnect it."""
        self.peers.refuse(str(peer), why, time.time())
        name = type(why).__name__
        self.refused = {**self.refused, name: self.refused.get(name, 0) + 1}
        log.warning("libp2p peer %s refused: %s (%s)", peer, name, why)
        self._wake(peer)
        if self._nursery is not None:
            self._nursery.start_soon(self._disconnect, peer)

    def _wake(self, peer: ID) -> None:
        event = self._waiting.pop(peer, None)
        if event is not None:
            event.set()

    async def _disconnect(self, peer: ID) -> None:
        with contextlib.suppress(Exception):
            await self.host.disconnect(peer)

    # ------------------------------------------------------------ the wire

    def _guarded(self, handler: Any) -> Any:
        """``handler`` for a member's streams only; anyone else's stream is reset."""

        async def guarded(stream: Any) -> None:
            try:
                await self.verdict(stream.muxed_conn.peer_id)
            except MembershipError:
                await reset(stream)
                return
            await handler(stream)

        return guarded

    async def _gated_new_stream(self, peer: ID, protocols: Any, *args: Any, **kw: Any) -> Any:
        """py-libp2p's ``new_stream``, to members only (the admission's own excepted)."""
        if PROTOCOL not in protocols:
            why = self.peers.refused(str(peer), time.time())
            if why is not None:
                raise why
            if not self.host.get_network().get_connections(peer):
                await self.host.get_network().dial_peer(peer)  # the exchange needs a link
            await self.verdict(peer)
        return await self._new_stream(peer, protocols, *args, **kw)

    async def _on_admission(self, stream: Any) -> None:
        """A peer shows its admission: bytes up to EOF, bounded in size and time."""
        peer, limit, data = stream.muxed_conn.peer_id, self.limits.max_admission_bytes, b""
        with trio.move_on_after(self.limits.admission_timeout_s):
            try:
                while len(data) <= limit and (piece := await stream.read(limit + 1 - len(data))):
                    data += piece
            except Exception as exc:  # reset, closed: judged on what came (likely nothing)
                log.debug("admission stream of %s: %r", peer, exc)
        await reset(stream)
        self._judge(peer, data)

    async def exchange(self, conn: Any) -> None:
        """On a new connection: show our admission, then await the peer's (not a member
        in time, or refused: disconnected by the verdict)."""
        peer = conn.muxed_conn.peer_id
        started = getattr(conn, "event_started", None)
        with trio.move_on_after(self.limits.admission_timeout_s):
            if started is not None:
                await started.wait()
            try:
                stream = await self._new_stream(peer, [PROTOCOL])
                await stream.write(self.credentials.admission)
                await stream.close()
            except Exception as exc:  # the peer left, or speaks no admission protocol
                log.debug("admission to %s not shown: %r", peer, exc)
        with contextlib.suppress(MembershipError):
            await self.verdict(peer)
            return
        network = self.host.get_network()
        if network.get_connections(peer) and not self.is_refused(peer):  # still here
            self._refused_now(peer, NotAMemberError(f"{peer} showed no admission in time"))

    def _gate_upgrades(self, upgrader: Any) -> None:
        """Refuse the muxer upgrade (right after Noise authenticated the peer id) to a
        refused peer id: no connection of any kind comes up with it."""
        upgrade = upgrader.upgrade_connection

        async def gated(secured: Any, peer: ID) -> Any:
            why = self.peers.refused(str(peer), time.time())
            if why is not None:
                await secured.close()
                raise MuxerUpgradeFailure(f"{peer} refused: {type(why).__name__}")
            return await upgrade(secured, peer)

        upgrader.upgrade_connection = gated


class _Events(INotifee):
    """Connection events: a new connection starts an admission exchange."""

    def __init__(self, gate: MembershipGate) -> None:
        self.gate = gate

    async def connected(self, network: Any, conn: Any) -> None:
        nursery = self.gate._nursery
        if nursery is not None:
            nursery.start_soon(self.gate.exchange, conn)

    async def disconnected(self, network: Any, conn: Any) -> None:
        return None

    async def opened_stream(self, network: Any, stream: Any) -> None:
        return None

    async def closed_stream(self, network: Any, stream: Any) -> None:
        return None

    async def listen(self, network: Any, multiaddr: Any) -> None:
        return None

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        return None
