"""A grail v3.1-style patch encoder, written from its public description, as a baseline.

The format (PULSE, one-covenant/grail, format "v3.1"): per tensor,
entries sorted by (row, col); the row stream and the column stream are delta-coded and shrunk
to uint8/uint16; values are the raw bf16 bits of the NEW weights; a JSON header; the whole
payload compressed with zstd level 1. We only need its size, but it also decodes, so the
comparison is against a working encoder, not a guess.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
import zstandard

from p2p_sync.weights.tensors import TensorSet, flat_bits


def _shrink(a: np.ndarray) -> np.ndarray:
    top = int(a.max()) if a.size else 0
    for dt in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dt).max:
            return a.astype(dt)
    return a.astype(np.uint64)


def _two_d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else int(shape[0])
    rows = int(shape[0]) if len(shape) > 1 else 1
    return rows, max(cols, 1)


def _streams(idx: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    _, cols = _two_d(shape)
    row, col = idx // cols, idx % cols
    drow = np.diff(row, prepend=0)
    same_row = np.concatenate([[False], row[1:] == row[:-1]])
    dcol = np.where(same_row, col - np.concatenate([[0], col[:-1]]), col)
    return _shrink(drow), _shrink(dcol)


def encode(base: TensorSet, new: TensorSet) -> bytes:
    header, blobs = {}, []
    for name in sorted(base):
        old_bits = flat_bits(base[name]).cpu().numpy()
        new_bits = flat_bits(new[name]).cpu().numpy()
        idx = np.flatnonzero(old_bits != new_bits)
        if idx.size == 0:
            continue
        drow, dcol = _streams(idx, tuple(base[name].shape))
        values = new_bits[idx]
        header[name] = {
            "shape": list(base[name].shape),
            "dtype": str(base[name].dtype),
            "n": int(idx.size),
            "row": drow.dtype.name,
            "col": dcol.dtype.name,
        }
        blobs += [drow.tobytes(), dcol.tobytes(), values.tobytes()]
    meta = json.dumps(header).encode()
    payload = struct.pack("<I", len(meta)) + meta + b"".join(blobs)
    return zstandard.ZstdCompressor(level=1).compress(payload)


def decode_apply(weights: TensorSet, data: bytes) -> None:
    """Apply a reference patch in place (proves the baseline is a real, lossless encoder)."""
    payload = zstandard.ZstdDecompressor().decompress(data)
    (n_meta,) = struct.unpack_from("<I", payload)
    header = json.loads(payload[4 : 4 + n_meta])
    off = 4 + n_meta
    for name, h in header.items():
        n, (_, cols) = h["n"], _two_d(tuple(h["shape"]))
        parts = []
        for key in ("row", "col"):
            dt = np.dtype(h[key])
            parts.append(np.frombuffer(payload, dt, n, off).astype(np.int64))
            off += n * dt.itemsize
        drow, dcol = parts
        row = np.cumsum(drow)
        same_row = np.concatenate([[False], row[1:] == row[:-1]])
        csum, starts = np.cumsum(dcol), ~same_row
        col = csum - (csum - dcol)[starts][np.cumsum(starts) - 1]  # running sum within each row
        bits = flat_bits(weights[name])
        width = bits.element_size()
        vals = np.frombuffer(payload, f"<i{width}", n, off)
        off += n * width
        bits[torch.from_numpy(row * cols + col)] = torch.from_numpy(vals.copy())
