"""A data-plane request and its answer as every transport hands them over, and the checks
that guard them.

Everything a peer sends is untrusted: path parameters are validated before use, request bodies
are capped (``max_request_bytes``), JSON is parsed within ``jsonbounds.JsonLimits`` (nesting,
digits of a number), and a malformed request is ``Refused`` with a 4xx without touching state:
413 for a body over its size limit, 422 for JSON past those bounds, 400 for the rest.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from p2p_sync import jsonbounds
from p2p_sync.errors import HostileJsonError, MalformedJsonError
from p2p_sync.protocol.peers import is_peer_name
from p2p_sync.transport.limits import HttpLimits

HEX64 = re.compile(r"^[0-9a-f]{64}$")
HEX32 = re.compile(r"^[0-9a-f]{32}$")
PEER_HEADER = "X-P2PSync-Peer"
JSON = "application/json"
FEED = "application/x-ndjson"  # a have feed: one JSON answer a line, each as news comes


PIECE = 256 * 1024  # a chunk body is written, and its reader timed, this much at a time
# the replies timed by progress: GET CHUNK_ROUTE + sha256, and CHUNKS_ROUTE + sha256... (a run)
CHUNK_ROUTE = "/chunk/"
CHUNKS_ROUTE = "/chunks/"
MAX_RUN = 64  # chunks one /chunks request may name


def chunk_path(path: str) -> bool:
    """Whether a request path (or URL) asks for chunks."""
    route = urlsplit(path).path
    return route.startswith(CHUNK_ROUTE) or route.startswith(CHUNKS_ROUTE)


def chunks_url(shas: list[str]) -> str:
    """The path asking for these chunks in one request (``/chunks``)."""
    return CHUNKS_ROUTE + "".join(shas)


class BodyReader(Protocol):
    """The rest of a request body, read as it arrives (aiohttp's ``StreamReader`` is one)."""

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes; ``asyncio.IncompleteReadError`` if the body ends first."""
        ...


class BytesReader:
    """A body already in memory as a :class:`BodyReader` (transports that carry whole
    bodies: the in-memory network, libp2p streams)."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = memoryview(data), 0

    async def readexactly(self, n: int) -> bytes:
        piece = bytes(self._data[self._at : self._at + n])
        self._at += len(piece)
        if len(piece) < n:
            raise asyncio.IncompleteReadError(piece, n)
        return piece


def same_host(url: str, remote: str | None) -> bool:
    """Does ``url`` point at ``remote``, the address a request came from?"""
    host = urlsplit(url).hostname
    if host is None or remote is None:
        return False
    try:
        return ipaddress.ip_address(host) == ipaddress.ip_address(remote)
    except ValueError:
        return host == remote  # names (the in-memory network): compared as they are


def valid_peer_url(url: str) -> bool:
    """Is ``url`` a peer's name (``peers.peer_name``: ``http(s)://host[:port]`` or
    ``p2p://<peer id>``, nothing more)?"""
    return is_peer_name(url)


@dataclass(frozen=True)
class Request:
    """One request, as any transport hands it over (``path`` already normalized)."""

    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    peer: str | None = None  # the X-P2PSync-Peer header: the requester's own URL, unproven
    body: bytes = b""
    remote: str | None = None  # the requester's address as the transport saw it
    outbound: bool = False  # it came over a connection this node opened (a libp2p stream)
    # a framed announcement's chunks, still arriving (``body`` is then the framing and the
    # JSON only: the aiohttp server reads the chunks as the router asks for them)
    rest: BodyReader | None = None

    @property
    def requester(self) -> str:
        """Who asks, for sharing upload slots fairly: the address the transport saw and the
        URL it claims (several peers share an address behind a NAT or on one machine). A
        claim is unproven, so many claims from one address get more of the line; they get
        no more slots than first come, first served gave anyone."""
        return f"{self.remote or '?'} {self.peer or '?'}"


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = JSON
    upload: bool = False  # chunk bytes: counted as uploaded once the transport sent them all
    # what follows ``body`` on the same response, as it comes (a have feed's later answers);
    # a transport that sends whole replies sends ``body`` alone, and the requester asks again
    feed: AsyncGenerator[bytes, None] | None = None


class Refused(Exception):
    """A request answered with an error status (inside the router only)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


def hex_arg(value: str, name: str) -> str:
    """A path parameter that must be a sha256 (64 lowercase hex digits), or a 400."""
    if not HEX64.match(value):
        raise Refused(400, f"{name} must be 64 lowercase hex digits")
    return value


def json_body(req: Request, limits: HttpLimits) -> dict[str, Any]:
    """A POST body: a JSON object within the request limit, or a 4xx."""
    return json_doc(req.body, limits)


def json_doc(body: bytes, limits: HttpLimits) -> dict[str, Any]:
    """A JSON object within the request limit, or a 4xx."""
    if len(body) > limits.max_request_bytes:
        raise Refused(413, "body over the request limit")
    doc = parsed_json(body, "body")
    if not isinstance(doc, dict):
        raise Refused(400, "body must be a JSON object")
    return doc


def parsed_json(text: bytes | bytearray, what: str) -> Any:
    """JSON from a request: a 422 if it nests too deep or holds too long a number (the
    parser's stack and CPU), a 400 if it is not JSON."""
    try:
        return jsonbounds.loads(text)
    except HostileJsonError as exc:
        raise Refused(422, f"{what}: {exc}") from None
    except MalformedJsonError:
        raise Refused(400, f"{what} must be JSON") from None
