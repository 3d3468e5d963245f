"""Shards: each rank's block diffed and patched alone equals the whole tensor's diff and apply,
and the blocks' state-hash sums add up to the whole tensor's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.errors import ShardLayoutError
from p2p_sync.weights.delta import TensorDelta
from p2p_sync.weights.patch import diff_tensor
from p2p_sync.weights.shards import (
    Box,
    add_sums,
    merge_blocks,
    shard_apply,
    shard_diff,
    shard_sums,
    to_whole,
)
from p2p_sync.weights.statehash import sub, tensor_sums
from p2p_sync.weights.tensors import TensorSpec, flat_bits

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def _blocks(t: torch.Tensor, dim: int, cuts: list[int]) -> list[tuple[Box, torch.Tensor]]:
    """``t`` cut along ``dim`` at ``cuts``: each block as a rank holds it (contiguous)."""
    edges = [0, *cuts, t.shape[dim]]
    out = []
    for a, b in zip(edges, edges[1:]):
        offsets = tuple(a if d == dim else 0 for d in range(t.dim()))
        shape = tuple(b - a if d == dim else n for d, n in enumerate(t.shape))
        out.append((Box(tuple(t.shape), offsets, shape), t.narrow(dim, a, b - a).clone()))
    return out


def _sparse(d: TensorDelta | None) -> tuple[list[int], list[int]]:
    if d is None:
        return [], []
    if d.positions is None:
        pos = torch.nonzero(d.deltas).reshape(-1)
        return pos.tolist(), d.deltas[pos].tolist()
    return d.positions.tolist(), d.deltas.tolist()


@st.composite
def sharded(draw: st.DrawFn) -> tuple:
    dtype = draw(st.sampled_from(DTYPES))
    per_word = 8 // dtype.itemsize
    rows = draw(st.integers(1, 12))
    cols = per_word * draw(st.integers(1, 6))
    dim = draw(st.integers(0, 1))
    size = rows if dim == 0 else cols
    step = 1 if dim == 0 else per_word
    cuts = sorted(set(draw(st.lists(st.integers(1, max(size // step - 1, 1)), max_size=3))))
    cuts = [c * step for c in cuts if c * step < size]
    seed = draw(st.integers(0, 2**31 - 1))
    fraction = draw(st.floats(0.0, 1.0))
    return dtype, rows, cols, dim, cuts, seed, fraction


def _versions(dtype: torch.dtype, rows: int, cols: int, seed: int, fraction: float) -> tuple:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(rows, cols, generator=g).to(dtype)
    new = old.clone()
    mask = torch.rand(rows, cols, generator=g) < fraction
    new[mask] = torch.randn(rows, cols, generator=g).to(dtype)[mask]
    return old, new


@pytest.mark.parametrize("advance", [False, True], ids=["kept", "advanced"])
@settings(max_examples=60, deadline=None)
@given(sharded())
def test_blocks_diffed_alone_make_the_whole_tensors_diff_and_state(
    advance: bool, case: tuple
) -> None:
    """Every block's diff and sum moves make the whole tensor's; with ``advance`` each block
    has moved to the new version (dense changes too), else it is as it was."""
    dtype, rows, cols, dim, cuts, seed, fraction = case
    old, new = _versions(dtype, rows, cols, seed, fraction)
    spec = TensorSpec("w", (rows, cols), dtype)
    olds, news = _blocks(old, dim, cuts), _blocks(new, dim, cuts)
    assert add_sums([shard_sums(b, box) for box, b in olds]) == tensor_sums(old)
    kept = [b.clone() for _, b in olds]
    parts = [
        (box, *shard_diff(spec, box, a, b, advance=advance)) for (box, a), (_, b) in zip(olds, news)
    ]
    for (_, a), (_, b), k in zip(olds, news, kept):
        assert torch.equal(flat_bits(a), flat_bits(b if advance else k))
    merged = merge_blocks(spec, [to_whole(spec, box, d) for box, d, _ in parts if d is not None])
    assert _sparse(merged) == _sparse(diff_tensor(spec, old, new))
    moved = add_sums([m for *_, m in parts])
    assert moved == sub(tensor_sums(new), tensor_sums(old))


@settings(max_examples=60, deadline=None)
@given(sharded())
def test_blocks_written_by_their_runs_make_the_whole_tensor(case: tuple) -> None:
    """Each block's bytes, put run by run where ``Box.runs`` says, rebuild the whole tensor
    (what the ranks write into a sharded v0's snapshot file)."""
    dtype, rows, cols, dim, cuts, seed, fraction = case
    whole = _versions(dtype, rows, cols, seed, fraction)[1]
    out = torch.zeros(whole.numel(), dtype=dtype)
    for box, block in _blocks(whole, dim, cuts):
        run, starts = box.runs()
        flat = block.reshape(-1)
        assert len(starts) * run == flat.numel()
        for i, start in enumerate(starts.tolist()):
            out[start : start + run] = flat[i * run : (i + 1) * run]
    assert torch.equal(flat_bits(out), flat_bits(whole.reshape(-1)))


@settings(max_examples=60, deadline=None)
@given(sharded())
def test_each_rank_applies_the_part_of_a_patch_in_its_block(case: tuple) -> None:
    dtype, rows, cols, dim, cuts, seed, fraction = case
    old, new = _versions(dtype, rows, cols, seed, fraction)
    delta = diff_tensor(TensorSpec("w", (rows, cols), dtype), old, new)
    held = _blocks(old, dim, cuts)
    moved = [shard_apply(b, box, delta) if delta else (0, 0) for box, b in held]
    for (_, got), (_, want) in zip(held, _blocks(new, dim, cuts)):
        assert torch.equal(flat_bits(got), flat_bits(want))
    assert add_sums(moved) == sub(tensor_sums(new), tensor_sums(old))


def test_a_replicated_tensor_is_one_block_with_its_own_tail() -> None:
    t = torch.randn(5).bfloat16()  # 10 bytes: a padded last word
    assert shard_sums(t, Box.of_whole((5,))) == tensor_sums(t)


def test_a_scalar_is_a_block_of_its_own() -> None:
    old, new = torch.tensor(1.0), torch.tensor(2.0)
    spec, box = TensorSpec("step", (), torch.float32), Box.of_whole(())
    delta, moved = shard_diff(spec, box, old, new)
    assert delta is not None and _sparse(to_whole(spec, box, delta))[0] == [0]
    assert moved == sub(tensor_sums(new), tensor_sums(old))


@pytest.mark.parametrize(
    ("box", "itemsize"),
    [
        (Box((4, 6), (0, 2), (4, 4)), 2),  # columns 2..6 of bf16 rows: words straddle blocks
        (Box((4, 6), (1, 0), (2, 6)), 2),  # rows of 12 bytes: a word spans two rows
    ],
)
def test_a_block_that_splits_state_hash_words_is_refused(box: Box, itemsize: int) -> None:
    local = torch.zeros(box.shape, dtype=torch.bfloat16)
    with pytest.raises(ShardLayoutError, match="splits the 8-byte words"):
        shard_sums(local, box, "w")
    del itemsize
