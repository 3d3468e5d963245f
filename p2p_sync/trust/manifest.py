"""Signed, versioned manifests and the swarm trust policy. Sans-I/O: no sockets, files or loops.

A manifest says what one artifact (a patch or a full snapshot) is: which swarm, which version,
what it applies to, what it produces, how its payload is cut into chunks and what each chunk
hashes to. Trust flows from the trainer's Ed25519 key through the manifest to every chunk:
a peer that accepts a manifest can check every chunk it downloads from anyone.

Wire form (UTF-8 JSON, like TUF metadata)::

    {"signed": {...fields...}, "signatures": [{"keyid": "<hex>", "sig": "<hex>"}, ...]}

Signatures are Ed25519 over the *canonical encoding* of ``signed``: JSON with keys sorted,
no insignificant whitespace (separators ``,`` and ``:``), ASCII-only escapes, integers only (no
floats), as produced by ``json.dumps(signed, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)``. Fields of ``signed``:

=============  ===========================================================================
_type          "p2psync/manifest"
spec_version   1
swarm          swarm id, 64 hex digits (``SwarmPolicy.swarm_id``)
version        int >= 0, the version this artifact produces
kind           "patch" (needs base_version < version and base_state) or "snapshot" (both null)
base_version   int or null
base_state     32 hex digits (state hash of the base, ``p2p_sync.weights.statehash``) or null
target_state   32 hex digits, state hash of the weights the artifact produces
layout         32 hex digits, layout fingerprint (names, shapes, dtypes)
codec          payload format: "p2psync-patch/1" (patches) or "safetensors" (snapshots)
payload_size   int > 0, bytes
chunk_size     int, bytes per chunk (the last chunk may be shorter)
chunks         list of SHA-256 hex digests, ceil(payload_size / chunk_size) of them
created        int, unix seconds
expires        int, unix seconds, > created
=============  ===========================================================================

Verification order (each failure has its own exception, named after the attack it stops):
parse (MalformedManifestError) -> signatures against the policy (MissingSignatureError,
ForgedSignatureError, UntrustedSignerError) -> swarm (WrongSwarmError) -> limits
(EndlessDataAttackError) -> expiry (FreezeAttackError) -> version (RollbackAttackError).
Signatures come first, so nothing from an unsigned manifest is believed, not even its swarm.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from p2p_sync import jsonbounds
from p2p_sync.errors import (
    EndlessDataAttackError,
    ForgedSignatureError,
    FreezeAttackError,
    MalformedJsonError,
    MalformedManifestError,
    MissingSignatureError,
    RollbackAttackError,
    UntrustedSignerError,
    WrongSwarmError,
)
from p2p_sync.trust.keys import PublicKey, SigningKey

TYPE = "p2psync/manifest"
SPEC_VERSION = 1
PATCH, SNAPSHOT = "patch", "snapshot"
CODECS = {PATCH: "p2psync-patch/1", SNAPSHOT: "safetensors"}


@dataclass(frozen=True)
class ManifestLimits:
    """Every bound a peer enforces on manifests it is offered."""

    max_manifest_bytes: int = 8 * 2**20
    max_payload_size: int = 256 * 2**30
    max_chunks: int = 200_000
    min_chunk_size: int = 16 * 2**10
    max_chunk_size: int = 64 * 2**20
    max_lifetime_s: int = 366 * 86400
    clock_skew_s: int = 300


@dataclass(frozen=True)
class SwarmPolicy:
    """Who may sign for a swarm: ``threshold`` distinct keys out of ``keys``."""

    name: str
    keys: tuple[PublicKey, ...]
    threshold: int = 1

    def __post_init__(self) -> None:
        distinct = len({k.keyid for k in self.keys})
        if not self.name:
            raise ValueError("a swarm needs a name")
        if not 1 <= self.threshold <= distinct:
            raise ValueError(f"threshold {self.threshold} needs 1..{distinct} distinct keys")

    @property
    def keyids(self) -> dict[str, PublicKey]:
        return {k.keyid: k for k in self.keys}

    @property
    def swarm_id(self) -> str:
        """SHA-256 over name, sorted key ids and threshold: peers of other swarms never match."""
        doc = {"name": self.name, "keys": sorted(self.keyids), "threshold": self.threshold}
        return hashlib.sha256(canonical(doc)).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """The signed fields of a manifest, typed."""

    swarm: str
    version: int
    kind: str
    base_version: int | None
    base_state: str | None
    target_state: str
    layout: str
    codec: str
    payload_size: int
    chunk_size: int
    chunks: tuple[str, ...]
    created: int
    expires: int

    def signed(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["chunks"] = list(self.chunks)
        return {"_type": TYPE, "spec_version": SPEC_VERSION, **doc}

    @functools.cached_property  # writes the instance dict directly, so frozen is fine
    def digest(self) -> str:
        """SHA-256 of the canonical signed fields: the manifest's identity."""
        return hashlib.sha256(canonical(self.signed())).hexdigest()

    def chunk_length(self, index: int) -> int:
        last = len(self.chunks) - 1
        if index < last:
            return self.chunk_size
        return self.payload_size - last * self.chunk_size


def canonical(doc: Any) -> bytes:
    """The documented canonical JSON encoding (what signatures cover)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: Manifest, keys: list[SigningKey]) -> bytes:
    """The manifest's wire form, signed by every key in ``keys``."""
    signed = manifest.signed()
    message = canonical(signed)
    sigs = [{"keyid": k.public.keyid, "sig": k.sign(message).hex()} for k in keys]
    return json.dumps({"signed": signed, "signatures": sigs}, indent=1).encode()


# ---------------------------------------------------------------- parsing

_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "_type": (str,),
    "spec_version": (int,),
    "swarm": (str,),
    "version": (int,),
    "kind": (str,),
    "base_version": (int, type(None)),
    "base_state": (str, type(None)),
    "target_state": (str,),
    "layout": (str,),
    "codec": (str,),
    "payload_size": (int,),
    "chunk_size": (int,),
    "chunks": (list,),
    "created": (int,),
    "expires": (int,),
}


def _is_hex(value: Any, digits: int) -> bool:
    if not isinstance(value, str) or len(value) != digits:
        return False
    return all(c in "0123456789abcdef" for c in value)


def _check_fields(signed: Any) -> None:
    if not isinstance(signed, dict):
        raise MalformedManifestError("'signed' must be an object")
    missing = _FIELD_TYPES.keys() - signed.keys()
    unknown = signed.keys() - _FIELD_TYPES.keys()
    if missing or unknown:
        raise MalformedManifestError(f"missing fields {sorted(missing)}, unknown {sorted(unknown)}")
    for name, types in _FIELD_TYPES.items():
        value = signed[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise MalformedManifestError(f"field {name!r} has the wrong type")
    if signed["_type"] != TYPE or signed["spec_version"] != SPEC_VERSION:
        raise MalformedManifestError(
            f"not a {TYPE} v{SPEC_VERSION} manifest ({signed['_type']} v{signed['spec_version']})"
        )


def _check_values(m: Manifest) -> None:
    if m.kind not in CODECS or m.codec != CODECS[m.kind]:
        raise MalformedManifestError(f"kind {m.kind!r} with codec {m.codec!r} is not allowed")
    if m.kind == PATCH:
        if m.base_version is None or m.base_state is None or not 0 <= m.base_version < m.version:
            raise MalformedManifestError(
                "a patch needs a base version below its version and a base state"
            )
        if not _is_hex(m.base_state, 32):
            raise MalformedManifestError("base_state must be 32 hex digits")
    elif m.base_version is not None or m.base_state is not None:
        raise MalformedManifestError("a snapshot has no base")
    if m.version < 0 or not _is_hex(m.target_state, 32) or not _is_hex(m.layout, 32):
        raise MalformedManifestError("version, target_state or layout is malformed")
    if not _is_hex(m.swarm, 64) or not all(_is_hex(c, 64) for c in m.chunks):
        raise MalformedManifestError("swarm id and chunk hashes must be SHA-256 hex digests")
    if m.payload_size <= 0 or m.chunk_size <= 0 or m.expires <= m.created:
        raise MalformedManifestError("sizes must be positive and expires after created")
    if len(m.chunks) != -(-m.payload_size // m.chunk_size):
        raise MalformedManifestError(
            f"{len(m.chunks)} chunk hashes for {m.payload_size} bytes in {m.chunk_size}-byte chunks"
        )


def parse(data: bytes, limits: ManifestLimits = ManifestLimits()) -> tuple[Manifest, list[dict]]:
    """Parse the wire form WITHOUT trusting it: the manifest and its raw signature entries."""
    if len(data) > limits.max_manifest_bytes:
        raise EndlessDataAttackError(
            f"manifest is {len(data)} bytes, limit {limits.max_manifest_bytes}"
        )
    try:
        doc = jsonbounds.loads(data)
    except MalformedJsonError as exc:  # too deep or too long a number too (HostileJsonError)
        raise MalformedManifestError(str(exc)) from None
    if not isinstance(doc, dict) or set(doc) != {"signed", "signatures"}:
        raise MalformedManifestError("a manifest is an object with 'signed' and 'signatures'")
    _check_fields(doc["signed"])
    fields = {k: v for k, v in doc["signed"].items() if k not in ("_type", "spec_version")}
    if not all(isinstance(c, str) for c in fields["chunks"]):
        raise MalformedManifestError("chunk hashes must be strings")
    manifest = Manifest(**{**fields, "chunks": tuple(fields["chunks"])})
    _check_values(manifest)
    sigs = doc["signatures"]
    if not isinstance(sigs, list) or not all(
        isinstance(s, dict)
        and set(s) == {"keyid", "sig"}
        and all(isinstance(v, str) for v in s.values())
        for s in sigs
    ):
        raise MalformedManifestError("signatures must be a list of {keyid, sig} strings")
    return manifest, sigs


# ---------------------------------------------------------------- verification


def _valid_signers(manifest: Manifest, sigs: list[dict], policy: SwarmPolicy) -> set[str]:
    message = canonical(manifest.signed())
    trusted, valid, forged = policy.keyids, set(), []
    for entry in sigs:
        key = trusted.get(entry["keyid"])
        if key is None:
            continue
        try:
            sig = bytes.fromhex(entry["sig"])
        except ValueError:
            sig = b""
        if key.verify(sig, message):
            valid.add(entry["keyid"])  # a set: the same key signing twice counts once
        else:
            forged.append(entry["keyid"])
    if forged and len(valid) < policy.threshold:
        raise ForgedSignatureError(f"signature by trusted key {forged[0][:16]} does not verify")
    return valid


def check_signatures(manifest: Manifest, sigs: list[dict], policy: SwarmPolicy) -> None:
    valid = _valid_signers(manifest, sigs, policy)
    if len(valid) >= policy.threshold:
        return
    if not sigs:
        raise MissingSignatureError("manifest carries no signature")
    if not valid and all(s["keyid"] not in policy.keyids for s in sigs):
        raise UntrustedSignerError(
            f"signed only by untrusted key(s) {', '.join(s['keyid'][:16] for s in sigs)}"
        )
    raise MissingSignatureError(
        f"{len(valid)} valid signature(s) from distinct trusted keys, threshold {policy.threshold}"
    )


def check_limits(m: Manifest, limits: ManifestLimits) -> None:
    if m.payload_size > limits.max_payload_size or len(m.chunks) > limits.max_chunks:
        raise EndlessDataAttackError(
            f"payload {m.payload_size} bytes in {len(m.chunks)} chunks exceeds the limits"
        )
    if not limits.min_chunk_size <= m.chunk_size <= limits.max_chunk_size:
        raise EndlessDataAttackError(f"chunk size {m.chunk_size} outside the allowed range")
    if m.expires - m.created > limits.max_lifetime_s:
        raise EndlessDataAttackError("lifetime longer than allowed")


def verify(
    data: bytes,
    policy: SwarmPolicy,
    now: float,
    accepted_version: int | None,
    limits: ManifestLimits = ManifestLimits(),
) -> Manifest:
    """Parse and check a manifest against the policy; returns it only if every check passes.

    ``now`` is the caller's clock (unix seconds); ``accepted_version`` the newest version this
    peer already accepted (None for a newcomer).
    """
    manifest, sigs = parse(data, limits)
    check_signatures(manifest, sigs, policy)
    if manifest.swarm != policy.swarm_id:
        raise WrongSwarmError(
            f"manifest is for swarm {manifest.swarm[:16]}, not {policy.swarm_id[:16]}"
        )
    check_limits(manifest, limits)
    if now > manifest.expires + limits.clock_skew_s:
        raise FreezeAttackError(
            f"manifest for version {manifest.version} expired at {manifest.expires}"
        )
    if accepted_version is not None and manifest.version <= accepted_version:
        raise RollbackAttackError(
            f"version {manifest.version} is not newer than accepted version {accepted_version}"
        )
    return manifest
