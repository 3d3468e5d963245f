"""What a private swarm's admin signs: the swarm CA, admissions and revocation lists.

All three are standard X.509 objects built with ``cryptography``'s builders and signed by the
admin's Ed25519 key, so OpenSSL checks them in mutual TLS and ``openssl x509 -text`` reads
them. :mod:`p2p_sync.trust.membership` says what they mean and judges them. I/O-free: keys,
certificates and the time come in as values, PEM bytes go out.
"""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from p2p_sync.errors import OverlongAdmissionError
from p2p_sync.trust.membership import (
    CA_ORGANIZATION,
    MembershipLimits,
    load_certificate,
    member_uri,
    peer_id_of,
    swarm_of_ca,
)

CA_DAYS = 3650.0
CRL_DAYS = 30.0  # a list's nextUpdate; nodes keep the newest list they hold regardless
PEM = serialization.Encoding.PEM


def _when(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.UTC)


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def create_swarm_ca(admin: Ed25519PrivateKey, swarm_id: str, now: float) -> bytes:
    """The swarm's self-signed CA certificate (PEM): the only trust anchor of its TLS."""
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, CA_ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, swarm_id),
        ]
    )
    public = admin.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_when(now - 60))
        .not_valid_after(_when(now + CA_DAYS * 86400))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(admin, None)
    )
    return cert.public_bytes(PEM)


def _member_builder(
    ca: x509.Certificate, peer_id: str, node_key: bytes, now: float, days: float
) -> x509.CertificateBuilder:
    """An admission's names, key, serial and validity (a minute back: clocks differ)."""
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, peer_id)]))
        .issuer_name(ca.subject)
        .public_key(Ed25519PublicKey.from_public_bytes(node_key))
        .serial_number(x509.random_serial_number())
        .not_valid_before(_when(now - 60))
        .not_valid_after(_when(now - 60 + days * 86400))
    )


def _check_days(days: float, limits: MembershipLimits) -> None:
    if not 0 < days <= limits.max_admission_days:
        raise OverlongAdmissionError(
            f"an admission lasts more than 0 and at most {limits.max_admission_days:g} days"
        )


def admit(
    admin: Ed25519PrivateKey,
    ca_pem: bytes,
    node_key: bytes,
    now: float,
    days: float,
    limits: MembershipLimits | None = None,
) -> bytes:
    """An admission (PEM) for the node whose raw Ed25519 identity key is ``node_key``,
    valid from now for ``days``; OverlongAdmissionError past the swarm's limit."""
    limits = limits or MembershipLimits()
    _check_days(days, limits)
    ca = load_certificate(ca_pem, limits.max_admission_bytes)
    peer_id = peer_id_of(node_key)
    san = x509.UniformResourceIdentifier(member_uri(swarm_of_ca(ca), peer_id))
    cert = (
        _member_builder(ca, peer_id, node_key, now, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .sign(admin, None)
    )
    return cert.public_bytes(PEM)


def revocations(
    admin: Ed25519PrivateKey,
    ca_pem: bytes,
    serials: list[int],
    number: int,
    now: float,
    after: float = 0.0,
) -> bytes:
    """A revocation list (PEM) numbered ``number`` naming ``serials``: an empty one for a
    new swarm (OpenSSL's CRL check wants one), a longer one per revocation. Its lastUpdate
    is at least a second past ``after`` (the list it replaces): OpenSSL, holding two lists of
    an issuer, takes the one updated last."""
    ca = load_certificate(ca_pem, MembershipLimits().max_admission_bytes)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.subject)
        .last_update(_when(max(now - 60, after + 1)))
        .next_update(_when(now + CRL_DAYS * 86400))
        .add_extension(x509.CRLNumber(number), critical=False)
    )
    for serial in sorted(set(serials)):
        entry = (
            x509.RevokedCertificateBuilder()
            .serial_number(serial)
            .revocation_date(_when(now))
            .build()
        )
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(admin, None).public_bytes(PEM)


def revoke(
    admin: Ed25519PrivateKey, ca_pem: bytes, crl_pem: bytes, admission: bytes, now: float
) -> bytes:
    """``crl_pem`` with ``admission``'s serial added, numbered one higher."""
    crl = x509.load_pem_x509_crl(crl_pem)
    number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    serial = load_certificate(admission, MembershipLimits().max_admission_bytes).serial_number
    held = [r.serial_number for r in crl]
    after = crl.last_update_utc.timestamp()
    return revocations(admin, ca_pem, [*held, serial], int(number) + 1, now, after)
