"""Named tensor sets: bit-pattern views, layout fingerprints and state hashes.

A *tensor set* is a ``dict[str, torch.Tensor]`` (a state dict). Patches work on the integer
bit patterns of the tensors, never on float values, so every dtype is handled by its bits and
reconstruction is exact (NaN payloads, -0.0 and Inf included).

The *layout fingerprint* (here) covers names, shapes and dtypes: what a patch's structure
depends on. It is XXH3-128 over one record per tensor. The *state hash*, which also covers every
byte (which exact version a set holds), is built on the same records in
:mod:`p2p_sync.weights.statehash`, so it can run on the tensors' device and update in O(patch). Both
detect accidents (wrong base, corrupt apply); authenticity comes from the signed manifest,
which carries them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

TensorSet = Mapping[str, torch.Tensor]

# Wire codes of the dtypes a patch can carry. Codes are part of the format: never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bool: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int16: 4,
    torch.int32: 5,
    torch.int64: 6,
    torch.float16: 7,
    torch.bfloat16: 8,
    torch.float32: 9,
    torch.float64: 10,
    torch.float8_e4m3fn: 11,
    torch.float8_e5m2: 12,
    torch.uint16: 13,
    torch.uint32: 14,
    torch.uint64: 15,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}

# The signed integer type whose bit pattern stands for each element width (bytes).
_BITS_BY_WIDTH: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


@dataclass(frozen=True, order=True)
class TensorSpec:
    """Name, shape and dtype of one tensor: what a patch needs to know about its layout."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def describe(self) -> str:
        dims = "x".join(str(d) for d in self.shape) or "scalar"
        return f"{self.name} [{dims}] {str(self.dtype).removeprefix('torch.')}"


Layout = tuple[TensorSpec, ...]


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype with the same width as ``dtype`` (its bit-pattern view)."""
    if dtype not in DTYPE_CODES:
        raise TypeError(f"dtype {dtype} is not supported by p2psync patches")
    return _BITS_BY_WIDTH[dtype.itemsize]


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat view of ``t``'s bit patterns as signed integers (no copy when contiguous)."""
    flat = t.reshape(-1)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8).view(torch.int8)
    return flat.view(bits_dtype(t.dtype))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for a GPU goes through pinned memory, so the
    copy is queued rather than waited for (a copy from pageable memory waits for the work
    queued before it on the device's stream, every thread's)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def layout_of(tensors: TensorSet) -> Layout:
    """The layout of a tensor set, sorted by name (the canonical order of every digest); a
    set that knows its layout without reading its tensors (``served.ServedWeights``) says."""
    own = getattr(tensors, "layout", None)
    if callable(own):
        return own()
    specs = []
    for name in sorted(tensors):
        t = tensors[name]
        bits_dtype(t.dtype)  # raises for unsupported dtypes
        specs.append(TensorSpec(name, tuple(int(d) for d in t.shape), t.dtype))
    return tuple(specs)


def spec_record(spec: TensorSpec) -> bytes:
    """The canonical record of one spec: lengths, dtype code, name, dims (little-endian)."""
    name = spec.name.encode("utf-8")
    dims = np.asarray(spec.shape, dtype="<u8").tobytes()
    head = np.asarray([len(name), DTYPE_CODES[spec.dtype], len(spec.shape)], dtype="<u4")
    return head.tobytes() + name + dims


def layout_fingerprint(layout: Layout) -> bytes:
    """XXH3-128 over the canonical records of every spec (names, dtype codes, shapes)."""
    h = xxhash.xxh3_128()
    for spec in layout:
        h.update(spec_record(spec))
    return h.digest()


def layout_of_specs(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Layout:
    """A layout from (name, dtype, shape) records, e.g. a weights file's index, in name order."""
    for _, dtype, _ in entries:
        bits_dtype(dtype)
    return tuple(sorted(TensorSpec(n, tuple(shape), dt) for n, dt, shape in entries))


def total_bytes(tensors: TensorSet) -> int:
    """Dense size of a tensor set in bytes (what a full push would send)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
