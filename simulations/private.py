"""A private swarm for local node processes (``localswarm.Swarm(private=True)``): the trainer's
key is the admin key, every node gets an admission for the libp2p identity in its data dir
(made there before it starts, as ``p2psync identity`` would), and the harness itself is a
member too, so it can read each node's ``/status`` over TLS as an operator would."""

from __future__ import annotations

import json
import ssl
import time
import urllib.request
from pathlib import Path

from p2p_sync.transport.identity import IDENTITY_FILE
from p2p_sync.transport.tls import PrivateSwarmFiles, SwarmTls, identity_key, raw_public, tls_url
from p2p_sync.trust import admissions
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy

DAYS = 1.0  # each admission's validity: a run lasts minutes


class PrivateSwarm:
    """The CA and revocation list under ``root``; :meth:`flags` admits one node."""

    def __init__(self, root: Path, admin: SigningKey, swarm: str = "default") -> None:
        self.root, self.admin = root, admin
        self.swarm_id = SwarmPolicy(swarm, (admin.public,)).swarm_id
        now = time.time()
        self.ca = admissions.create_swarm_ca(admin.private, self.swarm_id, now)
        self.ca_path, self.crl_path = root / "swarm-ca.pem", root / "revocations.pem"
        self.ca_path.write_bytes(self.ca)
        self.crl_path.write_bytes(admissions.revocations(admin.private, self.ca, [], 1, now))
        observer = self._admit("observer", root / "observer")
        files = PrivateSwarmFiles(self.ca_path, observer, self.crl_path)
        key = identity_key(root / "observer" / IDENTITY_FILE)
        self.tls: ssl.SSLContext = SwarmTls.load(files, key, now).client

    def _admit(self, name: str, data_dir: Path) -> Path:
        """An admission for the identity key in ``data_dir`` (created if absent)."""
        key = identity_key(data_dir / IDENTITY_FILE)
        pem = admissions.admit(self.admin.private, self.ca, raw_public(key), time.time(), DAYS)
        path = self.root / f"{name}-admission.pem"
        path.write_bytes(pem)
        return path

    def flags(self, name: str, data_dir: Path) -> list[str]:
        """The flags that make node ``name`` (data dir ``data_dir``) a member."""
        admission = self._admit(name, data_dir)
        return [
            "--private",
            "--swarm-ca",
            str(self.ca_path),
            "--admission",
            str(admission),
            "--revocations",
            str(self.crl_path),
        ]


def get_json_tls(url: str, tls: ssl.SSLContext, timeout: float = 2.0) -> dict | None:
    """``GET url`` over TLS as a member (a private node speaks nothing else); None on failure."""
    try:
        with urllib.request.urlopen(tls_url(url), timeout=timeout, context=tls) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None
