"""What one publish cost and built: its timings (for logs, ``/status`` and benchmarks) and the
one-line summaries the trainer logs per version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from p2p_sync.trust.manifest import Manifest

Built = tuple[Manifest, bytes, bytes | Path]  # manifest, its signed bytes, payload (or its file)


@dataclass
class PublishTimings:
    """Where one publish spent its time (seconds), for logs, /status and benchmarks."""

    version: int = -1
    diff_s: float = 0.0
    encode_s: float = 0.0
    hash_sign_s: float = 0.0
    store_s: float = 0.0
    snapshot_s: float = 0.0  # anchors: the full weights written as a pack and hashed (v1+:
    # after the announcement, in the background)
    total_s: float = 0.0
    patch_bytes: int = 0
    stored_at: float = 0.0  # wall clock (time.time()): stored and signed, about to be announced
    finished_at: float = 0.0  # wall clock when the manifests were announced
    catchup_s: float = 0.0  # merged catch-up patches, built after the announcement
    catchup_bytes: int = 0


def timings_line(t: PublishTimings) -> str:
    """Where a publish spent its time, for its log line."""
    return (
        f"diff {t.diff_s:.2f}, encode {t.encode_s:.2f}, hash+sign {t.hash_sign_s:.2f}, "
        f"store {t.store_s:.2f}, snapshot {t.snapshot_s:.2f}"
    )


def sizes_line(built: list[Built]) -> str:
    """What a publish built (kind, base, bytes), for its log line."""

    def one(m: Manifest) -> str:
        since = "" if m.base_version is None else f" from v{m.base_version}"
        return f"{m.kind}{since} {m.payload_size:,} B"

    return ", ".join(one(m) for m, _, _ in built)
