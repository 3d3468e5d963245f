"""The bounds a store keeps to (``StoreLimits``): disk, versions, files, memory, and how often
it writes full weights. A node reads them from its config's ``[store]`` table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreLimits:
    """Bounds of the local cache. What replay needs (the replay base and the log after it)
    and what newcomers need (the newest anchor and every later artifact) stay whatever the
    bounds; everything else goes oldest first once past any of them."""

    max_gb: float = 4.0  # chunk packs kept on disk (the newest anchor and its chain stay)
    # artifacts kept behind the head for peers catching up with patches (older ones: the
    # anchor); at least the longest catch-up span (publish.catchup_spans, 16 by default)
    max_versions: int = 32
    max_files: int = 1024  # manifests and packs kept (a small patch is two files a version)
    checkpoint_every: int = 10  # full weights every N versions (else one log line each)
    memory_cache_bytes: int = 32 * 2**20  # recently stored or served chunks, kept verified
    full_retry_s: float = 5.0  # a node paused by a full disk tries again this often

    @property
    def max_chunk_bytes(self) -> int:
        return int(self.max_gb * 1e9)
