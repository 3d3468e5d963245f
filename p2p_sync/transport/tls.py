"""TLS for a private swarm's data plane: contexts from a node's admission, and the per-request
membership check.

A private node serves HTTPS with its admission (``p2p_sync.trust.admissions``) as its
certificate and its libp2p identity key as the certificate's key, and asks every client for
its own: OpenSSL (via ``ssl``) accepts only certificates under the swarm's CA that the loaded
revocation list does not name, TLS 1.3 only, and a client without one still connects so it can
get a bare health answer. The client side presents its admission and trusts the swarm CA alone
(no public CA, no host names: the admission is the server's identity).

Every request is judged again by :class:`SwarmTls` (``p2p_sync.trust.membership``): the
revocation list file is re-read when it changes, so a member revoked or expired while its
keep-alive connection is open is refused from its next request on. The client side looks at
the file before each request too, so it opens no new connection to a revoked server. A newer
list also arrives with announcements (every private node's carry the list it holds) and is
adopted from there when the admin signed it: revocation spreads as fast as a version does.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_sync.errors import ConfigError, ImpostorError, MembershipError
from p2p_sync.trust.membership import Member, Membership, MembershipLimits

log = logging.getLogger("p2psync.tls")
REFRESH_S = 1.0  # the revocation list file is looked at no more often than this


@dataclass(frozen=True)
class PrivateSwarmFiles:
    """Where a private node's membership lives: the swarm CA, its admission, the revocations."""

    ca: Path
    admission: Path
    revocations: Path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config: {what}: {path}: {exc.strerror or exc}") from None


def _key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _context(server: bool, files: PrivateSwarmFiles, key: Ed25519PrivateKey) -> ssl.SSLContext:
    """A TLS 1.3 context trusting the swarm CA alone, checking revocations, presenting the
    node's admission with its identity key (written to a private temporary file only for
    ``load_cert_chain``, which reads files, and removed at once)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the admission names the peer, not a host
    ctx.verify_mode = ssl.CERT_OPTIONAL if server else ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(files.ca))
    ctx.load_verify_locations(cafile=str(files.revocations))  # a CRL file
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    if server:  # aiohttp's client cannot resume a session: tickets would be sent for nothing
        ctx.num_tickets = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "identity.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(_key_pem(key))
        ctx.load_cert_chain(str(files.admission), str(path))
    return ctx


@dataclass
class SwarmTls:
    """A private node's TLS contexts and membership gate."""

    files: PrivateSwarmFiles
    membership: Membership
    own: Member
    server: ssl.SSLContext
    client: ssl.SSLContext
    admission: bytes  # the node's own, as it shows it over libp2p (``transport.p2p_gate``)
    refresh_s: float = REFRESH_S
    # (checked at, the file's (mtime, size, inode): a list renamed over it or rewritten)
    _seen: tuple[float, tuple[int, int, int] | None] = field(default=(0.0, None))
    # the asyncio thread (requests, announcements) and libp2p's (its gate) both adopt lists
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    adopted: int = 0  # newer revocation lists adopted since start (``transport.sessions``)

    @classmethod
    def load(
        cls,
        files: PrivateSwarmFiles,
        key: Ed25519PrivateKey,
        now: float,
        limits: MembershipLimits | None = None,
    ) -> SwarmTls:
        """The node's TLS from its files; ConfigError naming the file or what is wrong
        (an admission of another identity, for another swarm, expired, revoked)."""
        ca = _read(files.ca, "membership.ca")
        crl = _read(files.revocations, "membership.revocations")
        admission = _read(files.admission, "membership.admission")
        try:
            membership = Membership(ca, crl, now, limits)
            own = membership.check(admission, now, presenter=raw_public(key))
        except ImpostorError:
            raise ConfigError(
                f"config: membership.admission: {files.admission} admits another identity"
                " than this node's (its data dir's p2p-identity.key)"
            ) from None
        except MembershipError as exc:
            raise ConfigError(f"config: membership: {exc}") from None
        server, client = _context(True, files, key), _context(False, files, key)
        return cls(files, membership, own, server, client, admission)

    def refresh(self, now: float) -> None:
        """Adopt the revocation list file if it changed (looked at once per ``refresh_s``),
        in the gate and in both contexts (new handshakes either way check it; OpenSSL takes
        the latest of an issuer's lists); a list that does not verify is ignored: the one
        held stays in force."""
        if now - self._seen[0] < self.refresh_s:
            return
        with self._lock:
            current = seen = self._seen[1]
            try:
                current = _identity(self.files.revocations)
                if current != seen and self.membership.update_revocations(
                    self.files.revocations.read_bytes(), now
                ):
                    self._load(self.files.revocations)
            except (OSError, MembershipError) as exc:  # the list held stays in force
                log.warning("revocation list %s not adopted: %s", self.files.revocations, exc)
            self._seen = (now, current)

    def adopt(self, pem: bytes, now: float) -> bool:
        """A revocation list a peer relayed with an announcement: adopted when the admin
        signed it and it is newer than the one held (then written over the list file, so a
        restart keeps it); an older one (a peer that lags) or a forged one changes nothing."""
        if pem == self.membership.crl_pem:  # the list held: most announcements carry it
            return False
        with self._lock:
            try:
                if not self.membership.update_revocations(pem, now):
                    return False
            except MembershipError as exc:
                log.debug("relayed revocation list not adopted: %s", exc)
                return False
            self._rewrite(pem, now)
        return True

    def _rewrite(self, pem: bytes, now: float) -> None:
        """An adopted list over the list file (so a restart keeps it), into both contexts."""
        path = self.files.revocations
        try:
            _replace(path, pem)
            self._load(path)
            self._seen = (now, _identity(path))
        except OSError as exc:  # the file cannot be written: load it from a private copy
            log.warning("revocation list %s not rewritten (%s); held in memory", path, exc)
            with tempfile.TemporaryDirectory() as tmp:
                _replace(Path(tmp) / "crl.pem", pem)
                self._load(Path(tmp) / "crl.pem")

    def _load(self, crl: Path) -> None:
        """A newer list into both contexts (OpenSSL takes an issuer's latest list)."""
        for context in (self.server, self.client):
            context.load_verify_locations(cafile=str(crl))
        self.adopted += 1

    def member(self, transport: Any) -> Member | None:
        """The member a connection's client proved to be, now; None for a non-member."""
        ssl_object = transport.get_extra_info("ssl_object") if transport else None
        if ssl_object is None:
            return None
        now = time.time()
        self.refresh(now)
        try:
            return self.membership.check(ssl_object.getpeercert(binary_form=True), now)
        except MembershipError:
            return None


def _identity(path: Path) -> tuple[int, int, int]:
    """A file's (mtime, size, inode): a list rewritten or renamed over it changes it."""
    st = path.stat()
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a list)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def raw_public(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key of an identity key (what a peer id inlines)."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def identity_key(path: Path) -> Ed25519PrivateKey:
    """The node's libp2p identity key (``p2p-identity.key``, created if absent) as an
    Ed25519 key: the key its admission binds."""
    from p2p_sync.transport.identity import load_or_create_identity  # loads libp2p

    pair = load_or_create_identity(path)
    return Ed25519PrivateKey.from_private_bytes(pair.private_key.to_bytes()[:32])


def tls_url(url: str) -> str:
    """``url`` over TLS: a private swarm's data plane speaks nothing else, so the peer
    directory's ``http://`` names stay as they are and requests go to ``https://``."""
    return "https://" + url[len("http://") :] if url.startswith("http://") else url
