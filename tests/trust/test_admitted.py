"""The verdict on an admission a libp2p peer shows, for the peer id its connection
authenticated, and the table of admitted and refused peers (``p2p_sync.trust.admitted``)."""

from __future__ import annotations

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.peer.id import ID

from p2p_sync.errors import (
    ExpiredAdmissionError,
    ImpostorError,
    NotAMemberError,
    RevokedMemberError,
)
from p2p_sync.trust.admitted import PeerAdmissions, verdict
from p2p_sync.trust.membership import Membership, MembershipLimits
from tests.privateswarm import Swarm


def _table(swarm: Swarm, **limits: float) -> PeerAdmissions:
    return PeerAdmissions(Membership(swarm.ca, swarm.crl, swarm.now, MembershipLimits(**limits)))


def test_an_admission_counts_only_for_the_peer_id_it_binds() -> None:
    swarm = Swarm()
    alice, bob = swarm.admit(), swarm.admit()
    membership = Membership(swarm.ca, swarm.crl, swarm.now)
    assert verdict(membership, alice.peer_id, alice.admission, swarm.now).peer_id == alice.peer_id
    with pytest.raises(ImpostorError):  # bob's connection showing alice's admission
        verdict(membership, bob.peer_id, alice.admission, swarm.now)
    other = str(ID.from_pubkey(create_new_key_pair().public_key))  # a secp256k1 identity
    with pytest.raises(NotAMemberError, match="no Ed25519 identity"):
        verdict(membership, other, alice.admission, swarm.now)


def test_a_refused_peer_is_kept_out_for_refused_s_then_may_try_again() -> None:
    swarm = Swarm()
    alice, stranger = swarm.admit(), Swarm().admit()  # the stranger's CA is another
    table = _table(swarm, refused_s=60.0)
    with pytest.raises(NotAMemberError):
        table.judge(stranger.peer_id, stranger.admission, swarm.now)
    with pytest.raises(NotAMemberError):  # kept out, whatever it shows meanwhile
        table.member(stranger.peer_id, swarm.now + 59)
    assert table.refused(stranger.peer_id, swarm.now + 61) is None
    assert table.member(alice.peer_id, swarm.now) is None  # showed nothing yet: pending
    table.judge(alice.peer_id, alice.admission, swarm.now)
    assert table.member(alice.peer_id, swarm.now) is not None
    assert table.admitted() == [alice.peer_id]


def test_an_admitted_peer_lapses_once_revoked_or_expired() -> None:
    swarm = Swarm()
    alice, bob = swarm.admit(days=1.0), swarm.admit(days=10.0)
    table = _table(swarm)
    for m in (alice, bob):
        table.judge(m.peer_id, m.admission, swarm.now)
    assert table.lapsed(swarm.now) == []
    table.membership.update_revocations(swarm.revoke(bob), swarm.now)
    later = swarm.now + 2 * 86400 + 600  # alice's day and the clock skew are over
    lapsed = dict(table.lapsed(later))
    assert isinstance(lapsed[alice.peer_id], ExpiredAdmissionError)
    assert isinstance(lapsed[bob.peer_id], RevokedMemberError)
    assert table.admitted() == [] and table.refused(bob.peer_id, later) is not None


def test_the_tables_are_bounded() -> None:
    swarm = Swarm()
    members = [swarm.admit() for _ in range(5)]
    table = _table(swarm, peers=3)
    for m in members:
        table.judge(m.peer_id, m.admission, swarm.now)
    assert table.admitted() == [m.peer_id for m in members[-3:]]
