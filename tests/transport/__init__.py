"""Tests of transports on real loopback sockets: HTTP data plane, TCP, libp2p, reverse channels,
LAN."""
