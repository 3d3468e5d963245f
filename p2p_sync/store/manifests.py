"""The verified manifests a store holds, and which of their slots name each chunk.

A manifest is kept as its exact signed bytes (so it can be served onward) beside the parsed
form; the chunk index maps a chunk hash to every (manifest, slot) that names it, so a chunk
that arrives once fills every payload that repeats it. The store trusts its caller to have
verified a manifest (``trusted.TrustedSet``) before putting it; on open it only re-parses the
files and checks each is named by its digest.
"""

from __future__ import annotations

from pathlib import Path

from p2p_sync.errors import ManifestError
from p2p_sync.trust.manifest import Manifest, ManifestLimits, parse


class ManifestIndex:
    """Manifests by digest, with their signed bytes, and the chunk-to-slot index."""

    def __init__(self, manifest_dir: Path) -> None:
        self.dir = manifest_dir
        self.entries: dict[str, tuple[Manifest, bytes]] = {}
        self.where: dict[str, list[tuple[str, int]]] = {}  # chunk hash -> (manifest, index)

    def path(self, digest: str) -> Path:
        return self.dir / f"{digest}.json"

    def __contains__(self, digest: object) -> bool:
        return digest in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def of(self, digest: str) -> Manifest:
        """The manifest ``digest`` (KeyError when unknown)."""
        return self.entries[digest][0]

    def get(self, digest: str) -> Manifest | None:
        entry = self.entries.get(digest)
        return entry[0] if entry else None

    def data(self, digest: str) -> bytes | None:
        entry = self.entries.get(digest)
        return entry[1] if entry else None

    def sorted(self) -> list[Manifest]:
        """Every manifest, oldest version first."""
        return sorted((m for m, _ in self.entries.values()), key=lambda m: (m.version, m.kind))

    def locate(self, chunk: str) -> list[tuple[str, int]]:
        """Every (manifest digest, slot) naming ``chunk``."""
        return self.where.get(chunk, [])

    def register(self, manifest: Manifest, data: bytes) -> None:
        self.entries[manifest.digest] = (manifest, data)
        self.index(manifest)

    def index(self, manifest: Manifest) -> None:
        """Name ``manifest``'s slots in the chunk index (a payload stored before its manifest
        is indexed already)."""
        for i, c in enumerate(manifest.chunks):
            where = self.where.setdefault(c, [])
            if (manifest.digest, i) not in where:
                where.append((manifest.digest, i))

    def unindex(self, manifest: Manifest) -> None:
        for c in manifest.chunks:
            where = [w for w in self.where.get(c, []) if w[0] != manifest.digest]
            if where:
                self.where[c] = where
            else:
                self.where.pop(c, None)

    def pop(self, digest: str) -> Manifest:
        """Forget manifest ``digest`` and its slots (KeyError when unknown)."""
        manifest, _ = self.entries.pop(digest)
        self.unindex(manifest)
        return manifest

    def load(self, path: Path) -> str | None:
        """Register the manifest file ``path``; or say why it is to go (unreadable, or not
        named by its digest)."""
        data = path.read_bytes()
        try:
            manifest, _ = parse(data, ManifestLimits(max_manifest_bytes=len(data) + 1))
        except ManifestError as exc:
            return f"unreadable manifest ({exc})"
        if path.name != f"{manifest.digest}.json":
            return "name does not match its digest"
        self.register(manifest, data)
        return None
