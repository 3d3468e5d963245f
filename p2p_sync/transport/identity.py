"""The node's libp2p identity: an Ed25519 key pair in its data dir (``p2p-identity.key``,
libp2p's protobuf format, mode 0600), created on first start and reused, so a restarted node
keeps its peer id. Separate from the trainer's signing key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.identity_utils import load_identity, save_identity

from p2p_sync.errors import P2PError

IDENTITY_FILE = "p2p-identity.key"


def load_or_create_identity(path: Path) -> Any:
    """The node's libp2p key pair, created on first start (mode 0600) and reused afterwards."""
    if path.exists():
        try:
            return load_identity(path)
        except (ValueError, OSError) as exc:
            raise P2PError(f"{path}: unreadable libp2p identity ({exc})") from None
    key_pair = create_new_key_pair()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_identity(key_pair, path)
    return key_pair
