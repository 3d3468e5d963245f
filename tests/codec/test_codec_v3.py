"""Format 3 (coding 4: exponent classes per segment, capped Rice codes, no zstd): round trips on
the host kernels and on torch ops (the path a GPU takes, run here on the CPU) with the same
bytes, canonical output, its own error per corrupt field, and a mutation fuzz that only ever
sees patch errors and never touches the weights."""

from __future__ import annotations

import contextlib
import random
import struct
import time
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_sync import codec
from p2p_sync.codec import bitstreams, segmented
from p2p_sync.errors import (
    CountMismatchError,
    IndexOutOfRangeError,
    MalformedPatchError,
    MissingBaseError,
    P2PSyncError,
    PatchError,
    UnsupportedFormatError,
)
from p2p_sync.weights.patch import apply, diff
from p2p_sync.weights.tensors import flat_bits, layout_of
from tests.codec.test_codec_v2 import float_pairs
from tests.codec.test_roundtrip_properties import DENSITIES, KINDS, change
from tests.helpers import bit_equal, clone_set, mutate_bytes, random_bits, rebuild

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(1,), (7,), (3, 5), (33, 17), (4001,), (2, 3, 5, 7), (130, 40)]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def small_segments() -> contextlib.ExitStack:
    """Segments of 4-64 elements, so the small tensors of these tests span many of them."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(segmented, "MIN_SPAN", 2))
    stack.enter_context(mock.patch.object(segmented, "SEGMENT_CHANGES", 8))
    return stack


def _frames(base: torch.Tensor, new: torch.Tensor) -> tuple:
    """(delta, the frame by the host kernels, the frame by torch ops)."""
    delta = diff({"t": base}, {"t": new}).deltas["t"]
    host = codec.scan_view(base)
    return (
        delta,
        segmented.encode_segmented(delta, host),
        segmented.encode_segmented(delta, torch.from_numpy(host)),
    )


@SETTINGS
@given(float_pairs(FLOATS, SHAPES, DENSITIES[1:]))
def test_segmented_frame_round_trips_on_both_paths_with_the_same_bytes(pair: tuple) -> None:
    base, new = pair
    if torch.equal(flat_bits(base), flat_bits(new)):
        return
    with small_segments():
        delta, host, ops = _frames(base, new)
        assert host == ops
        bits = codec.scan_view(base)
        for view in (bits, torch.from_numpy(bits)):
            out = segmented.decode_segmented(memoryview(host), delta.spec, delta.count, view)
            pos, d = delta.to_sparse()
            assert torch.equal(out.positions, pos) and torch.equal(out.deltas, d)


@SETTINGS
@given(st.lists(st.integers(0, 2**47), max_size=300), st.integers(0, 2**16))
def test_capped_rice_streams_agree_on_both_paths(values: list[int], seed: int) -> None:
    """Kernel and torch ops write the same bytes, and read back in parts they give the values,
    outliers past the cap included."""
    v = torch.tensor(values, dtype=torch.int64)
    rng = np.random.default_rng(seed)
    cls = torch.from_numpy(rng.integers(0, 16, v.numel()))
    table = torch.from_numpy(rng.integers(0, 12, 16))
    k = table[cls]
    half = v.numel() // 3
    parts = [(v[:half], cls[:half]), (v[half:], cls[half:])]
    unary, rem = bitstreams.encode(parts, [table, table], host=True)
    on_device = bitstreams.encode(parts, [table, table], host=False)
    assert torch.equal(on_device[0], unary) and torch.equal(on_device[1], rem)
    ops_unary, ops_rem = bitstreams.encode_ops(v, k)
    assert torch.equal(unary, ops_unary) and torch.equal(rem, ops_rem)
    reader = bitstreams.OpsReader(unary, rem, "t")
    half = v.numel() // 2
    got = torch.cat([reader.take(k[:half]), reader.take(k[half:])])
    reader.finish()
    assert torch.equal(got, v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_v3_file_decodes_applies_and_re_encodes_to_the_same_bytes(count: int, seed: int) -> None:
    rng = random.Random(seed)
    base, new = {}, {}
    for i in range(count):
        dtype = rng.choice([*FLOATS, torch.int32, torch.float64])
        base[f"t{i}"] = random_bits(rng.choice(SHAPES), dtype, seed + i)
        new[f"t{i}"] = change(base[f"t{i}"], rng.choice(DENSITIES), rng.choice(KINDS), seed + 9)
    patch = diff(base, new)
    with small_segments():
        data = codec.encode(patch, base=base, segmented=True)
        info = codec.read_header(data)
        codings = {r.coding for r in info.rows}
        assert info.version == (
            3 if codec.SEGMENTED in codings else 2 if codec.CLASSED in codings else 1
        )
        segmentable = [r for r in info.rows if r.count and codec.segmented_dtype(r.spec.dtype)]
        assert all(r.coding == codec.SEGMENTED for r in segmentable)
        decoded = codec.decode(data, base=base)
        weights = clone_set(base)
        apply(weights, decoded)
        assert bit_equal(weights, new)
        assert codec.encode(decoded, base=base, segmented=True) == data


def test_real_weights_take_coding_4_and_beat_format_2(tiny_versions: list) -> None:
    base, new = tiny_versions[0], tiny_versions[1]
    patch = diff(base, new)
    v3 = codec.encode(patch, base=base, segmented=True)
    rows = codec.read_header(v3).rows
    assert all(r.coding == codec.SEGMENTED for r in rows if r.count)
    assert len(v3) < len(codec.encode(patch, base=base)) * 1.03
    assert sorted(codec.check_without_base(v3)) == sorted(r.spec.name for r in rows if r.count)


# ---------------------------------------------------------------- corrupt input


def _pair() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g, dtype=torch.float64) * 0.02
    step = (torch.randint(0, 2, w.shape, generator=g) * 2 - 1) * 5e-6
    b = torch.randn(5000, generator=g, dtype=torch.float64) * 0.02
    return (
        {"a": w.to(torch.bfloat16), "b": b.to(torch.float32)},
        {"a": (w + step).to(torch.bfloat16), "b": (b + 3e-9).to(torch.float32)},
    )


@pytest.fixture()
def pair() -> tuple[dict, dict]:
    return _pair()


@pytest.fixture()
def data(pair: tuple) -> bytes:
    """A v3 patch whose frames hold several segments each (2^12 elements: the smallest)."""
    out = codec.encode(diff(*pair), base=pair[0], segmented=True)
    assert all(r.coding == codec.SEGMENTED for r in codec.read_header(out).rows)
    return out


def _frame(data: bytes, i: int = 0) -> bytes:
    row = codec.read_header(data).rows[i]
    return data[row.offset : row.offset + row.size]


def _with_frame(data: bytes, frame: bytes, i: int = 0, count: int | None = None) -> bytes:
    def mutate(rows: list, frames: dict) -> None:
        frames[rows[i].spec.name] = frame
        if count is not None:
            rows[i] = codec.FrameInfo(rows[i].spec, rows[i].coding, count, 0, 0)

    return rebuild(data, mutate)


def _poke(data: bytes, offset: int, value: int) -> bytes:
    frame = bytearray(_frame(data))
    frame[offset] = value
    return _with_frame(data, bytes(frame))


def _class_field(c: int, field: int) -> int:
    return 1 + c * 6 + field


CASES = [
    ("span out of range", lambda d: _poke(d, 0, 60), MalformedPatchError, "span"),
    (
        "parameter past range",
        lambda d: _poke(d, _class_field(3, 2), 41),
        MalformedPatchError,
        "range",
    ),
    ("unknown mode", lambda d: _poke(d, _class_field(3, 5), 2), MalformedPatchError, "mode"),
    ("frame cut short", lambda d: _with_frame(d, _frame(d)[:-1]), CountMismatchError, "size"),
    (
        "count one less",
        lambda d: _with_frame(d, _frame(d), count=codec.read_header(d).rows[0].count - 8),
        CountMismatchError,
        "size|add up",
    ),
    (
        "coding 4 in a version-2 file",
        lambda d: rebuild(d, lambda r, f: None, header_version=2),
        UnsupportedFormatError,
        "coding 4 in format 2",
    ),
    (
        "sign padding set",
        lambda d: _with_frame(d, _frame(d)[:-1] + bytes([_frame(d)[-1] | 0x80])),
        MalformedPatchError,
        "pads",
    ),
]


@pytest.mark.parametrize(("case", "corrupt", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_corrupt_v3_patch_raises_its_own_error(pair, data, case, corrupt, error, message) -> None:
    bad = corrupt(data)
    with pytest.raises(error, match=message):
        codec.decode(bad, base=pair[0])


def test_a_rank_past_its_class_is_refused(pair: tuple) -> None:
    """A frame whose one change names rank 0 of a class the base's segment lacks."""
    base = {"a": torch.full((64,), 1.0, dtype=torch.bfloat16)}  # every element in one class
    new = {"a": base["a"].clone()}
    new["a"][5] = 2.0  # a change in the one class present
    good = codec.encode(diff(base, new), base=base, segmented=True)
    other = {"a": torch.full((64,), 4.0, dtype=torch.bfloat16)}  # same layout, another class
    with pytest.raises(IndexOutOfRangeError, match="past its class"):
        segmented.decode_segmented(_frame(good), layout_of(base)[0], 1, codec.scan_view(other["a"]))


def test_a_huge_tensor_with_a_tiny_frame_is_refused_before_any_allocation() -> None:
    """2^40 elements in segments of 2^12 would need 2^32 group counts: the frame's few bytes
    cannot hold them, so it is refused from its head alone."""
    spec = layout_of({"t": torch.zeros(1, dtype=torch.bfloat16)})[0]
    huge = type(spec)(spec.name, (2**40,), spec.dtype)
    frame = bytes([12]) + bytes(16 * 6) + struct.pack("<QQ", 8, 0) + b"\xff" * 8 + b"\x01"
    with pytest.raises(CountMismatchError, match="too short"):
        segmented.read_codes(memoryview(frame), huge, 1, None)


def test_missing_base_is_refused(data: bytes) -> None:
    with pytest.raises(MissingBaseError):
        codec.decode(data)


# ---------------------------------------------------------------- mutation fuzz


def _mutate(blob: bytes, rng: random.Random) -> bytes:
    return mutate_bytes(blob, rng, flips=0.7, cuts=0.85, bits=True)


def _check_mutant(bad: bytes, pair: tuple, on_device: bool) -> None:
    base, new = pair
    weights = clone_set(base)
    start = time.perf_counter()
    try:
        if on_device:  # the torch-op path: decode frame by frame against torch base views
            info = codec.read_header(bad)
            for row in info.rows:
                view = flat_bits(weights[row.spec.name]).contiguous()
                codec.decode_frame(row, memoryview(bad)[row.offset : row.offset + row.size], view)
        else:
            apply(weights, codec.decode(bad, base=weights))
    except P2PSyncError as exc:
        assert isinstance(exc, PatchError)
        assert bit_equal(weights, base), "a refused patch changed the weights"
    else:
        if not on_device:
            assert bit_equal(weights, new)
    assert time.perf_counter() - start < 5, "a mutant took too long"


@pytest.mark.parametrize("on_device", [False, True], ids=["kernels", "torch-ops"])
def test_mutation_fuzz_only_raises_patch_errors(pair: tuple, data: bytes, on_device: bool) -> None:
    """Mutants of a valid v3 patch, of the file and of a frame's content under a valid table
    (no checksum guards a coding-4 frame: its parser meets every flipped bit)."""
    rng = random.Random(99)
    cases = 1500 if not on_device else 300
    for _ in range(cases):
        _check_mutant(_mutate(data, rng), pair, on_device)
    for _ in range(cases):
        i = rng.randrange(2)
        frame = _mutate(_frame(data, i), rng)
        _check_mutant(_with_frame(data, frame, i), pair, on_device)


def test_fields_of_every_width_survive_the_byte_window() -> None:
    """A raw field (48 bits) that starts at every bit offset of a byte reads back exactly."""
    for lead in range(8):
        v = torch.tensor([1] * lead + [2**47 + 12345], dtype=torch.int64)
        k = torch.tensor([1] * lead + [0], dtype=torch.int64)
        unary, rem = bitstreams.encode_ops(v, k)
        assert rem.numel() == (lead + bitstreams.RAW + 7) // 8
        assert torch.equal(bitstreams.OpsReader(unary, rem, "t").take(k), v)
