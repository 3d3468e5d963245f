"""Ed25519 signing keys: generate, store, load, and name them.

A trainer signs manifests with its private key; every peer pins the public key(s) of the swarm.
A public key travels as one line of text, ``ed25519:<64 hex digits>``, easy to paste into a
config. A key id is the SHA-256 of the raw 32-byte public key, in hex: stable, and the same
key always counts once however it is written.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p_sync.errors import KeyFileError  # noqa: F401 (re-exported)

PREFIX = "ed25519:"


@dataclass(frozen=True)
class PublicKey:
    """A raw 32-byte Ed25519 public key."""

    raw: bytes

    def __post_init__(self) -> None:
        if len(self.raw) != 32:
            raise KeyFileError(f"an Ed25519 public key is 32 bytes, got {len(self.raw)}")

    @property
    def keyid(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    def text(self) -> str:
        return PREFIX + self.raw.hex()

    def verify(self, signature: bytes, message: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True

    @classmethod
    def from_text(cls, text: str) -> PublicKey:
        text = text.strip()
        if not text.startswith(PREFIX):
            raise KeyFileError(f"public key must look like '{PREFIX}<64 hex digits>'")
        try:
            return cls(bytes.fromhex(text[len(PREFIX) :]))
        except ValueError:
            raise KeyFileError("public key is not valid hex") from None


@dataclass(frozen=True)
class SigningKey:
    """An Ed25519 private key (the trainer's)."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public(self) -> PublicKey:
        raw = self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return PublicKey(raw)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def pem(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def write_keypair(key: SigningKey, path: str | os.PathLike[str], force: bool = False) -> Path:
    """Write ``path`` (private, mode 0600) and ``path.pub`` (one line); returns the .pub path."""
    path = Path(path)
    pub = path.with_name(path.name + ".pub")
    if not force:
        for p in (path, pub):
            if p.exists():
                raise KeyFileError(f"{p} exists; pass --force to overwrite it")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.pem())
    os.chmod(path, 0o600)  # also when the file existed with looser bits
    pub.write_text(key.public.text() + "\n")
    return pub


def load_signing_key(path: Path) -> SigningKey:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key ({exc.strerror})") from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise KeyFileError(f"{path}: not an unencrypted PEM private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: not an Ed25519 key")
    return SigningKey(private)


def load_public_key(text_or_path: str) -> PublicKey:
    """A public key from its text (``ed25519:...``) or from a file holding that text."""
    if text_or_path.strip().startswith(PREFIX):
        return PublicKey.from_text(text_or_path)
    path = Path(text_or_path)
    try:
        return PublicKey.from_text(path.read_text())
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read public key ({exc.strerror})") from None
