"""The data plane's bounds, on both sides: sizes, waits, connections (``[http]`` in a node's
configuration). Every transport (HTTP, libp2p streams, reverse channels, the in-memory network)
reads them from here, so a peer is held to the same limits whichever way it came."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of the data plane, on both sides."""

    max_concurrent_uploads: int = 16
    # a POST body, and what an announcement's packed manifests may unpack to (~70 bytes a
    # chunk: ~107 KB for the 1,536 chunks of a large payload)
    max_request_bytes: int = 256 * 1024
    max_json_bytes: int = 16 * 2**20
    max_chunk_bytes: int = 64 * 2**20
    # a request waits this long for an upload slot (then 503); a transfer that moves no byte
    # this long is cut, one that keeps moving is not (a large chunk on a slow, shared uplink)
    request_timeout_s: float = 10.0
    connect_timeout_s: float = 3.0
    max_upload_mbps: float = 0.0  # cap on chunk bytes served, Mbit/s (0: no cap)
    upload_queue: int = 64  # chunk requests waiting for an upload slot; more get a 503
    have_wait_s: float = 5.0  # longest hold of a long-polled have-map (< request_timeout_s)
    have_feed_s: float = 60.0  # longest a have feed stays open (then the follower reopens it)
    # chunks one announcement may carry behind its JSON (the trainer's first hand-out)
    max_push_bytes: int = 4 * 2**20
    # TCP congestion control for every socket the data plane opens or accepts ("": the host's
    # default). "bbr" resumes an idle connection at its measured rate, where Linux restarts
    # it in slow start otherwise (transport/tcp.py: fast, long paths need it)
    tcp_congestion: str = ""
    # inbound connections held at once, in all and from one address (an IPv6 /64); one
    # over either gets a 503 and is closed (``transport.connections``). The total never
    # exceeds half the process's descriptor limit (RLIMIT_NOFILE): the other half is the
    # node's own connections and files. A peer's client holds at most 100 connections to
    # one node (chunk requests, have feeds, announcements): one address's cap leaves it room
    max_connections: int = 4096
    max_connections_per_address: int = 256
    # a request header must be whole this long after its connection opened or its first
    # byte came (a slow-loris client sends one byte a while); a keep-alive connection with no
    # request in progress is closed after ``idle_timeout_s`` (more than the client's own
    # 15 s: the client closes first). A long poll, a have feed or a chunk in progress is a
    # request in progress, not idle
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    # a private swarm's client keeps an idle TLS connection this long, and its server one
    # ``idle_timeout_s`` longer (``server_idle_s``): longer than a training step, so a pair of
    # members pays TLS's handshake once, not every version (docs/private.md)
    tls_keepalive_s: float = 600.0

    def server_idle_s(self, tls: bool) -> float:
        """How long the server keeps a connection with no request in progress: the client
        closes first (its keep-alive is shorter), and then sends nothing into a closed one."""
        return self.tls_keepalive_s + self.idle_timeout_s if tls else self.idle_timeout_s

    @property
    def read_patience_s(self) -> float:
        """How long a requester waits for the next byte of a chunk: twice the server's wait
        for an upload slot, so the server's 503 for a slot not granted in time comes first."""
        return 2 * self.request_timeout_s
