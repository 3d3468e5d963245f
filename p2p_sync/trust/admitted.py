"""Which libp2p peers are members: the verdict on an admission shown over an authenticated
connection, and the table of peers admitted and refused.

A libp2p connection authenticates its remote peer id (Noise: the handshake signs a fresh
static key with the identity key the peer id inlines, so the proof is fresh per connection
and a relay, which carries only ciphertext, has nothing to replay). A member then shows its
admission (``p2p_sync.trust.membership``) over that connection; it counts only if the
admission binds the very key the authenticated peer id names (else ``ImpostorError``: a
copied admission). :class:`PeerAdmissions` remembers the admission of each admitted peer and
judges it again on every use against the current time and revocation list, and keeps a
refused peer id out for ``refused_s``. I/O-free: peer ids, bytes and the time come in as
values; the wire is ``p2p_sync.transport.p2p_gate``'s.
"""

from __future__ import annotations

from p2p_sync.bounded import remember
from p2p_sync.errors import MembershipError, NotAMemberError
from p2p_sync.trust.membership import Member, Membership, key_of_peer_id


def verdict(membership: Membership, peer_id: str, admission: bytes, now: float) -> Member:
    """The member ``peer_id`` is, judged by the admission it showed; the membership error
    naming why not (an admission of another identity: ``ImpostorError``)."""
    try:
        presenter = key_of_peer_id(peer_id)
    except ValueError:  # an RSA or secp256k1 identity: no admission can bind it
        raise NotAMemberError(f"{peer_id[:16]} has no Ed25519 identity") from None
    return membership.check(admission, now, presenter)


class PeerAdmissions:
    """Admitted peers (peer id -> the admission they showed) and refused ones (peer id ->
    until when, and why); each bounded to ``limits.peers`` entries, oldest forgotten."""

    def __init__(self, membership: Membership) -> None:
        self.membership, self.limits = membership, membership.limits
        self._admitted: dict[str, bytes] = {}
        self._refused: dict[str, tuple[float, MembershipError]] = {}

    def judge(self, peer_id: str, admission: bytes, now: float) -> Member:
        """Admit ``peer_id`` on ``admission``, or refuse it (kept out) and raise why."""
        try:
            member = verdict(self.membership, peer_id, admission, now)
        except MembershipError as exc:
            self.refuse(peer_id, exc, now)
            raise
        self._refused.pop(peer_id, None)
        remember(self._admitted, peer_id, admission, self.limits.peers)
        return member

    def member(self, peer_id: str, now: float) -> Member | None:
        """The member ``peer_id`` is now (its admission judged again: it may have expired
        or been revoked since); None while it has shown none. Raises the membership error
        of a refused peer (refused now, or earlier and still kept out)."""
        refused = self.refused(peer_id, now)
        if refused is not None:
            raise refused
        admission = self._admitted.get(peer_id)
        return None if admission is None else self.judge(peer_id, admission, now)

    def refuse(self, peer_id: str, why: MembershipError, now: float) -> None:
        """Keep ``peer_id`` out for ``refused_s`` (and forget any admission it showed)."""
        self._admitted.pop(peer_id, None)
        remember(self._refused, peer_id, (now + self.limits.refused_s, why), self.limits.peers)

    def refused(self, peer_id: str, now: float) -> MembershipError | None:
        """Why ``peer_id`` is kept out now; None if it is not."""
        entry = self._refused.get(peer_id)
        if entry is None:
            return None
        until, why = entry
        if now >= until:
            del self._refused[peer_id]
            return None
        return why

    def admitted(self) -> list[str]:
        """The peer ids admitted (their admissions not judged again here)."""
        return list(self._admitted)

    def lapsed(self, now: float) -> list[tuple[str, MembershipError]]:
        """Admitted peers whose admission no longer holds (expired, revoked since), each
        refused now, with why."""
        out: list[tuple[str, MembershipError]] = []
        for peer_id in self.admitted():
            try:
                self.member(peer_id, now)
            except MembershipError as exc:
                out.append((peer_id, exc))
        return out
