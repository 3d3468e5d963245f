"""What the store keeps and what goes within its bounds (``StoreLimits``): eviction policy.

Bounded by versions and files as well as bytes: eviction keeps what replay needs (the replay
base and the log after it), what newcomers need (the newest anchor and every later artifact)
and, for peers catching up with patches, the artifacts of the last ``max_versions`` versions;
older ones go whole (manifest and pack), oldest first, and so do the oldest beyond
``max_files``. The functions here only choose; the store removes what they name.
"""

from __future__ import annotations

from collections.abc import Callable

from p2p_sync.store.limits import StoreLimits
from p2p_sync.store.log import AcceptedState, Checkpoint
from p2p_sync.trust.manifest import SNAPSHOT, Manifest


def protected(
    manifests: list[Manifest],
    records: list[AcceptedState],
    base: Checkpoint | Manifest | None,
) -> set[str]:
    """Digests of the manifests still needed: every artifact the log names, the anchor
    replay starts from, and the newest anchor known (held or not) with every later one."""
    snaps = [m for m in manifests if m.kind == SNAPSHOT]
    floor = max((m.version for m in snaps), default=0)
    needed = {r.manifest for r in records if r.manifest is not None}
    if isinstance(base, Manifest):
        needed.add(base.digest)
    return needed | {m.digest for m in manifests if m.version >= floor}


def history(
    manifests: list[Manifest],
    head: int,
    files: int,
    limits: StoreLimits,
    keep: set[str],
    has_pack: Callable[[str], bool],
) -> list[tuple[str, str]]:
    """(digest, why) of the whole artifacts to forget, oldest first: those of versions more
    than ``max_versions`` behind ``head``, then more while over ``max_files`` manifests and
    packs (``files`` of them now). ``manifests``: oldest first."""
    out = []
    for m in manifests:
        too_old = head - m.version > limits.max_versions
        if m.version >= head or (not too_old and files <= limits.max_files):
            break
        if m.digest in keep:
            continue
        files -= 1 + has_pack(m.digest)
        why = f"more than {limits.max_versions} versions behind" if too_old else None
        out.append((m.digest, f"evicted ({why or 'over max_files'})"))
    return out


def packs_over_budget(
    manifests: list[Manifest], valid: dict[str, set[int]], used: int, budget: int, keep: set[str]
) -> list[str]:
    """Digests of the packs to drop, oldest version first, until the ``used`` bytes of
    verified chunks are within ``budget``."""
    if used <= budget:
        return []
    out = []
    for m in manifests:
        if used <= budget:
            break
        held = valid.get(m.digest)
        if m.digest not in keep and held:
            used -= sum(m.chunk_length(i) for i in held)
            out.append(m.digest)
    return out


def past_and_not_held(
    manifests: list[Manifest], head: int | None, valid: dict[str, set[int]], keep: set[str]
) -> list[str]:
    """Digests of the unprotected manifests below ``head`` that hold no chunk: they serve no
    peer and rebuild nothing."""
    past = [m for m in manifests if head is not None and m.version < head]
    return [m.digest for m in past if m.digest not in keep and not valid.get(m.digest)]
