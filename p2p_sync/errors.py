"""Exceptions, one per failure class, so callers (and tests) can tell the problems apart.

Every exception the library raises derives from :class:`P2PSyncError` and is defined here (the
modules that raise them re-export their own, so older import paths keep working). The
application's errors (``node.errors``) and the simulator's (``simulations.errors``) derive from
the same base and live in their own layer.

Every error a patch can raise derives from :class:`PatchError`; a caller that only wants to
refuse a bad patch catches that. Each subclass names exactly one way a patch can be wrong,
with a message that says what was expected and what was found.
"""

from collections.abc import Mapping


class P2PSyncError(Exception):
    """Base of every error raised by p2psync."""


class PatchError(P2PSyncError):
    """A patch cannot be decoded, merged or applied."""


class TruncatedPatchError(PatchError):
    """The patch ends before the data its header announces (a cut-off download or file)."""


class BadMagicError(PatchError):
    """The bytes do not start with the patch magic: not a p2psync patch at all."""


class UnsupportedFormatError(PatchError):
    """The patch uses a format version (or coder) this build does not know."""


class MalformedPatchError(PatchError):
    """A header or table field holds a value the format does not allow."""


class CorruptFrameError(PatchError):
    """A tensor frame fails to decompress or its checksum does not match."""


class CountMismatchError(PatchError):
    """A frame holds a different number of entries than its table row declares."""


class IndexOutOfRangeError(PatchError):
    """A decoded position lies outside its tensor: applying it would write out of bounds."""


class TrailingDataError(PatchError):
    """Bytes follow the last frame: the file was concatenated or tampered with."""


class LayoutMismatchError(PatchError):
    """The weights (or another patch) have different tensor names, shapes or dtypes."""


class ShardLayoutError(LayoutMismatchError):
    """A shard of a tensor that cannot be diffed or patched on its own: a block that splits
    the 64-bit words the state hash is made of."""


class BaseMismatchError(PatchError):
    """The weights are not the exact state the patch was made against."""


class TargetMismatchError(PatchError):
    """After applying, the weights do not hash to the patch's target (the apply was undone)."""


class ChainBrokenError(PatchError):
    """Patches to merge do not form a chain: one's target is not the next one's base."""


class ManifestError(P2PSyncError):
    """A manifest is refused. Each subclass is named after the attack it stops."""


class MalformedManifestError(ManifestError):
    """Not a well-formed manifest: bad JSON, missing, unknown or mistyped fields."""


class MissingSignatureError(ManifestError):
    """Fewer valid signatures from trusted keys than the swarm's threshold (unsigned data)."""


class ForgedSignatureError(ManifestError):
    """A signature claims a trusted key but does not verify: forged or tampered content."""


class UntrustedSignerError(ManifestError):
    """Signed only by keys this swarm does not trust: an impostor trainer."""


class WrongSwarmError(ManifestError):
    """Made for another swarm: data must never cross between swarms."""


class RollbackAttackError(ManifestError):
    """Version not newer than the one already accepted: a replay or a rollback."""


class FreezeAttackError(ManifestError):
    """Expired: an attacker may be replaying stale data to hold peers on an old version."""


class EndlessDataAttackError(ManifestError):
    """Declared sizes exceed the configured limits: would exhaust disk, memory or bandwidth."""


class LayoutSwapAttackError(ManifestError):
    """For other tensors (names, shapes, dtypes) than this node holds: would swap the model.
    Declined before any download; signed by the trainer, so its relay is not to blame."""


class SubstitutedManifestError(ManifestError):
    """Served under another manifest's digest: a peer substituting content for what it offered."""


class ChunkError(P2PSyncError):
    """A chunk is refused (wrong index, length or hash)."""


class ChunkIndexError(ChunkError):
    """The chunk index is outside the manifest's chunk list."""


class ChunkLengthError(ChunkError):
    """The chunk has a different length than the manifest implies."""


class ChunkHashMismatchError(ChunkError):
    """The chunk's bytes do not hash to the manifest's value: corrupt or malicious data."""


class IncompletePayloadError(ChunkError):
    """Reassembly asked for before every chunk was verified."""


class NoPathError(P2PSyncError):
    """No chain of announced artifacts leads from the local state to the head."""


class MissingBaseError(PatchError):
    """The patch codes positions by the base's exponents, and no base weights were given."""


class AnnouncementError(ManifestError):
    """An announcement is refused. Subclasses are named after the attack they stop."""


class MalformedAnnouncementError(AnnouncementError):
    """Not a well-formed announcement: bad JSON, missing, unknown or mistyped fields."""


class OversizedAnnouncementError(AnnouncementError):
    """Bigger than the limits allow: would flood the gossip mesh (spam)."""


class ReplayedAnnouncementError(AnnouncementError):
    """Issued outside the accepted time window: an old announcement replayed (or a forged
    clock) to make peers chase stale news."""


class SmuggledManifestError(AnnouncementError):
    """An inline manifest that the signed digest list does not name: content smuggled past
    the signature."""


# ---------------------------------------------------------------- JSON from peers and files


class MalformedJsonError(P2PSyncError, ValueError):
    """Bytes from a peer or a file are not one UTF-8 JSON document (``p2p_sync.jsonbounds``;
    still a ValueError, as ``json.loads`` raised, for callers that catch that)."""


class HostileJsonError(MalformedJsonError):
    """JSON nested deeper, or with a longer number, than any p2psync document
    (``jsonbounds.JsonLimits``): parsed, it would exhaust the parser's stack (RecursionError)
    or its CPU (an integer of thousands of digits). Refused before ``json`` sees it."""


# ---------------------------------------------------------------- local state and input


class StoreError(P2PSyncError):
    """The data dir cannot be used (unreadable, or its state is inconsistent)."""


class StoreFormatError(StoreError):
    """The data dir was written by a p2psync whose state hashes this one cannot check: opening
    it would drop every checkpoint and log record as corrupt, and a trainer would start over at
    version 0, which its peers refuse as a rollback. It is refused whole instead."""


class StoreFullError(StoreError):
    """The data dir's filesystem is full (ENOSPC, or the user's quota): what was being written
    is not kept, and everything written before stays. The node logs it once, keeps what it
    accepted, and tries again later: it resumes by itself once there is room."""


class DataDirInUseError(StoreError):
    """Another running node holds the data dir (its lock file names the holder's pid). Two
    nodes on one dir would share a libp2p peer id and write each other's log and packs."""


class KeyFileError(P2PSyncError):
    """A key file or key text is missing, malformed or not Ed25519."""


class ConfigError(P2PSyncError):
    """A config file or flag value is invalid (the message names the field)."""


# ---------------------------------------------------------------- membership


class MembershipError(P2PSyncError):
    """A peer is not (or no longer) a member of this private swarm: its requests are refused."""


class MalformedAdmissionError(MembershipError):
    """An admission that is not a well-formed X.509 certificate of the expected shape
    (tampered, truncated, over the size limit, another key type)."""


class NotAMemberError(MembershipError):
    """No admission, or one the swarm's admin key did not sign (a non-member with the URL,
    a forged admission)."""


class ForeignSwarmError(MembershipError):
    """An admission issued for another swarm (a member of swarm A asking swarm B)."""


class ExpiredAdmissionError(MembershipError):
    """An admission outside its validity (expired, or not yet valid beyond the clock skew)."""


class RevokedMemberError(MembershipError):
    """An admission the admin's current revocation list names."""


class ImpostorError(MembershipError):
    """An admission whose key is not the identity it names, or presented by another
    identity than the one it binds (a copied admission)."""


class OverlongAdmissionError(MembershipError):
    """An admission whose lifetime exceeds the swarm's limit (a key leak would last too long)."""


class ForgedRevocationListError(MembershipError):
    """A revocation list not signed by the swarm's admin key, or older than the one held
    (a rollback that would re-admit revoked members)."""


# ---------------------------------------------------------------- network


class PeerError(P2PSyncError):
    """A peer did not answer as the protocol says (transport error, bad status, bad body)."""


class PeerUnreachableError(PeerError):
    """No connection to the peer could be made (refused, no route, connect timed out)."""


class PeerBusyError(PeerError):
    """The peer refused for lack of upload slots (HTTP 503): not a failure, try elsewhere."""


class PeerLacksError(PeerError):
    """The peer does not hold what was asked (HTTP 404): of a run of chunks, it lacks the
    first (``/chunks`` serves up to the first chunk it lacks)."""


class MalformedPeerUrlError(P2PSyncError):
    """Not a peer's name (``http(s)://host:port`` or ``p2p://<peer id>``): another scheme, a
    path, a query, credentials, a bad host or port. Stored or passed on, it would make nodes
    request what whoever named it chose (a local file, a path on a third party)."""


class ImpersonationError(PeerError):
    """A reverse channel's handshake does not prove the peer id it claims: a node posing as
    another, or a channel passed on by a peer it was opened to (``transport.reverse``)."""


class DownloadStalledError(P2PSyncError):
    """Some chunk of a payload was not delivered within ``stall_timeout_s`` of being asked for
    by any peer claiming it, or has had no source while nothing else moved: waiting longer
    would hang the node on peers that left, lied or were banned. The caller re-plans (another
    artifact, an anchor) and may come back to this one later; ``disowned`` names, by chunk,
    the peers that claimed it and did not serve it (``stalls.carry_unserved``)."""

    def __init__(
        self,
        message: str,
        digest: str,
        indices: frozenset[int],
        disowned: Mapping[int, frozenset[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.digest, self.indices = digest, indices
        self.disowned: Mapping[int, frozenset[str]] = disowned or {}


class P2PError(P2PSyncError):
    """libp2p could not start or a bridged call failed (the node falls back to --peers)."""


class TornApplyError(PatchError):
    """A patch failed part-way through a streaming apply: some tensors hold the new version,
    some the old. The caller rebuilds the weights from the checkpoint and log."""


class PublishError(P2PSyncError):
    """A version could not be published (a sharded publish: rank 0 failed, and says why)."""


class WeightsFileError(P2PSyncError):
    """A weights file is missing, unreadable or not valid safetensors."""
