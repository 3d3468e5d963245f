"""Every class of bad patch raises its own exception with a clear message, and loses nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync import codec
from p2p_sync.codec import frames as codec_frames
from p2p_sync.errors import (
    BadMagicError,
    BaseMismatchError,
    CorruptFrameError,
    CountMismatchError,
    IndexOutOfRangeError,
    LayoutMismatchError,
    MalformedPatchError,
    PatchError,
    TrailingDataError,
    TruncatedPatchError,
    UnsupportedFormatError,
)
from p2p_sync.store.restore import apply_frames
from p2p_sync.weights.patch import apply, diff
from p2p_sync.weights.statehash import StateDigest
from tests.helpers import bit_equal, clone_set, frame_from_streams, rebuild


@pytest.fixture(scope="module")
def versions() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    v0 = {"a": torch.randn(64, 64, generator=g).bfloat16(), "b": torch.randn(1000, generator=g)}
    v1 = clone_set(v0)
    v1["a"].view(-1)[::29] += 0.5
    v1["b"][::3] *= 1.001
    v2 = clone_set(v1)
    v2["a"].view(-1)[::31] -= 0.25
    return [v0, v1, v2]


@pytest.fixture(scope="module")
def data(versions: list) -> bytes:
    return codec.encode(diff(versions[0], versions[1]))


def _set_count(delta: int):
    def mutate(rows: list, frames: dict) -> None:
        rows[0] = dataclasses.replace(rows[0], count=rows[0].count + delta)

    return mutate


def _frame_with_position(pos: int):
    def mutate(rows: list, frames: dict) -> None:
        row = rows[0]
        pos_head, pos_body = codec.encode_positions(torch.tensor([pos]).numpy(), row.spec.numel)
        val_head, val_body = codec.encode_values(torch.tensor([1], dtype=torch.int16).numpy())
        frames[row.spec.name] = frame_from_streams([pos_head + val_head, *pos_body, *val_body])
        rows[0] = dataclasses.replace(row, count=1)

    return mutate


def _with_version(data: bytes, version: int) -> bytes:
    return data[:8] + version.to_bytes(2, "little") + data[10:]


CASES = [
    ("truncated in header", lambda d: d[:40], TruncatedPatchError, "header"),
    ("truncated in magic", lambda d: d[:5], TruncatedPatchError, "only 5 bytes"),
    ("truncated in frames", lambda d: d[:-1], TruncatedPatchError, "frames end"),
    ("truncated in table", lambda d: d[:80], TruncatedPatchError, "table ends"),
    ("bad magic", lambda d: b"GARBAGE!" + d[8:], BadMagicError, "magic"),
    ("empty file", lambda d: b"", TruncatedPatchError, "0 bytes"),
    ("unknown version", lambda d: _with_version(d, 5), UnsupportedFormatError, "version 5"),
    ("trailing garbage", lambda d: d + b"\0", TrailingDataError, "1 unexpected"),
    ("count too high", lambda d: rebuild(d, _set_count(+1)), CountMismatchError, "^a: "),
    ("count too low", lambda d: rebuild(d, _set_count(-1)), CountMismatchError, "^a: "),
    (
        "index out of range",
        lambda d: rebuild(d, _frame_with_position(64 * 64)),
        IndexOutOfRangeError,
        "outside",
    ),
    (
        "frame bit flip",
        lambda d: d[:-9] + bytes([d[-9] ^ 0x40]) + d[-8:],
        CorruptFrameError,
        "corrupt",
    ),
    (
        "fingerprint flip",
        lambda d: d[:24] + bytes([d[24] ^ 1]) + d[25:],
        MalformedPatchError,
        "fingerprint",
    ),
]


@pytest.mark.parametrize(("case", "corrupt", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_corrupt_patch_raises_its_own_error(data, case, corrupt, error, message) -> None:
    with pytest.raises(error, match=message):
        codec.decode(corrupt(data))


def test_wrong_base_is_refused_and_weights_untouched(versions: list, data: bytes) -> None:
    weights = clone_set(versions[2])
    with pytest.raises(BaseMismatchError, match="patch was made for base"):
        apply(weights, codec.decode(data))
    assert bit_equal(weights, versions[2])


def test_layout_mismatch_is_refused(versions: list, data: bytes) -> None:
    weights = {"a": versions[0]["a"].clone(), "b": torch.zeros(999)}
    with pytest.raises(LayoutMismatchError, match="'b'"):
        apply(weights, codec.decode(data))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_single_byte_change_is_caught_and_loses_nothing(versions, data, draw) -> None:
    """Flip one byte anywhere: decode or apply raises a PatchError and the weights stay as they
    were, or (only if the flip hit nothing that matters) the result is still exactly right."""
    i = draw.draw(st.integers(0, len(data) - 1))
    x = draw.draw(st.integers(1, 255))
    bad = data[:i] + bytes([data[i] ^ x]) + data[i + 1 :]
    weights = clone_set(versions[0])
    try:
        apply(weights, codec.decode(bad))
    except PatchError:
        assert bit_equal(weights, versions[0])
    else:
        assert bit_equal(weights, versions[1])


def _frame_with_positions(positions: list[int], escapes: int | None = None):
    """Row 0's frame made to change ``positions`` (by +1 each); ``escapes``: what its header
    claims of 16-bit gap escapes (the truth when None)."""

    def mutate(rows: list, frames: dict) -> None:
        row = rows[0]
        pos = np.array(positions, dtype=np.int64)
        pos_head, pos_body = codec.encode_positions(pos, row.spec.numel)
        if escapes is not None:
            pos_head = codec._SPARSE_HEAD.pack(escapes)
            pos_body[2] = pos_body[2] + b"\0" * 4 * max(0, escapes - len(pos_body[2]) // 4)
        val_head, val_body = codec.encode_values(np.ones(len(positions), dtype=np.int16))
        frames[row.spec.name] = frame_from_streams([pos_head + val_head, *pos_body, *val_body])
        rows[0] = dataclasses.replace(row, count=len(positions))

    return mutate


@pytest.mark.parametrize(
    ("positions", "escapes", "error", "message"),
    [
        ([1, 2, 3, 64 * 64], None, IndexOutOfRangeError, "outside"),
        ([0, 1, 2, 3], 1, CountMismatchError, "escape markers"),
    ],
    ids=["last position out of range", "escape count"],
)
def test_a_frame_applied_in_blocks_fails_before_its_first_block(
    versions: list, data: bytes, positions, escapes, error, message
) -> None:
    """A rollout applies a sparse frame a block of positions at a time; what is wrong at the
    frame's end is found before the first block is written: the weights stay untouched and the
    error is the frame's (not a torn apply)."""
    bad = rebuild(data, _frame_with_positions(positions, escapes))
    info = codec.read_header(bad)
    row = info.rows[0]
    blocks = codec.decode_frame_blocks(
        row, memoryview(bad)[row.offset : row.offset + row.size], block=1
    )
    with pytest.raises(error, match=message):
        next(blocks)
    weights = clone_set(versions[0])
    old, codec_frames.BLOCK = codec_frames.BLOCK, 1
    try:
        with pytest.raises(error, match=message):
            apply_frames(weights, memoryview(bad), info, StateDigest.of(weights))
    finally:
        codec_frames.BLOCK = old
    assert bit_equal(weights, versions[0])
