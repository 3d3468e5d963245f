"""Rebuild the accepted weights from the store: checkpoint (or logged snapshot) + logged patches.

This is recovery in a checkpoint-and-log design: the store's log names, per accepted version,
the verified artifact that produced it; the checkpoint holds full weights of some earlier
version. Replaying the logged patches in order on the checkpoint gives the head, and each step
is checked against its signed state hash, so a rebuilt state is exactly an accepted one.

What cannot be verified is never applied: a checkpoint whose weights do not hash to its
recorded state is dropped (the node starts over from an anchor); a logged patch whose payload
is gone or fails its chunk hashes ends the replay there, and the log is cut back to the last
state rebuilt, so the node re-fetches the rest from its peers.

Also here: loading a snapshot payload (a complete pack is a safetensors file) into fresh
tensors or into an engine's live ones, one tensor at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2p_sync import codec
from p2p_sync.errors import (
    BaseMismatchError,
    P2PSyncError,
    PatchError,
    TargetMismatchError,
    TornApplyError,
)
from p2p_sync.memory import release_pages
from p2p_sync.store import AcceptedState, Checkpoint, Store
from p2p_sync.trust.manifest import Manifest
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.patch import (
    add_delta,
    check_layout,
    distinct_tensors,
    follow_aliases,
    require_contiguous,
)
from p2p_sync.weights.statehash import StateDigest
from p2p_sync.weights.tensors import flat_bits, layout_of
from p2p_sync.weights.threads import map_workers
from p2p_sync.weights.weights_io import WeightsFileError, load_into, load_weights

log = logging.getLogger("p2psync.restore")

# Threads that hash a loaded model on the host (numba releases the GIL; ~4 GB/s each).
HASH_WORKERS = 2

Weights = dict[str, torch.Tensor]
# Shown each block of changes as it is applied (``runtime.tp_engine`` re-codes them per rank).
FrameSink = Callable[[TensorDelta], None]


@dataclass
class Restored:
    """Weights rebuilt from the store, and the accepted state they hold."""

    weights: Weights
    state: AcceptedState
    replayed: int  # logged patches re-applied on top of the base
    digest: StateDigest  # the weights' per-tensor sums: later applies verify in O(patch)


def load_file_weights(
    path: object, expected_state: str, device: str, into: Mapping[str, torch.Tensor] | None
) -> tuple[Weights, StateDigest]:
    """Weights from a safetensors file, checked against ``expected_state`` (hex), and their
    digest (hashed on their device). With ``into``, the tensors are overwritten in place (an
    engine's live model) and returned."""
    if into is not None:
        load_into(path, into)  # type: ignore[arg-type]
        weights = dict(into)
    else:
        weights = load_weights(path, device)  # type: ignore[arg-type]
    digest = StateDigest.of(weights, HASH_WORKERS)
    got = digest.hash().hex()
    if got != expected_state:
        raise PatchError(f"{path}: weights hash to {got}, expected {expected_state}")
    return weights, digest


def load_snapshot(
    store: Store, m: Manifest, device: str = "cpu", into: Mapping[str, torch.Tensor] | None = None
) -> tuple[Weights, StateDigest]:
    """A snapshot artifact's weights, read from its pack and checked against the signed target
    state. The pack was verified chunk by chunk when downloaded (or when the store opened), so
    it is not hashed again: the state hash covers every byte, and the names, shapes and dtypes."""
    if not store.has_payload(m):
        raise PatchError(f"v{m.version} snapshot: payload not held")
    try:
        return load_file_weights(store.pack_path(m.digest), m.target_state, device, into)
    except WeightsFileError as exc:
        raise PatchError(f"v{m.version} snapshot: {exc}") from None


def held_patch(store: Store, m: Manifest) -> tuple[memoryview, codec.PatchInfo]:
    """The patch artifact ``m``'s payload and header, checked against the signed manifest;
    ``PatchError`` when it is not held whole or names other hashes."""
    payload = store.payload(m)
    if payload is None:
        raise PatchError(f"v{m.version}: payload not held (or corrupt on disk)")
    info = codec.read_header(payload)
    if info.base_hash.hex() != m.base_state or info.target_hash.hex() != m.target_state:
        raise PatchError(f"v{m.version}: patch hashes differ from its signed manifest")
    return payload, info


def apply_artifact(
    store: Store,
    m: Manifest,
    weights: Weights,
    digest: StateDigest,
    workers: int = 1,
    sink: FrameSink | None = None,
) -> None:
    """Apply the verified patch artifact ``m`` to ``weights`` (whose sums ``digest`` holds, and
    brings along) in place, checking its header against the signed manifest and the result
    against the signed target state. A mismatch found before the first write raises
    PatchError with the weights untouched; one found after raises TornApplyError."""
    payload, info = held_patch(store, m)
    apply_frames(weights, payload, info, digest, apply_threads(weights, info, workers), sink)


# Threads that decode into GPU weights, by whether a patch has class-coded frames (format 2).
# More threads launch more small kernels into one device queue and wait on each other. 7B on an
# H100, 3.3% changed, decode + apply in place (benchmarks/device.py --sweep): plain frames
# 1.39 s with 4 threads, 1.87-1.92 s with 8-16 (4 was fastest in all three sweeps, two
# sessions); class-coded 2.31 s with 8, 2.50 s with 16, 3.38 s with 4 (their host-side
# decoding wants more threads; 8 was fastest in both sweeps of 2026-11-27).
GPU_APPLY_THREADS = {False: 4, True: 8}


def apply_threads(weights: Weights, info: codec.PatchInfo, workers: int) -> int:
    """``workers``, capped for weights on a GPU (:data:`GPU_APPLY_THREADS`)."""
    if not any(t.device.type == "cuda" for t in weights.values()):
        return workers
    return min(workers, GPU_APPLY_THREADS[any(r.coding in codec.BASED for r in info.rows)])


def apply_frames(
    weights: Weights,
    data: memoryview,
    info: codec.PatchInfo,
    digest: StateDigest,
    workers: int = 1,
    sink: FrameSink | None = None,
) -> None:
    """Decode and apply a patch one tensor frame at a time, ``workers`` tensors at once, and
    bring ``digest`` (the weights' sums) along: the target hash is checked in O(patch).

    Why not ``codec.decode`` then ``patch.apply``: a decoded patch holds every changed position
    as int64 (10 bytes per changed element with its delta: a third of a GB for one step of a 1B
    model). Streaming holds one tensor's worth per worker. The price is atomicity: checks that
    need the whole patch (layout, base hash) still run before the first write, but a frame that
    fails to decode, or a target hash that does not match, is found after some tensors were
    written. Chunks are verified against the signed manifest before this runs, so that takes a
    patch the trainer itself signed inconsistent; the caller then rebuilds from the store.
    """
    rows = _rows_to_apply(weights, info, digest)
    written: list[str] = []
    try:
        _write_frames(weights, rows, data, digest, written, workers, sink)
        _check_target(digest, info.target_hash)
    except PatchError as exc:
        if not written:
            raise
        raise TornApplyError(f"{exc} (after {len(written)} tensor(s) were written)") from exc


def _write_frames(
    weights: Weights,
    rows: dict[str, codec.FrameInfo],
    data: memoryview,
    digest: StateDigest,
    written: list[str],
    workers: int,
    sink: FrameSink | None,
) -> None:
    """Decode and write every changed tensor (tied ones once; aliases take their sums), naming in
    ``written`` each one written, so a failure can tell a torn apply from an untouched one."""
    map_workers(
        lambda n: _apply_frame(weights, rows[n], data, digest, written, sink),
        distinct_tensors(weights, rows),
        workers,
    )
    follow_aliases(weights, rows, digest)


def _check_target(digest: StateDigest, target: bytes) -> None:
    """The patched weights' state hash, from their tracked sums, must be the signed target."""
    got = digest.hash()
    if got != target:
        raise TargetMismatchError(
            f"patched weights hash to {got.hex()}, not the target {target.hex()}"
        )


def _rows_to_apply(
    weights: Weights, info: codec.PatchInfo, digest: StateDigest
) -> dict[str, codec.FrameInfo]:
    """The changed tensors' rows, after every check that needs no decoding: layout, base
    state, tensors patchable in place. Nothing has been written when these fail."""
    check_layout(info.layout, layout_of(weights), "weights")
    known = digest.hash()
    if info.base_hash != known:
        raise BaseMismatchError(f"weights are {known.hex()}, patch is for {info.base_hash.hex()}")
    rows = {r.spec.name: r for r in info.rows if r.coding != codec.UNCHANGED}
    for name in rows:
        require_contiguous(weights[name], name)
    return rows


def _apply_frame(
    weights: Weights,
    row: codec.FrameInfo,
    data: memoryview,
    digest: StateDigest,
    written: list[str],
    sink: FrameSink | None = None,
) -> None:
    """Decode one frame (coding 3 against the tensor itself) and add it in place, a block of
    positions at a time (``codec.decode_frame_blocks``: a worker holds one block's positions,
    not a whole embedding's). The tensor counts as written from its first block on. ``sink``
    is shown each block applied."""
    flat = flat_bits(weights[row.spec.name])
    bits = codec.scan_view(flat) if row.coding in codec.BASED else None
    frame = data[row.offset : row.offset + row.size]
    for i, delta in enumerate(codec.decode_frame_blocks(row, frame, bits)):
        delta.validate()
        if i == 0:
            written.append(row.spec.name)
        if sink is not None:
            sink(delta)
        add_delta(flat, delta, +1, digest)
    digest.settle(row.spec.name)  # a GPU tensor's sums: read back once, not per block
    release_pages(data, row.offset, row.offset + row.size)  # a mapped pack's: read, let go


def _load_base(
    store: Store, base: Checkpoint | Manifest, device: str, into: Mapping | None
) -> tuple[Weights, StateDigest] | None:
    try:
        if isinstance(base, Checkpoint):
            return load_file_weights(base.weights, base.state_hash, device, into)
        return load_snapshot(store, base, device, into)
    except (PatchError, WeightsFileError) as exc:
        log.warning("cannot rebuild from v%d: %s", base.version, exc)
        if isinstance(base, Checkpoint):
            store.drop_checkpoint(f"failed verification on load ({exc})")
        elif any(r.manifest == base.digest for r in store.log):
            store.truncate_log(base.version, f"snapshot failed verification ({exc})")
        else:  # an anchor beside the log: the logged patches still lead there
            store.drop_artifact(base.digest, f"anchor failed verification ({exc})")
        return None


def restore(
    store: Store,
    device: str = "cpu",
    into: Mapping[str, torch.Tensor] | None = None,
    workers: int = 1,
) -> Restored | None:
    """Rebuild the deepest verified state the store allows (None: nothing to rebuild from, the
    node joins as a newcomer). Cuts the log back where a logged artifact cannot be replayed."""
    for _ in range(len(store.log) + 2):  # each failed base removes one; bounded
        base, chain = store.replay_chain()
        if base is None:
            if store.log:
                store.truncate_log(store.log[0].version, "no checkpoint or snapshot to replay on")
            return None
        loaded = _load_base(store, base, device, into)
        if loaded is not None:
            restored = _replay(store, base, chain, *loaded, workers)
            if restored is not None:
                return restored
    raise P2PSyncError(f"{store.root}: could not rebuild any accepted state")


def _replay(
    store: Store,
    base: Checkpoint | Manifest,
    chain: list[Manifest],
    weights: Weights,
    digest: StateDigest,
    workers: int,
) -> Restored | None:
    current = base.state_hash if isinstance(base, Checkpoint) else base.target_state
    record = None if isinstance(base, Checkpoint) else base.digest
    state = AcceptedState(base.version, current, record)
    for n, m in enumerate(chain):
        try:
            apply_artifact(store, m, weights, digest, workers)
        except PatchError as exc:
            log.warning("replay stops before v%d: %s; re-fetching from peers", m.version, exc)
            store.truncate_log(m.version, f"logged patch failed on replay ({exc})")
            if isinstance(exc, TornApplyError):
                return None  # half-written: rebuild from the base again, up to the cut
            return Restored(weights, state, n, digest)
        state = AcceptedState(m.version, m.target_state, m.digest)
    return Restored(weights, state, len(chain), digest)
