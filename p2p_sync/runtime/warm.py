"""Warming the codec: a node compiles (or loads from numba's cache) the scans its first version
will need before that version arrives, so its first apply costs what the next ones do.
"""

from __future__ import annotations

from typing import Any


def warm_codec() -> None:
    """Diff, code and apply a small patch of each common float dtype, sparse and dense, so the
    compiled scans of the codec and the state hash (numba, cached on disk) are ready before
    the first version arrives: compiling them costs seconds of CPU per process, loading them
    from the cache a few tenths, which would otherwise land on the first version."""
    import torch

    values = torch.randn(16384, generator=torch.Generator().manual_seed(0))  # real spreads
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _warm(values.to(dtype))


def _warm(base_values: Any) -> None:
    """One dtype: a sparse and a dense step, each coded in formats 2 and 1 and applied.

    Why 16,384 normal values and both patterns: numba compiles per argument types, and the
    codec takes other paths (and array types) for dense frames, long gaps and wide exponent
    spreads. Warmed with 4,096 evenly spaced values changed every 7th, a fresh node's first
    real patch still compiled four scans (bf16, format 2, every element changed), two (format
    1, 3% changed) or two (float32, format 2, dense): 1.7 s on its first apply against 0.13
    s on the next, and in the emulated swarm (7 rollouts on 2 cores, a fresh cache) the
    median rollout's first apply took 7 s. Now nothing compiles then (bf16, fp16 and fp32,
    sparse and dense, both formats: checked with numba's compile events); warming takes
    0.38 s from the cache (0.35 s before), ~6 s cold (3.4 s)."""
    from p2p_sync import codec
    from p2p_sync.store.restore import apply_frames
    from p2p_sync.weights.patch import diff
    from p2p_sync.weights.statehash import StateDigest

    base = {"w": base_values}
    sparse = base["w"].clone()
    sparse[::7] = -sparse[::7]
    dense = (base["w"].float() * 1.01 + 0.001).to(base_values.dtype)
    for new in (sparse, dense):
        step = diff(base, {"w": new})
        for data in (codec.encode(step, base=base), codec.encode(step)):  # formats 2, 1
            weights = {"w": base["w"].clone()}  # applied as a rollout does, sums tracked
            apply_frames(
                weights, memoryview(data), codec.read_header(data), StateDigest.of(weights)
            )
