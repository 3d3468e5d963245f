"""A private swarm for tests: a real admin key, CA, revocation list and admitted identities,
written to files as ``p2psync swarm init`` and ``p2psync admit`` write them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_sync.transport.tls import PrivateSwarmFiles
from p2p_sync.trust import admissions
from p2p_sync.trust.membership import peer_id_of


def raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass
class Identity:
    """A node's identity key and the admission it holds."""

    key: Ed25519PrivateKey
    admission: bytes

    @property
    def peer_id(self) -> str:
        return peer_id_of(raw_public(self.key))


@dataclass
class Swarm:
    """An admin key and its swarm's CA and current revocation list."""

    swarm_id: str = "ab" * 32
    admin: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    now: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.ca = admissions.create_swarm_ca(self.admin, self.swarm_id, self.now)
        self.crl = admissions.revocations(self.admin, self.ca, [], 1, self.now)

    def admit(self, days: float = 1.0, at: float | None = None) -> Identity:
        key = Ed25519PrivateKey.generate()
        when = self.now if at is None else at
        return Identity(key, admissions.admit(self.admin, self.ca, raw_public(key), when, days))

    def revoke(self, member: Identity) -> bytes:
        self.crl = admissions.revoke(self.admin, self.ca, self.crl, member.admission, self.now)
        return self.crl

    def files(self, where: Path, member: Identity) -> PrivateSwarmFiles:
        """The swarm's files as a member node holds them, under ``where``."""
        where.mkdir(parents=True, exist_ok=True)
        files = PrivateSwarmFiles(where / "ca.pem", where / "admission.pem", where / "crl.pem")
        files.ca.write_bytes(self.ca)
        files.admission.write_bytes(member.admission)
        files.revocations.write_bytes(self.crl)
        return files
