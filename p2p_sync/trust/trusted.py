"""The one trusted gate: every manifest and announcement a node believes passes through here.

Like python-tuf's ``TrustedMetadataSet``, :class:`TrustedSet` owns every trust decision about
control-plane data, so no caller can apply a weaker check than another: a manifest pushed over
HTTP, fetched after a poll, carried inline in a gossip announcement or read back from the store
at restart is judged by the same rules, in one order:

========================  ============================================  =====================
check                     refused with (named after the attack)         applies to
========================  ============================================  =====================
size, parse               EndlessDataAttackError, Malformed...Error     everything
signature threshold       Missing/Forged...SignatureError,              everything
                          UntrustedSignerError
swarm id                  WrongSwarmError                               everything
limits                    EndlessDataAttackError                        everything
expiry                    FreezeAttackError                             news (not the store)
offered digest            SubstitutedManifestError                      fetched by digest
newer than accepted       RollbackAttackError                           news (not the store)
  (or a record)
layout of accepted state  LayoutSwapAttackError                         news (not the store)
========================  ============================================  =====================

"News" is what a peer offers now; the store holds what this node accepted earlier, so at
restart its manifests are checked for authenticity (a data dir copied from another swarm, or
edited on disk, is not believed) but not for expiry or rollback (the log depends on them).

Rollback and layout are judged apart from authenticity: a genuine manifest that is stale, or
made for other tensors than the ones this node holds (weights are applied in place, so a
node can never switch layouts), is not news for this node, but the peer that relayed it did
nothing wrong (the trainer signed it). So gossip validation (:meth:`judge`) forwards it, and
a node does not ban the peer that offered it; it only declines it, before downloading a byte.

One kind of genuine manifest that is not newer is still kept: a *record*, an anchor (snapshot)
of a state this node has already accepted, the same version and the same signed state hash
(``recorded``: the node's store). The trainer builds anchors behind its head, so a rollout
following patches has usually applied a version before its anchor is out. Declining that
anchor as stale would leave the rollout's newest known anchor at the one it joined from, and
its store protects everything from there on (``Store.protected``): it would never evict. A
record is never planned from (it moves the weights nowhere: ``newer`` excludes it), so it
cannot roll the node back; it only says where a newcomer may start.

The gate holds no copy of the accepted state: it reads the version and layout through
``accepted`` and ``layout`` (the node's store), so it can never disagree with what the
weights hold. Sans-I/O: bytes and the caller's clock in, typed manifests or a named exception
out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from p2p_sync.errors import (
    LayoutSwapAttackError,
    RollbackAttackError,
    SubstitutedManifestError,
    WrongSwarmError,
)
from p2p_sync.trust import announce
from p2p_sync.trust.manifest import (
    SNAPSHOT,
    Manifest,
    ManifestLimits,
    SwarmPolicy,
    check_limits,
    check_signatures,
    parse,
    verify,
)


@dataclass(frozen=True)
class TrustLimits:
    """Every bound the gate enforces (manifests, announcements, peers' manifest indexes)."""

    manifest: ManifestLimits = field(default_factory=ManifestLimits)
    announce: announce.AnnounceLimits = field(default_factory=announce.AnnounceLimits)
    max_index_entries: int = 10_000  # entries of a peer's /manifests list looked at


class TrustedSet:
    """The trust decisions of one node about one swarm."""

    def __init__(
        self,
        policy: SwarmPolicy,
        accepted: Callable[[], int | None] = lambda: None,
        limits: TrustLimits = TrustLimits(),
        layout: Callable[[], str | None] = lambda: None,
        recorded: Callable[[int], str | None] = lambda version: None,
    ) -> None:
        self.policy, self.limits = policy, limits
        self._accepted, self._layout, self._recorded = accepted, layout, recorded

    @property
    def accepted_version(self) -> int | None:
        """The newest version this node accepted (None for a newcomer)."""
        return self._accepted()

    # ------------------------------------------------------------ single checks

    def is_newer(self, version: int) -> bool:
        """Whether ``version`` is past the accepted one (never roll back)."""
        floor = self.accepted_version
        return floor is None or version > floor

    def check_newer(self, m: Manifest) -> None:
        if not self.is_newer(m.version):
            raise RollbackAttackError(
                f"version {m.version} is not newer than accepted version {self.accepted_version}"
            )

    def fits_layout(self, m: Manifest) -> bool:
        """Whether ``m`` is for the tensors this node holds (any, while it holds none)."""
        held = self._layout()
        return held is None or m.layout == held

    def is_record(self, m: Manifest) -> bool:
        """Whether ``m`` is an anchor of a state this node accepted (see the module's
        docstring): a snapshot of a version it records, to the state hash it records there."""
        return m.kind == SNAPSHOT and self._recorded(m.version) == m.target_state

    def is_news(self, m: Manifest) -> bool:
        """Whether ``m`` is worth keeping: news (newer) or a record, for this node's tensors."""
        return (self.is_newer(m.version) or self.is_record(m)) and self.fits_layout(m)

    def check_news(self, m: Manifest) -> None:
        """Whether an authentic manifest is news for this node: newer (or a record), and for
        its tensors."""
        if not self.is_record(m):
            self.check_newer(m)
        if not self.fits_layout(m):
            raise LayoutSwapAttackError(
                f"manifest layout {m.layout[:16]} is not this node's {self._layout()}"
            )

    # ------------------------------------------------------------ manifests

    def authentic(self, data: bytes, now: float) -> Manifest:
        """Everything true of a manifest whatever this node holds: signatures, swarm, limits,
        expiry. Pure, so it may run in another thread (gossip validation)."""
        return verify(data, self.policy, now, None, self.limits.manifest)

    def admit(self, data: bytes, now: float, digest: str | None = None) -> Manifest:
        """A manifest offered as news (HTTP push or poll): authentic, the one asked for
        (``digest``; checked before news, as serving another one is the peer's doing even when
        that one is stale), newer than accepted and for this node's tensors."""
        m = self.authentic(data, now)
        if digest is not None and m.digest != digest:
            raise SubstitutedManifestError(
                f"served manifest {m.digest[:16]} under digest {digest[:16]}"
            )
        self.check_news(m)
        return m

    def admit_stored(self, data: bytes) -> Manifest:
        """A manifest read back from this node's store at restart: accepted before, so not
        judged on expiry, version or layout, but its signatures, swarm and limits must hold."""
        limits = self.limits.manifest
        m, sigs = parse(data, replace(limits, max_manifest_bytes=len(data)))
        check_signatures(m, sigs, self.policy)
        if m.swarm != self.policy.swarm_id:
            raise WrongSwarmError(f"stored manifest is for swarm {m.swarm[:16]}")
        check_limits(m, limits)
        return m

    def newer(self, manifests: Iterable[Manifest], than: int | None) -> list[Manifest]:
        """The manifests past version ``than`` (None: all): what a plan may start from."""
        return [m for m in manifests if than is None or m.version > than]

    # ------------------------------------------------------------ announcements and indexes

    def judge(self, data: bytes, now_ms: int, known: Callable[[str], bool]) -> announce.Decision:
        """A gossip message: authentic or not (gossipsub forwards what is accepted). Inline
        manifests get the same check as HTTP ones (:meth:`authentic`); whether they are news
        is :meth:`fresh_inline`'s question, asked on the node's thread: a genuine but stale
        announcement must not get its honest forwarder penalized."""
        return announce.judge(
            data,
            self.policy,
            now_ms,
            known,
            self.limits.announce,
            lambda raw: self.authentic(raw, now_ms / 1000),
        )

    def fresh_inline(self, decision: announce.Decision) -> list[tuple[Manifest, bytes]]:
        """The inline manifests of an accepted announcement that are news to this node."""
        return [(m, raw) for m, raw in decision.manifests if self.is_news(m)]

    def wanted(self, index: Any, known: Callable[[str], bool]) -> list[str]:
        """Digests in a peer's (untrusted) ``/manifests`` index worth fetching: well-formed,
        newer than accepted or an anchor of the accepted version, not already held. The
        fetched bytes then pass :meth:`admit` (which compares the anchor's state). Older
        records come only with announcements: asked for at every poll, an anchor the store
        has forgotten since (it is past it) would be fetched again and again."""
        if not isinstance(index, list):
            return []
        out = []
        for entry in index[: self.limits.max_index_entries]:
            if not isinstance(entry, dict) or not isinstance(entry.get("digest"), str):
                continue
            version = entry.get("version")
            if isinstance(version, int) and not isinstance(version, bool):
                record = (
                    version == self.accepted_version
                    and entry.get("kind") == SNAPSHOT
                    and self._recorded(version) is not None
                )
                if (self.is_newer(version) or record) and not known(entry["digest"]):
                    out.append(entry["digest"])
        return out
