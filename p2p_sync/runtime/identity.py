"""What a node needs from its settings before it starts: whose signatures it trusts (and its
own signing key), and the device its weights live on.

Both the ``p2psync node`` command and the embedding API start nodes, so both take these from
here and refuse a bad setting with the same message.
"""

from __future__ import annotations

import torch

from p2p_sync.errors import ConfigError
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.trust.keys import load_public_key, load_signing_key
from p2p_sync.trust.manifest import SwarmPolicy


def policy_for(cfg: NodeConfig) -> tuple[SwarmPolicy, object | None]:
    """The swarm's trust policy (the node's own key trusted too) and the signing key, if any."""
    key = load_signing_key(cfg.key) if cfg.key else None
    keys = tuple(load_public_key(t) for t in cfg.trust)
    if key is not None and key.public not in keys:
        keys = (key.public, *keys)
    try:
        return SwarmPolicy(cfg.swarm, keys, cfg.threshold), key
    except ValueError as exc:
        raise ConfigError(f"config: threshold: {exc}") from None


def pick_device(name: str) -> str:
    """'auto' means CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    return name
