"""Who may take part in a private swarm: the one gate every admission passes.

A private swarm has an admin key (Ed25519; the trainer's, or one it trusts) acting as a
certificate authority. Its self-signed CA certificate names the swarm id; an *admission* is
an X.509 certificate it signs whose subject public key is a node's libp2p identity key
(Ed25519), with ``p2psync:<swarm id>/<peer id>`` as its only URI SAN and notBefore/notAfter
as its validity. Revocation is a CRL the admin key signs.

Why X.509: OpenSSL's mutual TLS then checks membership, expiry, the swarm (another CA) and
possession of the identity key (TLS 1.3's CertificateVerify signs the fresh handshake
transcript: a copied admission without its key fails) on every connection, with no crypto
written here. :class:`Membership` re-checks an admission the TLS layer accepted on every
request, so a member revoked or expired after its connection opened is refused from its next
request on. It is I/O-free: certificates, lists and the time come in as values.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import base58
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.utils import CryptographyDeprecationWarning

from p2p_sync.errors import (
    ExpiredAdmissionError,
    ForeignSwarmError,
    ForgedRevocationListError,
    ImpostorError,
    MalformedAdmissionError,
    NotAMemberError,
    OverlongAdmissionError,
    RevokedMemberError,
)

URI_PREFIX = "p2psync:"
CA_ORGANIZATION = "p2psync swarm"  # a swarm CA's subject: this and the swarm id as CN
ED25519_ALGORITHM = bytes.fromhex("300506032b6570")  # AlgorithmIdentifier {id-Ed25519}
# a libp2p peer id of an Ed25519 key: identity multihash (0x00, 36 bytes) of the protobuf
# PublicKey {Type: Ed25519 (1), Data: 32 bytes}
_PEER_ID_HEAD = b"\x00\x24\x08\x01\x12\x20"


@dataclass(frozen=True)
class MembershipLimits:
    """Bounds on admissions and revocation lists (TOML ``[membership]``)."""

    max_admission_days: float = 400.0  # a leaked node key is useful at most this long
    clock_skew_s: float = 300.0  # tolerated difference between the admin's and a node's clock
    max_admission_bytes: int = 16_384
    max_revocations_bytes: int = 4 << 20
    parsed_cache: int = 4096  # admissions remembered parsed (one per member connection)
    # libp2p (``p2p_sync.trust.admitted``): a peer connected that has not shown a valid
    # admission within this long is disconnected; a refused peer id is kept out this long
    admission_timeout_s: float = 5.0
    refused_s: float = 60.0
    peers: int = 4096  # admitted and refused peer ids remembered


@dataclass(frozen=True)
class Member:
    """An admission that passed the gate: whose it is and until when."""

    peer_id: str
    serial: int
    not_after: float


def peer_id_of(raw_public: bytes) -> str:
    """The libp2p peer id (``12D3KooW...``) of a raw 32-byte Ed25519 public key."""
    return base58.b58encode(_PEER_ID_HEAD + raw_public).decode()


def key_of_peer_id(peer_id: str) -> bytes:
    """The raw Ed25519 public key a peer id inlines; ValueError if it inlines none."""
    try:
        data = base58.b58decode(peer_id.strip())
    except ValueError:
        raise ValueError(f"{peer_id!r} is not a base58 peer id") from None
    if len(data) != 38 or not data.startswith(_PEER_ID_HEAD):
        raise ValueError(f"{peer_id!r} is not the peer id of an Ed25519 identity key")
    return data[len(_PEER_ID_HEAD) :]


def member_uri(swarm_id: str, peer_id: str) -> str:
    return f"{URI_PREFIX}{swarm_id}/{peer_id}"


def raw_key(cert: x509.Certificate) -> bytes:
    """The certificate's Ed25519 public key, raw; MalformedAdmissionError for another type."""
    key = cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise MalformedAdmissionError("an admission's key must be Ed25519")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_certificate(data: bytes, limit: int) -> x509.Certificate:
    """A certificate from PEM or DER bytes; MalformedAdmissionError if it is not one."""
    if len(data) > limit:
        raise MalformedAdmissionError(f"admission of {len(data)} bytes over {limit}")
    try:
        with warnings.catch_warnings():  # what cryptography still takes with a warning
            warnings.simplefilter("error", CryptographyDeprecationWarning)  # (a serial <= 0)
            if data.lstrip().startswith(b"-----BEGIN"):
                cert = x509.load_pem_x509_certificate(data)
            else:
                cert = x509.load_der_x509_certificate(data)
    except (ValueError, x509.InvalidVersion, CryptographyDeprecationWarning) as exc:
        raise MalformedAdmissionError(f"not an X.509 certificate ({exc})") from None
    if cert.public_bytes(serialization.Encoding.DER) != _canonical(cert):
        raise MalformedAdmissionError("admission not in its one DER encoding")
    return cert


def _canonical(cert: x509.Certificate) -> bytes:
    """The DER a certificate signed with Ed25519 has: its signed part, the algorithm and the
    signature with no unused bits. The signature covers only the first, so a parser's
    leniency on the rest (a signature's unused-bits count) would give one admission several
    encodings; only this one is taken."""
    signature = b"\x03" + _der_length(len(cert.signature) + 1) + b"\x00" + cert.signature
    body = cert.tbs_certificate_bytes + ED25519_ALGORITHM + signature
    return b"\x30" + _der_length(len(body)) + body


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def swarm_of_ca(ca: x509.Certificate) -> str:
    """The swarm id a CA certificate names (its subject's common name)."""
    names = ca.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    if len(names) != 1:
        raise MalformedAdmissionError("a swarm CA names its swarm in one common name")
    return str(names[0].value)


class Membership:
    """The swarm's CA and current revocation list; :meth:`check` judges an admission."""

    def __init__(
        self, ca_pem: bytes, crl_pem: bytes, now: float, limits: MembershipLimits | None = None
    ) -> None:
        self.limits = limits or MembershipLimits()
        self.ca = load_certificate(ca_pem, self.limits.max_admission_bytes)
        self.ca_pem, self.swarm_id = ca_pem, swarm_of_ca(self.ca)
        self.crl_pem, self.crl_number, self._revoked = b"", -1, frozenset[int]()
        self._parsed: dict[bytes, tuple[int, float, float, str]] = {}
        self.update_revocations(crl_pem, now)

    def update_revocations(self, crl_pem: bytes, now: float) -> bool:
        """Adopt a newer revocation list signed by the admin key; False if it is the one
        held. ForgedRevocationListError for a bad signature, another issuer or a rollback."""
        crl = self._load_crl(crl_pem)
        number = _crl_number(crl)
        if number < self.crl_number:
            raise ForgedRevocationListError(
                f"revocation list {number} is older than the one held ({self.crl_number})"
            )
        if number == self.crl_number:
            return False
        self.crl_pem, self.crl_number = crl_pem, number
        self._revoked = frozenset(r.serial_number for r in crl)
        return True

    def _load_crl(self, crl_pem: bytes) -> x509.CertificateRevocationList:
        if len(crl_pem) > self.limits.max_revocations_bytes:
            raise ForgedRevocationListError("revocation list over its size limit")
        try:
            crl = x509.load_pem_x509_crl(crl_pem)
        except ValueError as exc:
            raise ForgedRevocationListError(f"not a revocation list ({exc})") from None
        if crl.issuer != self.ca.subject or not crl.is_signature_valid(self.ca.public_key()):
            raise ForgedRevocationListError("revocation list not signed by this swarm's admin")
        return crl

    def check(self, admission: bytes | None, now: float, presenter: bytes | None = None) -> Member:
        """The member ``admission`` (PEM or DER) admits now, else the error naming why.
        ``presenter``: the raw public key that proved possession (the TLS layer's peer);
        an admission of another key is an impostor's."""
        if not admission:
            raise NotAMemberError("no admission presented")
        serial, not_before, not_after, peer_id = self._parse(admission)
        skew = self.limits.clock_skew_s
        if now + skew < not_before or now - skew > not_after:
            raise ExpiredAdmissionError(f"admission of {peer_id} is not valid now")
        if serial in self._revoked:
            raise RevokedMemberError(f"admission of {peer_id} is revoked")
        if presenter is not None and peer_id_of(presenter) != peer_id:
            raise ImpostorError(f"admission of {peer_id} presented by another identity")
        return Member(peer_id, serial, not_after)

    def _parse(self, admission: bytes) -> tuple[int, float, float, str]:
        """What a well-formed admission of this swarm says, once per distinct admission."""
        found = self._parsed.get(admission)
        if found is None:
            cert = load_certificate(admission, self.limits.max_admission_bytes)
            try:
                found = self._judge(cert)
            except ValueError as exc:  # a field parsed on first use (cryptography is lazy)
                raise MalformedAdmissionError(f"malformed admission ({exc})") from None
            if len(self._parsed) >= self.limits.parsed_cache:
                self._parsed.clear()
            self._parsed[admission] = found
        return found

    def _judge(self, cert: x509.Certificate) -> tuple[int, float, float, str]:
        """Issuer, signature, swarm, key binding and lifetime: what never changes."""
        if cert.issuer != self.ca.subject:
            raise _wrong_issuer(cert, self.swarm_id)
        try:
            cert.verify_directly_issued_by(self.ca)
        except (ValueError, TypeError, InvalidSignature):
            raise NotAMemberError("admission not signed by this swarm's admin") from None
        swarm, peer_id = _bound_identity(cert)
        if swarm != self.swarm_id:
            raise ForeignSwarmError(f"admission for swarm {swarm[:16]}")
        if peer_id_of(raw_key(cert)) != peer_id:
            raise ImpostorError(f"admission names {peer_id} but binds another key")
        not_before = cert.not_valid_before_utc.timestamp()
        not_after = cert.not_valid_after_utc.timestamp()
        if not_after - not_before > self.limits.max_admission_days * 86400:
            raise OverlongAdmissionError(f"admission of {peer_id} lasts over the limit")
        return cert.serial_number, not_before, not_after, peer_id


def _wrong_issuer(cert: x509.Certificate, swarm_id: str) -> Exception:
    """ForeignSwarmError for another swarm's CA, else NotAMemberError."""
    names = cert.issuer.get_attributes_for_oid(x509.NameOID.ORGANIZATION_NAME)
    if names and names[0].value == CA_ORGANIZATION:
        return ForeignSwarmError("admission issued by another swarm's admin")
    return NotAMemberError("admission not issued by this swarm's admin")


def _bound_identity(cert: x509.Certificate) -> tuple[str, str]:
    """(swarm id, peer id) of the admission's one ``p2psync:`` URI SAN."""
    try:
        san: Any = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        raise MalformedAdmissionError("admission names no identity") from None
    uris = [u for u in san.value.get_values_for_type(x509.UniformResourceIdentifier)]
    if len(uris) != 1 or not uris[0].startswith(URI_PREFIX) or "/" not in uris[0]:
        raise MalformedAdmissionError("admission must name one p2psync:<swarm>/<peer> URI")
    swarm, _, peer_id = uris[0].removeprefix(URI_PREFIX).partition("/")
    return swarm, peer_id


def _crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        raise ForgedRevocationListError("revocation list carries no number") from None
