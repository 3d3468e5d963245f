"""The store's head read one tensor at a time: full weights without holding them.

A sharded trainer's rank 0 keeps no copy of the model between versions; its anchors and
checkpoints, and after a restart the head the ranks diff from, come from the store instead.
The replay base (the checkpoint, or an anchor) is read one tensor at a time, each tensor is
patched by its frames from every logged patch after the base and summed for the state hash;
the sums must give the head's signed state. Memory is one tensor and one frame's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import torch

from p2p_sync import codec
from p2p_sync.errors import LayoutMismatchError, PatchError, TargetMismatchError
from p2p_sync.store.facade import Store
from p2p_sync.store.log import Checkpoint
from p2p_sync.store.restore import held_patch
from p2p_sync.trust.manifest import Manifest
from p2p_sync.weights.patch import add_delta
from p2p_sync.weights.statehash import StateDigest, tensor_sums
from p2p_sync.weights.tensors import flat_bits, layout_fingerprint, layout_of_specs
from p2p_sync.weights.weights_io import (
    Entry,
    header_of,
    host_view,
    open_weights,
    pread_into,
    read_index,
)

Logged = tuple[bytes, dict[str, codec.FrameInfo], memoryview]  # fingerprint, rows, payload


class Head:
    """The store's head (which must be ``version``), a tensor at a time: :meth:`tensors`
    yields them in name order and, once all are given, checks their sums against the head's
    signed state (``digest`` then holds them). Raises ``PatchError`` when the store cannot
    rebuild it (a payload gone, a patch with another layout or hashes than its manifest)."""

    def __init__(self, store: Store, version: int) -> None:
        base, chain = store.replay_chain()
        if base is None:
            raise PatchError("the store holds nothing to rebuild its head from")
        head = chain[-1] if chain else base
        if head.version != version:
            raise PatchError(f"the store's head is v{head.version}, not v{version}")
        self.version = version
        self.state = head.state_hash if isinstance(head, Checkpoint) else head.target_state
        self.path = base.weights if isinstance(base, Checkpoint) else store.pack_path(base.digest)
        self.patches = [_logged(store, m) for m in chain]
        with open_weights(self.path) as src:
            self.entries, self.start = read_index(src, self.path)
        self.specs = [(n, dt, shape) for n, dt, shape, _, _ in self.entries]
        self.layout = layout_of_specs(self.specs)
        if any(fp != layout_fingerprint(self.layout) for fp, _, _ in self.patches):
            raise LayoutMismatchError("a logged patch has another layout than its base")
        self.digest: StateDigest | None = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the head, one at a time, checked once the last is given."""
        sums = {}
        with open_weights(self.path) as src:
            for entry in self.entries:
                t = _patched(src.fileno(), self.start, entry, self.patches, self.path)
                sums[entry[0]] = tensor_sums(t)
                yield entry[0], t
        digest = StateDigest(self.layout, sums)
        if digest.hash().hex() != self.state:
            raise TargetMismatchError(
                f"v{self.version} rebuilt from the store hashes to {digest.hash().hex()}, "
                f"not {self.state}"
            )
        self.digest = digest


def write_head(store: Store, f: BinaryIO, version: int) -> None:
    """Write the weights of the store's head (``version``) to ``f`` as safetensors, the bytes
    ``weights_io.write_to`` writes for them (see :class:`Head` for what it raises)."""
    head = Head(store, version)
    f.write(header_of(head.specs))
    for _, t in head.tensors():
        f.write(host_view(t))


def _logged(store: Store, m: Manifest) -> Logged:
    payload, info = held_patch(store, m)
    rows = {r.spec.name: r for r in info.rows if r.coding != codec.UNCHANGED}
    return info.fingerprint, rows, payload


def _patched(
    fd: int, start: int, entry: Entry, patches: list[Logged], path: object
) -> torch.Tensor:
    """One tensor read from the base and moved by every logged patch."""
    name, dtype, shape, begin, _ = entry
    t = torch.empty(shape, dtype=dtype)
    pread_into(fd, t, start + begin, path, name)
    flat = flat_bits(t)
    for _, rows, payload in patches:
        row = rows.get(name)
        if row is None:
            continue
        bits = codec.scan_view(flat) if row.coding in codec.BASED else None
        frame = payload[row.offset : row.offset + row.size]
        for delta in codec.decode_frame_blocks(row, frame, bits):
            add_delta(flat, delta, +1)
    return t


__all__ = ["Head", "write_head"]
