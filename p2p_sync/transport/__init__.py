"""The only part of the library that touches sockets: the HTTP data plane (and later libp2p)."""
