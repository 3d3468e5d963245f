"""Hypothesis properties: diff -> encode -> decode -> apply reproduces the target bit for bit."""

from __future__ import annotations

from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_sync import codec
from p2p_sync.codec import frames as codec_frames
from p2p_sync.codec import kernels as codec_kernels
from p2p_sync.store.restore import apply_frames
from p2p_sync.weights import merge as merge_mod
from p2p_sync.weights import patch as patch_mod
from p2p_sync.weights.patch import TensorDelta, apply, diff, merge, merge_tensor
from p2p_sync.weights.statehash import StateDigest
from p2p_sync.weights.tensors import TensorSpec, bits_dtype, flat_bits, layout_of
from tests.helpers import bit_equal, clone_set, random_bits

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int32,
    torch.int64,
    torch.float8_e4m3fn,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (33, 17), (4001,), (2, 3, 5, 7)]
# fraction of elements to change; -1 stands for "exactly one element"
DENSITIES = [0.0, -1, 0.001, 0.01, 0.05, 0.13, 0.3, 0.6, 1.0]
KINDS = ["ulp", "random", "sign_cross", "special"]

# Float bit patterns that trip naive float code: NaN payloads, infinities, signed zeros.
SPECIAL_F32 = np.array(
    [0x7FC00001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0, 1, 0x7FFFFFFF, 0x80000001],
    dtype=np.uint32,
).view(np.int32)


def special_bits(width: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Special patterns of the element width (truncated float32 patterns + extremes)."""
    floats = SPECIAL_F32.astype(np.int64) >> max(0, 32 - 8 * width)
    extremes = [-(1 << (8 * width - 1)), (1 << (8 * width - 1)) - 1, -1, 0]
    base = np.concatenate([floats, extremes])
    return rng.choice(base, size=n)


def change(base: torch.Tensor, density: float, kind: str, seed: int) -> torch.Tensor:
    """A copy of ``base`` with the chosen fraction of elements changed in the chosen way."""
    new = base.clone()
    n = base.numel()
    if n == 0 or density == 0.0:
        return new
    rng = np.random.default_rng(seed)
    count = 1 if density < 0 else max(1, round(density * n))
    pos = torch.from_numpy(rng.choice(n, size=count, replace=False))
    bits = flat_bits(new)
    width = base.element_size()
    idt = bits_dtype(base.dtype) if base.dtype != torch.bool else torch.int8
    if kind == "ulp":
        step = torch.from_numpy(rng.choice([-1, 1, 2, -2], size=count)).to(idt)
        bits[pos] = bits[pos] + step
    elif kind == "random":
        bits[pos] = torch.from_numpy(rng.integers(-(1 << 62), 1 << 62, size=count)).to(idt)
    elif kind == "sign_cross":
        bits[pos] = bits[pos] ^ torch.tensor(-(1 << (8 * width - 1)), dtype=torch.int64).to(idt)
    else:
        bits[pos] = torch.from_numpy(special_bits(width, count, rng)).to(idt)
    if base.dtype == torch.bool:
        bits &= 1  # keep bool storage canonical (0 or 1)
    return new


@st.composite
def version_pairs(draw: st.DrawFn) -> tuple[dict, dict]:
    """A base tensor set of 1-3 tensors and a changed copy."""
    k = draw(st.integers(1, 3))
    base, new = {}, {}
    for i in range(k):
        dtype, shape = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))
        seed = draw(st.integers(0, 2**32 - 1))
        t = random_bits(shape, dtype, seed)
        base[f"t{i}"] = t
        new[f"t{i}"] = change(
            t, draw(st.sampled_from(DENSITIES)), draw(st.sampled_from(KINDS)), seed + 1
        )
    return base, new


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_pairs())
def test_encode_decode_apply_is_bit_exact(pair: tuple[dict, dict]) -> None:
    base, new = pair
    patch = diff(base, new)
    data = codec.encode(patch)
    decoded = codec.decode(data)
    assert decoded.base_hash == patch.base_hash and decoded.target_hash == patch.target_hash
    assert decoded.changed == patch.changed
    weights = clone_set(base)
    apply(weights, decoded)
    assert bit_equal(weights, new)
    assert codec.encode(decoded) == data  # the encoding is canonical


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_pairs(), st.integers(1, 9), st.integers(0, 2))
def test_a_frame_decoded_in_blocks_is_the_frame_decoded_whole(
    pair: tuple[dict, dict], block: int, gaps: int
) -> None:
    """Blocks of positions (what a rollout applies, one at a time) put together are the
    frame's positions and deltas, and applying them block by block gives the target exactly,
    its hash tracked. ``gaps`` > 0 adds a tensor with gaps past the 16-bit escape."""
    base, new = pair
    if gaps:
        t = random_bits((300_000,), torch.bfloat16, gaps)
        base["far"], new["far"] = t, t.clone()
        flat_bits(new["far"])[[5, 70_000, 70_001, 299_999][: gaps + 2]] += 1
    data = codec.encode(diff(base, new))
    info = codec.read_header(data)
    for row in info.rows:
        if row.coding == codec.UNCHANGED:
            continue
        frame = memoryview(data)[row.offset : row.offset + row.size]
        whole = codec.decode_frame(row, frame)
        parts = list(codec.decode_frame_blocks(row, frame, block=block))
        with mock.patch.object(codec_kernels, "_KERNELS", {"fast": False}):  # numpy's way, no numba
            plain = list(codec.decode_frame_blocks(row, frame, block=block))
        assert len(plain) == len(parts) and all(a.same_change(b) for a, b in zip(plain, parts))
        if row.coding == codec.SPARSE and row.count > block:
            assert len(parts) == -(-row.count // block)
            assert max(p.positions.numel() for p in parts) <= block
            assert torch.equal(torch.cat([p.positions for p in parts]), whole.positions)
            assert torch.equal(torch.cat([p.deltas for p in parts]), whole.deltas)
        else:
            assert len(parts) == 1 and parts[0].same_change(whole)
    weights, digest = clone_set(base), StateDigest.of(base)
    old, codec_frames.BLOCK = codec_frames.BLOCK, block
    try:
        apply_frames(weights, memoryview(data), info, digest)
    finally:
        codec_frames.BLOCK = old
    assert bit_equal(weights, new) and digest.hash() == info.target_hash


@settings(max_examples=60, deadline=None)
@given(st.lists(version_pairs(), min_size=1, max_size=1), st.integers(2, 5), st.integers(0, 9))
def test_merged_chain_equals_direct_diff(pairs: list, steps: int, seed: int) -> None:
    base, _ = pairs[0]
    chain = [base]
    for i in range(steps):
        nxt = {
            k: change(v, 0.05, ["ulp", "random", "sign_cross"][i % 3], seed * 31 + i)
            for k, v in chain[-1].items()
        }
        chain.append(nxt)
    patches = [diff(a, b) for a, b in zip(chain, chain[1:])]
    merged, direct = merge(patches), diff(chain[0], chain[-1])
    assert merged.base_hash == direct.base_hash and merged.target_hash == direct.target_hash
    assert merged.deltas.keys() == direct.deltas.keys()
    assert all(merged.deltas[k].same_change(direct.deltas[k]) for k in direct.deltas)
    assert codec.encode(merged) == codec.encode(direct)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300), st.sampled_from([1, 2, 4, 8]))
def test_value_section_round_trips(values: list[int], width: int) -> None:
    lo, hi = -(1 << (8 * width - 1)), (1 << (8 * width - 1)) - 1
    d = np.array([min(max(v, lo), hi) for v in values], dtype=f"<i{width}")
    head, body = codec.encode_values(d)
    raw = head + b"".join(body)
    out = codec.decode_values(memoryview(raw), d.size, width, "t")
    assert out.dtype == d.dtype and np.array_equal(out, d)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 2**34 - 1), max_size=200), st.sampled_from([2**20, 2**34]))
def test_positions_round_trip_with_escapes(positions: set[int], numel: int) -> None:
    """Compiled and numpy (no numba) gap coders write the same bytes, and both read them."""
    pos = np.array(sorted(p for p in positions if p < numel), dtype=np.int64)
    head, body = codec.encode_positions(pos, numel)
    raw = head + b"".join(body)
    with mock.patch.object(codec_kernels, "_KERNELS", {"fast": False}):
        head2, body2 = codec.encode_positions(pos, numel)
        assert head2 + b"".join(body2) == raw
        out = codec.decode_positions(memoryview(raw), pos.size, numel, "t")
        assert np.array_equal(out, pos)
    out = codec.decode_positions(memoryview(raw), pos.size, numel, "t")
    assert np.array_equal(out, pos)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 3))
def test_gap_statistics_kernel_counts_like_numpy(raw: bytes, markers: int) -> None:
    """The compiled pass that checks a position body (escape markers, sum of the gaps) gives
    numpy's counts for any byte planes, markers planted or not."""
    planes = np.frombuffer(raw[: len(raw) // 2 * 2], np.uint8).reshape(2, -1).copy()
    planes[:, : min(markers, planes.shape[1])] = 0xFF
    lo, hi = planes
    marks, total = codec._kernels()["gap_stats"](lo, hi)
    assert marks == int(np.count_nonzero((lo == 0xFF) & (hi == 0xFF)))
    assert total == int(lo.sum(dtype=np.int64)) + 256 * int(hi.sum(dtype=np.int64))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_pairs(), st.sampled_from([8, 24, 1 << 20]), st.booleans(), st.booleans())
def test_one_pass_host_diff_equals_diff_then_sums(
    pair: tuple[dict, dict], entries: int, advance: bool, unaligned: bool
) -> None:
    """The diff kernel (changed elements, digest and, with ``advance``, the base moved to the
    new version in one pass) gives what the two-pass way gives: the same delta, sparse or
    dense, and the new version's sums; also when its output fills up many times over (small
    ``entries``) and for views whose words are not their memory (then two-pass)."""
    base, new = pair
    if unaligned:  # each tensor a view one element into a larger buffer
        base = {
            k: torch.cat([v.reshape(-1)[:1], v.reshape(-1)])[1:].view(v.shape)
            for k, v in base.items()
        }
    scratch = patch_mod.DiffScratch()
    scratch.positions = np.empty(entries, np.int64)
    scratch._deltas = np.empty(entries * 8, np.uint8)
    digest, reference = StateDigest.of(base), StateDigest.of(new)
    before = clone_set(base)
    for spec in layout_of(base):
        want = patch_mod.diff_tensor(spec, before[spec.name], new[spec.name])
        got = patch_mod.diff_tracked(
            spec, base[spec.name], new[spec.name], digest, scratch, advance
        )
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert (got.positions is None) == (want.positions is None)
            if got.positions is not None:
                assert torch.equal(got.positions, want.positions)
            assert got.deltas.dtype == want.deltas.dtype and torch.equal(got.deltas, want.deltas)
    assert digest.hash() == reference.hash()
    assert bit_equal(base, new if advance else before)


@st.composite
def sorted_parts(draw: st.DrawFn) -> tuple[torch.dtype, int, list[tuple[np.ndarray, np.ndarray]]]:
    """A tensor's dtype, its size (crossing merge windows) and 1-6 parts, each with strictly
    increasing positions; deltas are drawn from a few values so sums often cancel and wrap."""
    dtype = draw(st.sampled_from([torch.int8, torch.bfloat16, torch.float32, torch.float64]))
    numel = draw(st.sampled_from([1, 63, 64, 4095, 4097, 20_000]))
    width = dtype.itemsize
    top = (1 << (8 * width - 1)) - 1
    values = np.array([1, -1, 2, -2, top, -top - 1], dtype=f"<i{width}")
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        seed, density = draw(st.integers(0, 2**16)), draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
        rng = np.random.default_rng(seed)
        pos = np.flatnonzero(rng.random(numel) < density).astype(np.int64)
        parts.append((pos, values[rng.integers(0, len(values), pos.size)]))
    return dtype, numel, parts


def _merged_by_definition(numel: int, dtype: torch.dtype, parts: list) -> dict[int, int]:
    acc = np.zeros(numel, dtype=f"<i{dtype.itemsize}")
    for pos, dels in parts:
        acc[pos] += dels  # positions within a part are distinct: no lost updates
    return {int(i): int(acc[i]) for i in np.flatnonzero(acc)}


@settings(max_examples=60, deadline=None)
@given(sorted_parts(), st.booleans())
def test_windowed_merge_sums_parts_exactly(case: tuple, shuffle: bool) -> None:
    """The compiled windowed merge, the same kernel as plain Python and the sort-based
    fallback all give the definition's sums (wrapping, cancelled sums dropped, positions
    ascending); a part whose positions do not increase is refused by the kernel and merged
    by the fallback instead."""
    dtype, numel, parts = case
    if shuffle:  # one part out of order: the kernel must notice, not write out of bounds
        pos, dels = parts[0]
        parts[0] = (pos[::-1].copy(), dels[::-1].copy())
    spec = TensorSpec("w", (numel,), dtype)
    deltas = [TensorDelta(spec, torch.from_numpy(p), torch.from_numpy(d)) for p, d in parts]
    want = _merged_by_definition(numel, dtype, parts)
    got = merge_tensor(spec, deltas) if len(deltas) > 1 else None
    if got is not None:
        dense = got.positions is None
        pos = torch.nonzero(got.deltas).reshape(-1) if dense else got.positions
        vals = got.deltas[pos] if dense else got.deltas
        assert {int(p): int(v) for p, v in zip(pos, vals)} == want
        assert dense or bool((pos[1:] > pos[:-1]).all())
    elif len(deltas) > 1:
        assert want == {}
    cat_pos = np.concatenate([p for p, _ in parts])
    cat_del = np.concatenate([d for _, d in parts])
    starts = np.cumsum([0] + [p.size for p, _ in parts]).astype(np.int64)
    unordered = shuffle and parts[0][0].size > 1
    for kernel in (merge_mod._merge_kernel(), merge_mod._merge_windows_py):
        out_pos, out_del = np.empty_like(cat_pos), np.empty_like(cat_del)
        with np.errstate(over="ignore"):  # the de Bruijn product wraps by design
            n = kernel(cat_pos, cat_del, starts, out_pos, out_del, merge_mod._DE_BRUIJN)
        if unordered:
            assert n == -1
        else:
            assert dict(zip(out_pos[:n].tolist(), out_del[:n].tolist())) == want
            assert list(out_pos[:n]) == sorted(want)
