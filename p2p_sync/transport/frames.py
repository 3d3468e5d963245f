"""The frames of the data plane over libp2p streams and reverse channels, and the client
built on them: names of ``p2p://`` peers, request and reply headers, and the calls a node makes
over one request-reply exchange (``FramedClient``). Pure: the streams (``transport.streams``)
and the reverse channels (``transport.reverse``) move the bytes, and both import this.

Wire format of protocol ``/p2psync/data/1.0.0`` (requests one after another on a stream)::

    request := u32 n | header (n bytes of JSON) | body (header["body"] bytes)
        header = {"method": "GET" | "POST", "path": "/chunk/<sha256>", "query": {str: str},
                  "peer": requester's own peer URL or null, "body": int}
    reply   := u32 n | header (n bytes of JSON) | body (header["length"] bytes)
        header = {"status": int, "type": content type, "length": int}

``u32`` is big-endian.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from p2p_sync import jsonbounds
from p2p_sync.errors import PeerError
from p2p_sync.protocol.peers import PEER_ID
from p2p_sync.transport.announcement import announce_body, announce_doc
from p2p_sync.transport.client import parse_json, split_parts
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import Reply

SCHEME = "p2p://"
MAX_REPLY_HEADER = 4096
U32 = struct.Struct(">I")  # a frame's length


# ---------------------------------------------------------------- names (pure)


def peer_url(peer_id: str) -> str:
    """How a node reachable only over libp2p is named among peers."""
    return f"{SCHEME}{peer_id}"


def split_url(url: str) -> tuple[str, str, dict[str, str]]:
    """``p2p://<id>/have/<d>?known=3`` -> (id, "/have/<d>", {"known": "3"}); PeerError if
    malformed."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME[:-3] or not PEER_ID.match(parts.netloc):
        raise PeerError(f"{url}: not a p2p:// peer URL")
    return parts.netloc, parts.path or "/", dict(parse_qsl(parts.query))


# ---------------------------------------------------------------- framing (pure)


def encode_request(
    method: str, path: str, query: dict[str, str], peer: str | None, body: bytes, **extra: Any
) -> bytes:
    """A request frame (``extra``: more header fields, e.g. a reverse channel's ``id``)."""
    head = {"method": method, "path": path, "query": query, "peer": peer, "body": len(body)}
    return _frame(head | extra) + body


def encode_reply_header(reply: Reply, **extra: Any) -> bytes:
    head = {"status": reply.status, "type": reply.content_type, "length": len(reply.body)}
    return _frame(head | extra)


def _frame(doc: dict[str, Any]) -> bytes:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return U32.pack(len(raw)) + raw


def parse_request_header(raw: bytes, max_body: int) -> dict[str, Any]:
    """The request header, checked field by field; ValueError names what is wrong."""
    return request_fields(jsonbounds.loads(raw), max_body)


def request_fields(doc: Any, max_body: int) -> dict[str, Any]:
    """A parsed request header, checked field by field; ValueError names what is wrong."""
    if not isinstance(doc, dict) or doc.get("method") not in ("GET", "POST"):
        raise ValueError("method must be GET or POST")
    if not isinstance(doc.get("path"), str) or not doc["path"].startswith("/"):
        raise ValueError("path must be a string starting with /")
    query = doc.get("query")
    if not isinstance(query, dict) or not all(isinstance(v, str) for v in query.values()):
        raise ValueError("query must map strings to strings")
    if doc.get("peer") is not None and not isinstance(doc["peer"], str):
        raise ValueError("peer must be a string or null")
    body = doc.get("body")
    if not isinstance(body, int) or not 0 <= body <= max_body:
        raise ValueError(f"body length must be within 0..{max_body}")
    return doc


def parse_reply_header(raw: bytes) -> tuple[int, str, int]:
    """(status, content type, length); ValueError if malformed."""
    return reply_fields(jsonbounds.loads(raw))


def reply_fields(doc: Any) -> tuple[int, str, int]:
    """(status, content type, length) of a parsed reply header; ValueError if malformed."""
    if not isinstance(doc, dict):
        raise ValueError("reply header must be an object")
    status, ctype, length = (doc.get(k) for k in ("status", "type", "length"))
    if not (isinstance(status, int) and isinstance(ctype, str) and isinstance(length, int)):
        raise ValueError("reply header needs integer status and length and a string type")
    if length < 0:
        raise ValueError("negative reply length")
    return status, ctype, length


# ---------------------------------------------------------------- the client


class FramedClient:
    """The data-plane calls for ``p2p://`` peers, over one ``_request`` that sends a request
    frame and returns the reply's body (a stream here, a reverse channel in
    ``transport.reverse``)."""

    limits: HttpLimits
    self_url: str | None

    async def _request(
        self, url: str, limit: int, method: str = "GET", body: bytes = b"", expect: int = 200
    ) -> bytes:
        raise NotImplementedError

    async def get_json(self, url: str) -> Any:
        return parse_json(url, await self._request(url, self.limits.max_json_bytes))

    async def get_bytes(
        self, url: str, limit: int | None = None, moved: Callable[[int], None] | None = None
    ) -> bytes:
        """A reply frame comes whole (its pieces are timed in the host's thread): nothing to
        tell ``moved``."""
        return await self._request(url, limit or self.limits.max_chunk_bytes)

    def get_parts(self, url: str, sizes: list[int]) -> AsyncIterator[bytes]:
        """A reply frame comes whole: its parts once it is in."""
        return split_parts(self.get_bytes(url), url, sizes)

    async def get_feed(self, url: str) -> AsyncIterator[Any]:
        """A reply frame comes whole: a feed's first answer alone (the follower asks again)."""
        yield await self.get_json(url)

    async def post_json(self, url: str, doc: Any) -> Any:
        body = json.dumps(doc).encode()
        return parse_json(url, await self._request(url, self.limits.max_json_bytes, "POST", body))

    async def announce(
        self,
        peer: str,
        digests: list[str],
        extra: Mapping[str, Any] | None = None,
        chunks: list[bytes] | None = None,
        manifests: bytes = b"",
    ) -> None:
        doc = announce_doc(self.self_url, digests, extra)
        body = announce_body(doc, chunks, manifests)
        await self._request(f"{peer}/announce", self.limits.max_json_bytes, "POST", body, 202)

    async def close(self) -> None:
        pass
