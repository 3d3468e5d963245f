"""``p2psync node``'s flags as settings: which flag overrides which setting of the config.

The flags go over the ``--config`` TOML file the same way the embedding API's keyword
arguments do (``p2p_sync.runtime.configfile``), so a flag and a keyword fail alike.
"""

from __future__ import annotations

import argparse
from typing import Any

from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.configfile import load

# flag (argparse dest) -> config setting it overrides
FLAGS = {
    "role": "role",
    "data_dir": "data_dir",
    "listen": "listen",
    "advertise_host": "advertise_host",
    "key": "key",
    "trust": "trust",
    "peers": "peers",
    "watch": "watch",
    "export": "export",
    "on_update": "on_update",
    "swarm": "swarm",
    "device": "device",
    "workers": "workers",
    "chunk_size": "publish.chunk_size",
    "max_upload_mbps": "http.max_upload_mbps",
    "tcp_congestion": "http.tcp_congestion",
    "patch_format": "publish.patch_format",
    "checkpoint_every": "store.checkpoint_every",
    "p2p_listen": "p2p_listen",
    "bootstrap": "bootstrap",
    "reachability": "reachability.mode",
    "swarm_ca": "swarm_ca",
    "admission": "admission",
    "revocations": "revocations",
}


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags given override (None: not given, the file's or default holds)."""
    values = {setting: getattr(args, dest) for dest, setting in FLAGS.items()}
    values["p2p"] = False if args.no_p2p else None
    values["private"] = True if args.private else None
    return values


def load_args(args: argparse.Namespace) -> NodeConfig:
    """The node's config: ``--config``'s file, the flags over it; ConfigError names a field."""
    return load(args.config, overrides(args))
