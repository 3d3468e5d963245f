"""The membership gate of private swarms, I/O-free: each attack on an admission or a
revocation list gets its own named refusal (table-driven, as python-tuf's ngclient tests)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.errors import (
    ExpiredAdmissionError,
    ForeignSwarmError,
    ForgedRevocationListError,
    ImpostorError,
    MalformedAdmissionError,
    MembershipError,
    NotAMemberError,
    OverlongAdmissionError,
    RevokedMemberError,
)
from p2p_sync.trust import admissions
from p2p_sync.trust.membership import (
    Membership,
    MembershipLimits,
    key_of_peer_id,
    member_uri,
    peer_id_of,
)
from tests.privateswarm import Identity, Swarm, raw_public

DAY = 86400.0
SWARM = Swarm()
MEMBER = SWARM.admit()


def _gate(swarm: Swarm = SWARM) -> Membership:
    return Membership(swarm.ca, swarm.crl, swarm.now)


def _misbound(swarm: Swarm) -> bytes:
    """An admission the admin signed naming one peer id over another identity's key."""
    ca = x509.load_pem_x509_certificate(swarm.ca)
    other = Ed25519PrivateKey.generate()
    uri = member_uri(swarm.swarm_id, MEMBER.peer_id)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "x")]))
        .issuer_name(ca.subject)
        .public_key(other.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(dt.datetime.fromtimestamp(swarm.now - 60, dt.UTC))
        .not_valid_after(dt.datetime.fromtimestamp(swarm.now + DAY, dt.UTC))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False
        )
        .sign(swarm.admin, None)
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def _revoked() -> tuple[Membership, bytes]:
    swarm = Swarm()
    member = swarm.admit()
    swarm.revoke(member)
    return _gate(swarm), member.admission


def _impersonated_ca() -> bytes:
    """A CA of the same name (same swarm id) under another key: a forged admission."""
    return Swarm(swarm_id=SWARM.swarm_id).admit().admission


def _expired() -> bytes:
    return SWARM.admit(days=1.0, at=SWARM.now - 3 * DAY).admission


def _not_yet() -> bytes:
    return SWARM.admit(days=1.0, at=SWARM.now + 2 * DAY).admission


# (attack, the admission presented, the identity that presents it, expected refusal)
ATTACKS: list[tuple[str, Callable[[], bytes | None], bytes | None, type[Exception]]] = [
    ("a non-member with no admission", lambda: None, None, NotAMemberError),
    ("an expired admission", _expired, None, ExpiredAdmissionError),
    ("an admission not yet valid", _not_yet, None, ExpiredAdmissionError),
    (
        "another swarm's admission",
        lambda: Swarm(swarm_id="ef" * 32).admit().admission,
        None,
        ForeignSwarmError,
    ),
    (
        "the same admin's admission for another swarm",
        lambda: Swarm(swarm_id="cd" * 32, admin=SWARM.admin).admit().admission,
        None,
        ForeignSwarmError,
    ),
    ("an admission signed by an impostor CA", _impersonated_ca, None, NotAMemberError),
    (
        "a member's admission replayed by another identity",
        lambda: MEMBER.admission,
        raw_public(Ed25519PrivateKey.generate()),
        ImpostorError,
    ),
    (
        "an admission naming a peer id over another key",
        lambda: _misbound(SWARM),
        None,
        ImpostorError,
    ),
    (
        "bytes that are no certificate",
        lambda: b"\x30\x03\x02\x01\x01",
        None,
        MalformedAdmissionError,
    ),
]


@pytest.mark.parametrize(
    ("admission", "presenter", "refusal"),
    [row[1:] for row in ATTACKS],
    ids=[row[0] for row in ATTACKS],
)
def test_each_attack_on_an_admission_is_refused_by_name(
    admission: Callable[[], bytes | None], presenter: bytes | None, refusal: type[Exception]
) -> None:
    with pytest.raises(refusal):
        _gate().check(admission(), SWARM.now, presenter)


def test_a_member_is_admitted_as_its_peer_id_over_pem_and_der() -> None:
    gate = _gate()
    der = x509.load_pem_x509_certificate(MEMBER.admission).public_bytes(serialization.Encoding.DER)
    for form in (MEMBER.admission, der):
        member = gate.check(form, SWARM.now, raw_public(MEMBER.key))
        assert member.peer_id == MEMBER.peer_id
        assert member.not_after > SWARM.now


def test_a_revoked_member_is_refused_once_the_newer_list_is_adopted() -> None:
    swarm = Swarm()
    member = swarm.admit()
    gate = _gate(swarm)
    assert gate.check(member.admission, swarm.now).peer_id == member.peer_id
    assert gate.update_revocations(swarm.revoke(member), swarm.now)
    with pytest.raises(RevokedMemberError):
        gate.check(member.admission, swarm.now)
    gate, admission = _revoked()
    with pytest.raises(RevokedMemberError):
        gate.check(admission, swarm.now)


def test_an_admission_expires_within_the_clock_skew_and_not_before() -> None:
    limits = MembershipLimits(clock_skew_s=300)
    gate = Membership(SWARM.ca, SWARM.crl, SWARM.now, limits)
    member = gate.check(MEMBER.admission, SWARM.now)
    gate.check(MEMBER.admission, member.not_after + 299)
    with pytest.raises(ExpiredAdmissionError):
        gate.check(MEMBER.admission, member.not_after + 301)


def test_an_admission_longer_than_the_limit_is_neither_issued_nor_accepted() -> None:
    with pytest.raises(OverlongAdmissionError):
        admissions.admit(SWARM.admin, SWARM.ca, raw_public(MEMBER.key), SWARM.now, 401.0)
    long = SWARM.admit(days=30.0).admission
    strict = Membership(SWARM.ca, SWARM.crl, SWARM.now, MembershipLimits(max_admission_days=7))
    with pytest.raises(OverlongAdmissionError):
        strict.check(long, SWARM.now)


def test_a_forged_or_older_revocation_list_is_refused_and_the_held_one_stays() -> None:
    swarm = Swarm()
    member = swarm.admit()
    gate = _gate(swarm)
    first = swarm.crl
    newer = swarm.revoke(member)
    forged = admissions.revocations(Ed25519PrivateKey.generate(), swarm.ca, [], 9, swarm.now)
    with pytest.raises(ForgedRevocationListError):
        gate.update_revocations(forged, swarm.now)
    assert gate.update_revocations(newer, swarm.now)
    with pytest.raises(ForgedRevocationListError):  # a rollback would re-admit the revoked
        gate.update_revocations(first, swarm.now)
    assert not gate.update_revocations(newer, swarm.now)
    with pytest.raises(RevokedMemberError):
        gate.check(member.admission, swarm.now)
    with pytest.raises(ForgedRevocationListError):
        gate.update_revocations(b"-----BEGIN X509 CRL-----\nnot one\n", swarm.now)


def test_a_peer_id_is_libp2ps_and_inlines_its_key() -> None:
    from libp2p.crypto.ed25519 import Ed25519PublicKey as Libp2pKey
    from libp2p.peer.id import ID
    from nacl.signing import VerifyKey

    raw = raw_public(MEMBER.key)
    assert peer_id_of(raw) == str(ID.from_pubkey(Libp2pKey(VerifyKey(raw))))
    assert key_of_peer_id(MEMBER.peer_id) == raw
    for bad in ("", "0OIl", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"):  # not Ed25519
        with pytest.raises(ValueError):
            key_of_peer_id(bad)


DER = x509.load_pem_x509_certificate(MEMBER.admission).public_bytes(serialization.Encoding.DER)


@settings(max_examples=300, deadline=None)
@given(at=st.integers(0, len(DER) - 1), flip=st.integers(1, 255))
def test_any_tampered_admission_byte_is_refused_with_a_named_error(at: int, flip: int) -> None:
    tampered = bytearray(DER)
    tampered[at] ^= flip
    with pytest.raises(MembershipError):
        _gate().check(bytes(tampered), SWARM.now)


@pytest.mark.parametrize("unused", range(1, 8))
def test_a_signatures_unused_bits_count_gives_no_second_encoding(unused: int) -> None:
    """The byte before the signature (a BIT STRING's unused-bits count) is outside what the
    admin signed; parsers take some values of it when the signature's last bits are zero."""
    tampered = bytearray(DER)
    assert tampered[-65] == 0 and tampered[-67:-65] == b"\x03\x41"
    tampered[-65] = unused
    tampered[-1] &= 0xFF << unused & 0xFF  # those bits zero: a parser's leniency would take it
    with pytest.raises(MalformedAdmissionError):
        _gate().check(bytes(tampered), SWARM.now)


def test_a_serial_number_below_one_is_malformed_not_a_warning() -> None:
    """RFC 5280 serials are positive; cryptography still parses others, with a deprecation
    warning. An admission is refused as malformed before its signature is even looked at."""
    version = b"\xa0\x03\x02\x01\x02"  # [0] v3, then the serial's INTEGER
    at = DER.index(version) + len(version)
    assert DER[at] == 0x02 and DER[at + 2] < 0x80
    tampered = bytearray(DER)
    tampered[at + 2] |= 0x80  # the serial's sign bit: a negative serial
    with pytest.raises(MalformedAdmissionError, match="not an X.509 certificate"):
        _gate().check(bytes(tampered), SWARM.now)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_are_never_an_admission(data: bytes) -> None:
    with pytest.raises(MembershipError):
        _gate().check(data, SWARM.now)


def test_an_admission_over_the_size_limit_is_refused_before_parsing() -> None:
    with pytest.raises(MalformedAdmissionError):
        _gate().check(b"\x30" * (MembershipLimits().max_admission_bytes + 1), SWARM.now)


def test_identity_helper_names_its_peer_id() -> None:
    member: Identity = SWARM.admit()
    assert member.peer_id.startswith("12D3KooW")
