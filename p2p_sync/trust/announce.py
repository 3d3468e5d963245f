"""Signed version announcements for the gossip control plane. Sans-I/O: bytes in, verdicts out.

The trainer announces each new version on the gossipsub topic ``p2psync/<swarm-id>/announce``.
Every node judges a message *before* gossipsub forwards it, so a forged or replayed
announcement dies at the first honest hop: it is never relayed, and whoever sent it is
penalized. Verdicts follow gossipsub's validation results:

- ``ACCEPT``: new, correctly signed news; forward it and learn its manifests.
- ``REJECT``: malformed, forged, for another swarm, too large, too old or from the future;
  drop it and penalize the peer that sent it (an honest peer never forwards such a message,
  because it judged it the same way first).
- ``IGNORE``: genuine but nothing new (every digest already known: a duplicate or a replay of
  an announcement already acted on); drop it without penalty, since an honest peer can
  forward a late duplicate.

Wire form (UTF-8 JSON, the same envelope shape and canonical encoding as manifests, see
``p2p_sync.trust.manifest``)::

    {"signed": {...}, "signatures": [{"keyid": "<hex>", "sig": "<hex>"}, ...],
     "manifests": ["<signed manifest JSON text>", ...]}

Signatures are Ed25519 by the swarm's trusted keys (the trainer's, as for manifests) over the
canonical encoding of ``signed``:

=============  ===========================================================================
_type          "p2psync/announce"
spec_version   1
swarm          swarm id, 64 hex digits
version        int >= 0, the version announced
digests        list of 1..max_digests manifest digests (64 hex) published for that version
issued_ms      int, unix milliseconds when the trainer signed it (replay window, latency)
sources        list of 0..max_sources http://host:port data-plane URLs holding the manifests
=============  ===========================================================================

``manifests`` is outside the signature: it carries the signed manifests themselves when they
are small enough (so a receiver needs no HTTP round trip to learn them); each one must verify
on its own against the policy and be one of ``digests``. It may be empty: receivers then fetch
the manifests by digest over HTTP from the sender or a source.

Replays: an announcement older than ``max_age_s`` (or issued more than ``clock_skew_s`` in the
future) is rejected (:class:`ReplayedAnnouncementError`); a younger one whose digests are all
known is ignored. So a captured announcement cannot be replayed to make peers chase stale news.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from p2p_sync import jsonbounds
from p2p_sync.errors import (  # the announcement errors live there; re-exported for callers
    AnnouncementError,  # noqa: F401
    MalformedAnnouncementError,
    MalformedJsonError,
    MalformedManifestError,
    ManifestError,
    OversizedAnnouncementError,
    ReplayedAnnouncementError,
    SmuggledManifestError,
    WrongSwarmError,
)
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import Manifest, SwarmPolicy, canonical, check_signatures, verify

TYPE = "p2psync/announce"
SPEC_VERSION = 1
HEX = set("0123456789abcdef")


class Verdict(enum.Enum):
    ACCEPT = "accept"
    REJECT = "reject"
    IGNORE = "ignore"


@dataclass(frozen=True)
class AnnounceLimits:
    """Every bound a node enforces on announcements (and a trainer respects when sending)."""

    max_message_bytes: int = 256 * 1024
    max_digests: int = 16
    max_sources: int = 4
    max_age_s: int = 600
    clock_skew_s: int = 300
    per_s: float = 2.0  # a trainer's gossip rate (py-libp2p drops > 10 msg/s per peer)


@dataclass(frozen=True)
class Announcement:
    """The signed fields of an announcement, typed."""

    swarm: str
    version: int
    digests: tuple[str, ...]
    issued_ms: int
    sources: tuple[str, ...] = ()

    def signed(self) -> dict:
        return {
            "_type": TYPE,
            "spec_version": SPEC_VERSION,
            "swarm": self.swarm,
            "version": self.version,
            "digests": list(self.digests),
            "issued_ms": self.issued_ms,
            "sources": list(self.sources),
        }


@dataclass(frozen=True)
class Decision:
    """What a node does with one gossip message, and why."""

    verdict: Verdict
    announcement: Announcement | None = None
    manifests: tuple[tuple[Manifest, bytes], ...] = ()  # verified inline manifests
    reason: str = ""
    error: type[Exception] | None = field(default=None, compare=False)


def topic(swarm_id: str) -> str:
    """The gossipsub topic of a swarm's announcements."""
    return f"p2psync/{swarm_id}/announce"


def encode(
    announcement: Announcement,
    keys: list[SigningKey],
    manifests: list[bytes] = (),
    limits: AnnounceLimits = AnnounceLimits(),
) -> bytes:
    """The signed wire form; inline manifests are dropped if they would exceed the size limit."""
    message = canonical(announcement.signed())
    sigs = [{"keyid": k.public.keyid, "sig": k.sign(message).hex()} for k in keys]
    doc = {"signed": announcement.signed(), "signatures": sigs}
    full = canonical({**doc, "manifests": [m.decode() for m in manifests]})
    return full if len(full) <= limits.max_message_bytes else canonical({**doc, "manifests": []})


# ---------------------------------------------------------------- parsing

_FIELDS: dict[str, type] = {
    "_type": str,
    "spec_version": int,
    "swarm": str,
    "version": int,
    "digests": list,
    "issued_ms": int,
    "sources": list,
}


def _is_hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= HEX


def _check_signed(signed: object, limits: AnnounceLimits) -> Announcement:
    if not isinstance(signed, dict) or set(signed) != set(_FIELDS):
        raise MalformedAnnouncementError(f"'signed' must have exactly the fields {sorted(_FIELDS)}")
    for name, kind in _FIELDS.items():
        if not isinstance(signed[name], kind) or isinstance(signed[name], bool):
            raise MalformedAnnouncementError(f"field {name!r} has the wrong type")
    if signed["_type"] != TYPE or signed["spec_version"] != SPEC_VERSION:
        raise MalformedAnnouncementError(f"not a {TYPE} v{SPEC_VERSION} announcement")
    digests, sources = signed["digests"], signed["sources"]
    if not 1 <= len(digests) <= limits.max_digests or not all(map(_is_hex64, digests)):
        raise MalformedAnnouncementError(f"digests must be 1..{limits.max_digests} SHA-256 hex")
    if len(sources) > limits.max_sources or not all(_valid_source(s) for s in sources):
        raise MalformedAnnouncementError(f"sources must be 0..{limits.max_sources} http URLs")
    if signed["version"] < 0 or not _is_hex64(signed["swarm"]):
        raise MalformedAnnouncementError("version or swarm is malformed")
    return Announcement(
        signed["swarm"], signed["version"], tuple(digests), signed["issued_ms"], tuple(sources)
    )


def _valid_source(url: object) -> bool:
    return isinstance(url, str) and url.startswith("http://") and len(url) < 256


def parse(data: bytes, limits: AnnounceLimits = AnnounceLimits()) -> tuple:
    """Parse WITHOUT trusting: (announcement, raw signature entries, inline manifest bytes)."""
    if len(data) > limits.max_message_bytes:
        raise OversizedAnnouncementError(f"{len(data)} bytes, limit {limits.max_message_bytes}")
    try:
        doc = jsonbounds.loads(data)
    except MalformedJsonError as exc:  # too deep or too long a number too (HostileJsonError)
        raise MalformedAnnouncementError(str(exc)) from None
    if not isinstance(doc, dict) or set(doc) != {"signed", "signatures", "manifests"}:
        raise MalformedAnnouncementError("expected an object with signed, signatures, manifests")
    announcement = _check_signed(doc["signed"], limits)
    sigs, inline = doc["signatures"], doc["manifests"]
    if not isinstance(sigs, list) or not all(
        isinstance(s, dict)
        and set(s) == {"keyid", "sig"}
        and all(isinstance(v, str) for v in s.values())
        for s in sigs
    ):
        raise MalformedAnnouncementError("signatures must be a list of {keyid, sig} strings")
    if not isinstance(inline, list) or not all(isinstance(m, str) for m in inline):
        raise MalformedAnnouncementError("manifests must be a list of strings")
    if len(inline) > len(announcement.digests):
        raise MalformedAnnouncementError("more inline manifests than announced digests")
    return announcement, sigs, [m.encode() for m in inline]


# ---------------------------------------------------------------- judging


def _check(
    data: bytes,
    policy: SwarmPolicy,
    now_ms: int,
    limits: AnnounceLimits,
    verify_inline: Callable[[bytes], Manifest],
) -> tuple:
    announcement, sigs, inline = parse(data, limits)
    try:
        check_signatures(announcement, sigs, policy)  # type: ignore[arg-type]  # duck: .signed()
    except MalformedManifestError as exc:
        raise MalformedAnnouncementError(str(exc)) from None
    if announcement.swarm != policy.swarm_id:
        raise WrongSwarmError(f"announcement is for swarm {announcement.swarm[:16]}")
    age_ms = now_ms - announcement.issued_ms
    if age_ms > limits.max_age_s * 1000 or -age_ms > limits.clock_skew_s * 1000:
        raise ReplayedAnnouncementError(f"issued {age_ms / 1000:.0f}s ago, outside the window")
    manifests = []
    for raw in inline:
        manifest = verify_inline(raw)
        if manifest.digest not in announcement.digests:
            raise SmuggledManifestError(f"inline manifest {manifest.digest[:16]} not announced")
        manifests.append((manifest, raw))
    return announcement, tuple(manifests)


def judge(
    data: bytes,
    policy: SwarmPolicy,
    now_ms: int,
    known: Callable[[str], bool],
    limits: AnnounceLimits = AnnounceLimits(),
    verify_inline: Callable[[bytes], Manifest] | None = None,
) -> Decision:
    """Decide what to do with one gossip message. ``known(digest)`` says whether this node
    already has (or already accepted an announcement of) that manifest; ``verify_inline``
    checks each inline manifest (a node passes its ``TrustedSet.authentic``, so gossip and
    HTTP apply one gate; the default is ``manifest.verify`` with no version floor)."""
    if verify_inline is None:
        verify_inline = lambda raw: verify(raw, policy, now_ms / 1000, None)  # noqa: E731
    try:
        announcement, manifests = _check(data, policy, now_ms, limits, verify_inline)
    except ManifestError as exc:
        return Decision(Verdict.REJECT, reason=f"{type(exc).__name__}: {exc}", error=type(exc))
    if all(known(d) for d in announcement.digests):
        return Decision(Verdict.IGNORE, announcement, reason="already known")
    return Decision(Verdict.ACCEPT, announcement, manifests)
