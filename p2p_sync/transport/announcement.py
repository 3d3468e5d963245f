"""``POST /announce``: its body, framed or not, built by the sender and checked by the
receiver (the fields: ``docs/dataplane.md``).

A framed body is the magic, the JSON's length and the JSON, the packed manifests' length and
the packed manifests, then the chunks "pushing" names, back to back: the trainer sends a
follower the first chunks it hands it right behind the manifest, on the same connection, so
its uplink carries chunks during the round trip the follower's first request takes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zstandard

from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import (
    HEX64,
    PIECE,
    BodyReader,
    BytesReader,
    Refused,
    Request,
    json_doc,
    parsed_json,
    same_host,
    valid_peer_url,
)

# ``POST /announce`` with packed manifests and chunks behind its JSON (docs/dataplane.md): how
# such a body starts ("p2pA" was the form with manifests in the JSON, base64: refused now, as
# its chunks would be misread), its Content-Type, and how many chunks it may carry
ANNOUNCE_MAGIC = b"p2pB"
ANNOUNCE_TYPE = "application/x-p2psync-announce"
MAX_PUSHED = 64


@dataclass(frozen=True)
class Pushed:
    """What a ``POST /announce`` carries beyond its digests (``docs/dataplane.md``)."""

    offers: Mapping[str, list[int]] = field(default_factory=dict)  # digest -> chunk indices
    manifests: Mapping[str, bytes] = field(default_factory=dict)  # digest -> signed manifest
    gossiped: bool = False  # the same news went out by gossip
    # digest -> chunk indices sent behind the JSON (they follow: ``NodeView.on_pushed``)
    pushing: Mapping[str, list[int]] = field(default_factory=dict)
    # a private swarm's revocation list as the sender holds it (PEM; the admin's signature
    # vouches for it, not the sender: ``SwarmTls.adopt``); empty: none
    revocations: bytes = b""


@dataclass(frozen=True)
class Announcement:
    """A ``POST /announce`` as checked: its sender's URL (unproven), the digests, what it
    carries beyond them, the chunks behind its JSON (digest, index, length) and a reader of
    those chunks (None: not framed)."""

    url: str | None
    digests: list[str]
    pushed: Pushed
    pushing: list[tuple[str, int, int]]
    rest: BodyReader | None


def read_announcement(req: Request, limits: HttpLimits) -> Announcement:
    """A ``POST /announce`` request checked field by field, or ``Refused``. Offers, manifests
    and pushed chunks are kept only when the request came from the host of ``url``: anyone
    may claim to be the trainer (and a forgery would get it banned)."""
    head, packed, rest = split_announce(req, limits)
    doc = json_doc(head, limits)
    url, digests = _sender(doc)
    offers = _by_digest(doc, "offers", digests, _indices, "chunk indices")
    manifests = _manifests(doc, packed, digests, limits)
    pushing = _pushing(doc, digests, limits)
    if url is None or not same_host(url, req.remote):
        offers, manifests, pushing = {}, {}, []
    gossiped = doc.get("gossiped", False)
    if not isinstance(gossiped, bool):
        raise Refused(400, "gossiped must be true or false")
    indices: dict[str, list[int]] = {}
    for digest, index, _n in pushing:
        indices.setdefault(digest, []).append(index)
    pushed = Pushed(offers, manifests, gossiped, indices, _revocations(doc))
    return Announcement(url, digests, pushed, pushing, rest)


def _revocations(doc: dict[str, Any]) -> bytes:
    """An announcement's "revocations": a PEM text, or a 400 (judged by its signature
    later, whoever relayed it)."""
    text = doc.get("revocations", "")
    if not isinstance(text, str) or not text.isascii():
        raise Refused(400, "revocations must be a PEM text")
    return text.encode()


def _sender(doc: dict[str, Any]) -> tuple[str | None, list[str]]:
    """An announcement's "url" (a peer's name or null) and "digests" (sha256 each), or a
    400."""
    url, digests = doc.get("url"), doc.get("digests")
    if not (url is None or isinstance(url, str)) or not isinstance(digests, list):
        raise Refused(400, "expected {url, digests}")
    if not all(isinstance(d, str) and HEX64.match(d) for d in digests):
        raise Refused(400, "digests must be 64 hex digits each")
    if url is not None and not valid_peer_url(url):
        raise Refused(400, "url must be http://host:port or p2p://<peer id>")
    return url, digests


def _manifests(
    doc: dict[str, Any], packed: bytes, digests: list[str], limits: HttpLimits
) -> dict[str, bytes]:
    """The signed manifests an announcement carries: its "manifests" and its packed ones."""
    texts = _by_digest(doc, "manifests", digests, _is_str, "manifest text")
    if packed:
        inline = {"packed manifests": _unpack_manifests(packed, limits)}
        texts |= _by_digest(inline, "packed manifests", digests, _is_str, "manifest text")
    return {d: text.encode() for d, text in texts.items()}


def _by_digest(
    doc: dict[str, Any], name: str, digests: list[str], valid: Callable[[Any], bool], what: str
) -> dict:
    """An announcement's optional field ``name``: announced digests to ``what`` (each value
    ``valid``), or a 400."""
    field = doc.get(name, {})
    if isinstance(field, dict) and set(field) <= set(digests) and all(map(valid, field.values())):
        return field
    raise Refused(400, f"{name} must map announced digests to {what}")


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _indices(have: Any) -> bool:
    return isinstance(have, list) and all(type(i) is int and 0 <= i < 2**31 for i in have)


def pack_manifests(texts: Mapping[str, str]) -> bytes:
    """A framed ``POST /announce``'s packed manifests: {digest: signed manifest text} as JSON,
    one zstd frame. A manifest is mostly hex chunk digests (4 bits in 8), which zstd's entropy
    coder takes back to ~34 B a chunk (0.3x the text, 0.75x the base64 an earlier form put in
    the JSON); the trainer pushes it to each follower in the first milliseconds of a version,
    ahead of any chunk. Packed once per version (~1 ms), the same bytes for every follower."""
    raw = json.dumps(dict(texts), separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=1).compress(raw)


def _unpack_manifests(packed: bytes, limits: HttpLimits) -> Any:
    """The JSON of a framed announcement's packed manifests: a 400 if malformed, a 413 if it
    would unpack to more than a request may carry (a small frame must not inflate without
    bound)."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(packed)
        raw = bytearray()
        while piece := reader.read(PIECE):
            raw += piece
            if len(raw) > limits.max_request_bytes:
                raise Refused(413, "packed manifests unpack to more than the request limit")
        return parsed_json(raw, "packed manifests")
    except (ValueError, zstandard.ZstdError):
        raise Refused(400, "packed manifests must be a zstd frame of JSON") from None


def announce_doc(url: str | None, digests: list[str], extra: Mapping[str, Any] | None) -> dict:
    """The body of ``POST /announce`` (its fields: ``docs/dataplane.md``)."""
    return {"url": url, "digests": digests, **(extra or {})}


def frame_announce(doc: Mapping[str, Any], chunks: list[bytes], manifests: bytes = b"") -> bytes:
    """A framed ``POST /announce`` body: the JSON, the packed ``manifests``
    (``pack_manifests``), then ``chunks`` (``doc``'s "pushing")."""
    head = json.dumps(doc).encode()
    sizes = (len(head).to_bytes(4, "big"), len(manifests).to_bytes(4, "big"))
    return b"".join([ANNOUNCE_MAGIC, sizes[0], head, sizes[1], manifests, *chunks])


def announce_body(doc: Mapping[str, Any], chunks: list[bytes] | None, manifests: bytes) -> bytes:
    """A ``POST /announce`` body for transports that send whole bodies: framed when it
    carries packed manifests or chunks, else the JSON alone."""
    if chunks or manifests:
        return frame_announce(doc, chunks or [], manifests)
    return json.dumps(doc).encode()


def split_announce(req: Request, limits: HttpLimits) -> tuple[bytes, bytes, BodyReader | None]:
    """A ``POST /announce`` body's JSON, its packed manifests (empty: none) and, when framed, a
    reader of the chunks behind them; a 400 if the frame is malformed."""
    body = req.body
    if not body.startswith(ANNOUNCE_MAGIC):
        return body, b"", None
    at, parts = 4, []
    for _ in range(2):  # the JSON, then the packed manifests: each a length, then its bytes
        n = int.from_bytes(body[at : at + 4], "big") if len(body) >= at + 4 else -1
        if not 0 <= n <= limits.max_request_bytes or len(body) < at + 4 + n:
            raise Refused(400, "framed announcement: bad JSON or manifests length")
        parts.append(body[at + 4 : at + 4 + n])
        at += 4 + n
    return parts[0], parts[1], req.rest if req.rest is not None else BytesReader(body[at:])


async def read_announce_head(reader: BodyReader, limits: HttpLimits) -> bytes:
    """A framed announcement's magic, JSON and packed manifests off a stream, the chunks left
    unread (the aiohttp server's part of ``split_announce``): a 400 if malformed, a 413 if
    the JSON or the manifests are over the request limit."""
    try:
        magic = await reader.readexactly(4)
        if magic != ANNOUNCE_MAGIC:
            raise Refused(400, "framed announcement: bad magic")
        head = [magic]
        for _ in range(2):
            size = await reader.readexactly(4)
            n = int.from_bytes(size, "big")
            if n > limits.max_request_bytes:
                raise Refused(413, "framed announcement: JSON or manifests over the request limit")
            head += [size, await reader.readexactly(n)]
        return b"".join(head)
    except asyncio.IncompleteReadError:
        raise Refused(400, "framed announcement: body ends early") from None


def _pushing(
    doc: dict[str, Any], digests: list[str], limits: HttpLimits
) -> list[tuple[str, int, int]]:
    """An announcement's "pushing": [[digest, index, length], ...], each an announced
    digest, a chunk index and a length named once; at most ``MAX_PUSHED`` of them and
    ``max_push_bytes`` in all; or a 400."""
    field = doc.get("pushing", [])
    bad = Refused(400, "pushing must list [announced digest, index, length] triples")
    if not isinstance(field, list) or len(field) > MAX_PUSHED:
        raise bad
    out: list[tuple[str, int, int]] = []
    for item in field:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in digests):
            raise bad
        digest, index, n = item
        if not (type(index) is int and type(n) is int and 0 <= index < 2**31 and 0 < n):
            raise bad
        out.append((digest, index, n))
    if len({(d, i) for d, i, _ in out}) < len(out):
        raise bad
    if sum(n for _, _, n in out) > limits.max_push_bytes:
        raise Refused(413, "pushing: more chunk bytes than max_push_bytes")
    return out
