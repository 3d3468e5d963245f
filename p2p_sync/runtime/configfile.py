"""Settings into a :class:`NodeConfig`: a TOML file, then keyword arguments or flags over it.

The embedding API (``p2p_sync.Trainer(config=..., **settings)``) and the ``p2psync node``
command both read settings this way, so both accept the same names and fail with the same
messages. Dotted names (``"download.stall_timeout_s"``) set one field of a section; a setting
from before the sections names where it went.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from p2p_sync.errors import ConfigError
from p2p_sync.runtime.config import SECTIONS, NodeConfig, check
from p2p_sync.settings import from_table, typed

__all__ = ["load"]

_PATHS = {"data_dir", "key", "watch", "export", "swarm_ca", "admission", "revocations"}
_TUPLES = {"trust", "peers", "bootstrap", "publish.catchup_spans"}

_MOVED = {  # settings from before the tree -> where they live now
    "chunk_size": "publish.chunk_size",
    "patch_format": "publish.patch_format",
    "anchor_every": "publish.anchor_every",
    "catchup_spans": "publish.catchup_spans",
    "manifest_lifetime_s": "publish.lifetime_s",
    "seed_outstanding": "publish.seed_outstanding",
    "reseed_after_s": "publish.reseed_after_s",
    "watch_interval_s": "publish.watch_interval_s",
    "checkpoint_every": "store.checkpoint_every",
    "store_max_gb": "store.max_gb",
    "max_upload_mbps": "http.max_upload_mbps",
    "max_concurrent_uploads": "http.max_concurrent_uploads",
    "upload_queue": "http.upload_queue",
    "max_requests_per_peer": "download.max_requests_per_peer",
    "min_requests_per_peer": "download.min_requests_per_peer",
    "max_requests_total": "download.max_requests_total",
    "min_request_timeout_s": "download.min_request_timeout_s",
    "stall_timeout_s": "download.stall_timeout_s",
    "have_poll_s": "download.have_poll_s",
    "max_sources": "download.max_sources",
    "max_peers": "directory.max_peers",
    "max_unproven_peers": "directory.max_unproven",
    "peer_max_failures": "directory.max_failures",
    "poll_fanout": "directory.poll_fanout",
    "poll_interval_s": "directory.poll_interval_s",
    "announce_max_age_s": "announce.max_age_s",
    "announce_per_s": "announce.per_s",
    "p2p_max_connections": "libp2p.max_connections",
    "p2p_max_rejects": "libp2p.max_rejects",
    "p2p_refresh_s": "libp2p.refresh_s",
    "p2p_start_timeout_s": "libp2p.start_timeout_s",
}


def _coerce(name: str, value: Any) -> Any:
    """A TOML or flag value in the field's type (paths, comma-separated lists)."""
    if value is None:
        return None
    if name in _PATHS:
        return Path(value)
    if name in _TUPLES:
        items = value.split(",") if isinstance(value, str) else list(value)
        items = [i.strip() if isinstance(i, str) else i for i in items]
        if name == "publish.catchup_spans":
            return tuple(int(i) for i in items)
        return tuple(i for i in items if i)
    return value


def _nest(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys (``download.stall_timeout_s``) into their section's table."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        section, dot, rest = key.partition(".")
        if not dot:
            out[key] = value
            continue
        if section not in SECTIONS:
            raise ConfigError(f"config: {key}: unknown setting")
        table = out.setdefault(section, {})
        if not isinstance(table, dict):
            table = out[section] = {f.name: getattr(table, f.name) for f in fields(table)}
        table[rest] = value
    return out


def _unknown(key: str) -> ValueError:
    moved = _MOVED.get(key)
    if moved is None:
        return ValueError(f"{key}: unknown setting")
    section, _, name = moved.partition(".")
    return ValueError(f"{key}: now {name} in the [{section}] table")


def _build(values: dict[str, Any]) -> NodeConfig:
    default = NodeConfig()
    changes: dict[str, Any] = {}
    for key, value in _nest(values).items():
        try:
            if key in SECTIONS:
                changes[key] = from_table(key, getattr(default, key), value, _coerce)
            elif key in {f.name for f in fields(NodeConfig)}:
                changes[key] = typed(key, _coerce(key, value), getattr(default, key))
            else:
                raise _unknown(key)
        except ValueError as exc:
            raise ConfigError(f"config: {exc}") from None
    return replace(default, **changes)


def load(path: Path | None, overrides: dict[str, Any]) -> NodeConfig:
    """Settings from the TOML file at ``path`` (if any), then non-None ``overrides``."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"config: cannot read {path} ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: {path} is not valid TOML ({exc})") from None
    values = _nest(values)
    for key, value in _nest({k: v for k, v in overrides.items() if v is not None}).items():
        if key in SECTIONS and isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    cfg = _build(values)
    check(cfg)
    return cfg
