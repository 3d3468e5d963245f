"""The store's head written out one tensor at a time: full weights without holding them.

A sharded trainer's rank 0 keeps no copy of the model between versions; its anchors and
checkpoints come from the store instead. The replay base (the checkpoint, or an anchor) is
read one tensor at a time, each tensor is patched by its frames from every logged patch after
the base, summed for the state hash and written; the sums must give the head's signed state.
Memory is one tensor and one frame's blocks, the same file :func:`weights_io.write_to` writes.
"""

from __future__ import annotations

from typing import BinaryIO

import torch

from p2p_sync import codec
from p2p_sync.errors import LayoutMismatchError, PatchError, TargetMismatchError
from p2p_sync.store.facade import Store
from p2p_sync.store.log import Checkpoint
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


def write_head(store: Store, f: BinaryIO, version: int) -> None:
    """Write the weights of the store's head, which must be ``version``, to ``f`` as
    safetensors. Raises ``PatchError`` when the store cannot rebuild it (a payload gone, a
    patch that does not follow) and ``TargetMismatchError`` when the result is not the head's
    signed state."""
    base, chain = store.replay_chain()
    if base is None:
        raise PatchError("the store holds nothing to rebuild its head from")
    head = chain[-1] if chain else base
    if head.version != version:
        raise PatchError(f"the store's head is v{head.version}, not v{version}")
    patches = [_logged(store, m) for m in chain]
    path = base.weights if isinstance(base, Checkpoint) else store.pack_path(base.digest)
    with open_weights(path) as src:
        entries, start = read_index(src, path)
        layout = layout_of_specs([(n, dt, shape) for n, dt, shape, _, _ in entries])
        if any(fingerprint != layout_fingerprint(layout) for fingerprint, _, _ in patches):
            raise LayoutMismatchError("a logged patch has another layout than its base")
        f.write(header_of([(n, dt, shape) for n, dt, shape, _, _ in entries]))
        sums = {e[0]: _write_tensor(f, src.fileno(), start, e, patches, path) for e in entries}
    got = StateDigest(layout, sums).hash().hex()
    want = head.state_hash if isinstance(head, Checkpoint) else head.target_state
    if got != want:
        raise TargetMismatchError(f"v{version} rebuilt from the store hashes to {got}, not {want}")


def _logged(store: Store, m: Manifest) -> Logged:
    payload = store.payload(m)
    if payload is None:
        raise PatchError(f"v{m.version}: payload not held (or corrupt on disk)")
    info = codec.read_header(payload)
    if info.base_hash.hex() != m.base_state or info.target_hash.hex() != m.target_state:
        raise PatchError(f"v{m.version}: patch hashes differ from its signed manifest")
    rows = {r.spec.name: r for r in info.rows if r.coding != codec.UNCHANGED}
    return info.fingerprint, rows, payload


def _write_tensor(
    f: BinaryIO, fd: int, start: int, entry: Entry, patches: list[Logged], path: object
) -> tuple[int, int]:
    """One tensor read from the base, moved by every logged patch, written; its sums."""
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
    f.write(host_view(t))
    return tensor_sums(t)


__all__ = ["write_head"]
