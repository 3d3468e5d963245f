"""Durable local store: verified manifests, their payloads' chunks, a checkpoint and a log.

Layout under the data dir::

    manifests/<digest>.json          signed manifests as received (digest = Manifest.digest)
    packs/<manifest digest>          that manifest's payload, each chunk at its offset
                                     (chunk_index * chunk_size); sparse while downloading
    weights/v<version>-<hash>.safetensors  the checkpoint's full weights
    checkpoint.json                  {"version", "state_hash", "weights"}
    log.jsonl                        one line per accepted version past the checkpoint:
                                     {"version", "state_hash", "manifest"}
    format.json                      {"state_hash": 2}: how the recorded hashes were made
    lock                             the running node's pid, ``flock``ed while it runs

The accepted state is a checkpoint plus a log (``log``): the verified artifacts in the packs
(``packs``, indexed by ``manifests``) are the log's contents. Recovery (``restore``) loads the
checkpoint, or the newest logged snapshot, and re-applies the logged patches, checking every
step against its signed state hash. Eviction (``evict``) never drops what replay needs.

Crash safety: manifests, checkpoint weights and ``checkpoint.json`` are written through
``atomic`` (temp file, fsync, rename, fsync dir), so a crash at any instant leaves each old or
new, never half-written; chunks are trusted only once they hash right. On open the store
checks itself: it removes temp files, manifests that do not parse or match their name, packs
no manifest names, and weights files the checkpoint does not name; it re-hashes every pack
slot. The data dir's lock and the full-disk gate are ``datadir``'s; the in-memory chunk cache
``cache``'s. ``Store`` (``facade``) is the one object callers hold.
"""

from p2p_sync.errors import (
    DataDirInUseError,
    ManifestError,
    StoreError,
    StoreFormatError,
    StoreFullError,
)
from p2p_sync.store.datadir import FULL_NOTED_EVERY_S, LOCK_NAME, STATE_HASH_FORMAT
from p2p_sync.store.facade import MAX_DROPS_NOTED, Store
from p2p_sync.store.havemap import HaveMark
from p2p_sync.store.limits import StoreLimits
from p2p_sync.store.log import AcceptedState, Checkpoint

__all__ = [
    "FULL_NOTED_EVERY_S",
    "LOCK_NAME",
    "MAX_DROPS_NOTED",
    "STATE_HASH_FORMAT",
    "AcceptedState",
    "Checkpoint",
    "DataDirInUseError",
    "HaveMark",
    "ManifestError",
    "Store",
    "StoreError",
    "StoreFormatError",
    "StoreFullError",
    "StoreLimits",
]
