"""Coding 5 (format version 4): a tensor's frame as parts, each the base-free frame of one
contiguous range (what a sharded trainer's ranks code). Parts joined from the ranges' frames
decode, block by block too, and merge exactly as the whole tensor's frame does; every index
field has its own error; a mutation fuzz only ever sees patch errors and leaves the weights."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_sync import codec
from p2p_sync.codec.catchup import merge_steps
from p2p_sync.errors import (
    CountMismatchError,
    IndexOutOfRangeError,
    MalformedPatchError,
    UnsupportedFormatError,
)
from p2p_sync.weights.delta import Patch, TensorDelta
from p2p_sync.weights.patch import apply, diff
from p2p_sync.weights.tensors import TensorSpec
from tests.codec.test_codec_v2 import _check_mutant
from tests.codec.test_roundtrip_properties import KINDS, change
from tests.helpers import bit_equal, clone_set, mutate_bytes, random_bits, rebuild

DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cut(delta: TensorDelta, cuts: list[int]) -> codec.Frame:
    """``delta``'s tensor coded as parts: one frame per range between ``cuts``."""
    pos, d = (delta.positions, delta.deltas) if not delta.dense else _sparse(delta)
    edges = [0, *sorted(set(cuts)), delta.spec.numel]
    parts = []
    for start, end in zip(edges, edges[1:]):
        keep = (pos >= start) & (pos < end)
        if end > start and bool(keep.any()):
            spec = TensorSpec(delta.spec.name, (end - start,), delta.spec.dtype)
            part = TensorDelta(spec, pos[keep] - start, d[keep])
            parts.append((start, end - start, codec.encode_frame(part, 1)))
    return codec.join_parts(parts)


def _sparse(delta: TensorDelta) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.nonzero(delta.deltas).flatten()
    return pos, delta.deltas[pos]


def _as_parts(patch: Patch, cuts: list[int]) -> bytes:
    frames = {n: _cut(d, [c % max(d.spec.numel, 1) for c in cuts]) for n, d in patch.deltas.items()}
    return codec.assemble(patch.layout, patch.base_hash, patch.target_hash, frames)


@st.composite
def stepped(draw: st.DrawFn) -> tuple[dict, dict, list[int]]:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**16))
    base = {"w": random_bits((n,), dtype, seed)}
    density = draw(st.sampled_from([-1, 0.01, 0.05, 0.3, 1.0]))
    new = {"w": change(base["w"], density, draw(st.sampled_from(KINDS)), seed + 1)}
    cuts = draw(st.lists(st.integers(0, 2**20), max_size=6))
    return base, new, cuts


@given(stepped())
@SETTINGS
def test_parts_decode_whole_and_by_block_as_the_tensor_would(case: tuple) -> None:
    base, new, cuts = case
    patch = diff(base, new)
    if not patch.deltas:
        return
    data = _as_parts(patch, cuts)
    info = codec.read_header(data)
    assert info.version == 4 and info.rows[0].coding == codec.PARTS
    want = _sparse(patch.deltas["w"]) if patch.deltas["w"].dense else patch.deltas["w"]
    want_pos = want[0] if isinstance(want, tuple) else want.positions
    got = codec.decode(data).deltas["w"]
    assert torch.equal(got.positions, want_pos)
    row = info.rows[0]
    frame = memoryview(data)[row.offset : row.offset + row.size]
    blocks = list(codec.decode_frame_blocks(row, frame, block=7))
    assert torch.equal(torch.cat([b.positions for b in blocks]), want_pos)
    weights = clone_set(base)
    apply(weights, codec.decode(data))
    assert bit_equal(weights, new)


@given(stepped(), st.integers(0, 2**16))
@SETTINGS
def test_catch_up_merges_of_parts_equal_those_of_whole_frames(case: tuple, seed: int) -> None:
    base, mid, cuts = case
    end = {"w": change(mid["w"], 0.05, "random", seed)}
    first, second = diff(base, mid), diff(mid, end)
    whole = merge_steps([codec.encode(first), codec.encode(second)])
    parted = merge_steps(
        [_as_parts(p, cuts) if p.deltas else codec.encode(p) for p in (first, second)]
    )
    assert parted == whole


def test_files_without_parts_stay_at_their_version() -> None:
    base = {"w": random_bits((100,), torch.bfloat16, 1)}
    new = {"w": change(base["w"], 0.1, "ulp", 2)}
    assert codec.read_header(codec.encode(diff(base, new))).version == 1


def test_join_parts_refuses_a_callers_bad_ranges() -> None:
    frame = codec.encode_frame(diff({"a": torch.zeros(4)}, {"a": torch.ones(4)}).deltas["a"], 1)
    with pytest.raises(ValueError, match="overlap"):
        codec.join_parts([(0, 4, frame), (2, 4, frame)])
    with pytest.raises(ValueError, match="at least one"):
        codec.join_parts([(0, 4, (codec.UNCHANGED, 0, b""))])
    with pytest.raises(ValueError, match="cannot be a part"):
        codec.join_parts([(0, 4, (codec.CLASSED, 1, b"x"))])


# ---------------------------------------------------------------- corrupt index fields

_ROW = struct.Struct("<QQBQQ")


@pytest.fixture(scope="module")
def pair() -> tuple[dict, dict]:
    base = {
        "a": random_bits((64, 64), torch.bfloat16, 3),
        "b": random_bits((300,), torch.float32, 4),
    }
    new = {n: change(t, 0.05, "random", 5) for n, t in base.items()}
    new["a"][40:44] = 0  # a dense range: one of a's parts takes coding 2
    return base, new


@pytest.fixture(scope="module")
def data(pair: tuple) -> bytes:
    out = _as_parts(diff(*pair), [1000, 2560, 2816])
    assert {r.coding for r in codec.read_header(out).rows} == {codec.PARTS}
    return out


def _frame(data: bytes) -> bytes:
    row = codec.read_header(data).rows[0]
    return data[row.offset : row.offset + row.size]


def _index(frame: bytes) -> list[list[int]]:
    (n,) = struct.unpack_from("<I", frame)
    return [list(_ROW.unpack_from(frame, 4 + i * _ROW.size)) for i in range(n)]


def _reindexed(data: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """``data`` with part rows of a's frame edited (bodies kept)."""
    frame = _frame(data)
    rows = _index(frame)
    body = frame[4 + len(rows) * _ROW.size :]
    rows = edit(rows)
    new = struct.pack("<I", len(rows)) + b"".join(_ROW.pack(*r) for r in rows) + body
    return rebuild(data, lambda r, f: f.__setitem__("a", new))


def _set(i: int, field: int, value: int):  # type: ignore[no-untyped-def]
    def edit(rows: list) -> list:
        rows[i][field] = value
        return rows

    return edit


CASES = [
    (
        "no parts",
        lambda d: rebuild(d, lambda r, f: f.__setitem__("a", bytes(4))),
        MalformedPatchError,
        "0 parts",
    ),
    (
        "index cut short",
        lambda d: rebuild(d, lambda r, f: f.__setitem__("a", _frame(d)[:30])),
        CountMismatchError,
        "inside its index",
    ),
    ("ranges out of order", _set(1, 0, 0), MalformedPatchError, "out of order"),
    ("empty range", _set(0, 1, 0), MalformedPatchError, "out of order"),
    ("range past the tensor", _set(2, 1, 5000), MalformedPatchError, "outside"),
    ("a class-coded part", _set(0, 2, codec.CLASSED), MalformedPatchError, "cannot be a part"),
    ("a part's count off", _set(0, 3, 1), CountMismatchError, "parts change"),
    ("a part's size past the frame", _set(2, 4, 10**6), CountMismatchError, "past its frame"),
    (
        "bytes after the parts",
        lambda d: rebuild(d, lambda r, f: f.__setitem__("a", _frame(d) + b"\0")),
        CountMismatchError,
        "after the last part",
    ),
    ("more changes than its range", _set(0, 1, 3), CountMismatchError, "changes in 3 elements"),
    (
        "coding 5 in a version-3 file",
        lambda d: rebuild(d, lambda r, f: None, header_version=3),
        UnsupportedFormatError,
        "coding 5 in format 3",
    ),
]


@pytest.mark.parametrize(("case", "corrupt", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_corrupt_parts_raise_their_own_error(pair, data, case, corrupt, error, message) -> None:
    bad = (
        corrupt(data)
        if case.startswith(("no parts", "index", "bytes", "coding 5"))
        else _reindexed(data, corrupt)
    )
    with pytest.raises(error, match=message):
        codec.decode(bad)


def test_a_position_outside_its_range_is_refused(data: bytes) -> None:
    """A part whose range is cut to end just before its last change: the part's own decoder
    finds that position outside the range it was given."""
    rows = _index(_frame(data))
    positions = codec.decode(data).deltas["a"].positions
    last = int(positions[positions < rows[0][1]][-1])
    bad = _reindexed(data, _set(0, 1, last))
    with pytest.raises(IndexOutOfRangeError):
        codec.decode(bad)


# ---------------------------------------------------------------- mutation fuzz


def test_mutation_fuzz_only_raises_patch_errors(pair: tuple, data: bytes) -> None:
    """Mutants of the file, and of a's frame under a valid table (its index has no checksum)."""
    rng = random.Random(7)
    for _ in range(800):
        _check_mutant(mutate_bytes(data, rng), pair)
    for _ in range(800):
        frame = mutate_bytes(_frame(data), rng, flips=0.8, cuts=0.9)
        _check_mutant(rebuild(data, lambda r, f, x=frame: f.__setitem__("a", x)), pair)
