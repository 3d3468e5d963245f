"""Reaching a peer behind NAT: requests that need it at once share one dial, so a burst of
chunk requests leaves one relayed connection, not one each (py-libp2p caps a peer at 8
connections, and a pair that had used them up refused its own hole punch)."""

from __future__ import annotations

from typing import Any

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2p_sync.transport.relay import RelayClient


def _peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


class _Conn:
    def get_transport_addresses(self) -> list[multiaddr.Multiaddr]:
        return [multiaddr.Multiaddr("/ip4/10.0.0.1/tcp/4001")]


class _Network:
    """A relay connected; the target reachable only through it, after a while."""

    def __init__(self, relay: ID) -> None:
        self.conns: dict[ID, list[_Conn]] = {relay: [_Conn()]}

    def get_connections(self, peer: ID) -> list[_Conn]:
        return self.conns.get(peer, [])

    async def dial_peer(self, peer: ID) -> None:
        raise OSError("behind NAT")


class _Host:
    def __init__(self, relay: ID) -> None:
        self.network, self.relay = _Network(relay), relay

    def get_network(self) -> _Network:
        return self.network

    def get_connected_peers(self) -> list[ID]:
        return [self.relay]


class _Circuits:
    """Counts circuit dials; each takes a moment, then the peer is connected."""

    def __init__(self, network: _Network, peer: ID) -> None:
        self.network, self.peer, self.dials = network, peer, 0

    async def dial(self, addr: Any) -> None:
        self.dials += 1
        await trio.sleep(0.05)
        self.network.conns.setdefault(self.peer, []).append(_Conn())


def _client(relay: ID, peer: ID) -> tuple[RelayClient, _Circuits]:
    client = RelayClient.__new__(RelayClient)  # no py-libp2p host: the dial logic alone
    host = _Host(relay)
    circuits = _Circuits(host.network, peer)
    client.host, client.wanted, client.transport = host, 2, circuits
    client.reserved, client.refused, client.active, client._dialing = set(), {}, True, {}
    return client, circuits


def test_requests_that_need_a_peer_at_once_share_one_relayed_dial() -> None:
    relay, peer = _peer(), _peer()
    client, circuits = _client(relay, peer)
    reached: list[bool] = []

    async def main() -> None:
        async def one() -> None:
            reached.append(await client.connect(peer, timeout=2.0))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(one)

    trio.run(main)
    assert reached == [True] * 10
    assert circuits.dials == 1
    assert len(client.host.get_network().get_connections(peer)) == 1
    assert client._dialing == {}  # nothing left waiting


def test_a_dial_that_fails_lets_the_next_request_dial_again() -> None:
    relay, peer = _peer(), _peer()
    client, circuits = _client(relay, peer)

    async def main() -> list[bool]:
        client.host.get_connected_peers = lambda: []  # no relay yet: nothing to dial through
        first = await client.connect(peer, timeout=0.5)
        client.host.get_connected_peers = lambda: [relay]
        return [first, await client.connect(peer, timeout=2.0)]

    assert trio.run(main) == [False, True]
    assert circuits.dials == 1
