"""Catch-up patches merged tensor by tensor from encoded steps (``p2p_sync.codec.catchup``): the
same
file as decoding, merging and encoding whole patches; broken inputs refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync import codec
from p2p_sync.codec import frames as codec_frames
from p2p_sync.codec.catchup import merge_steps
from p2p_sync.errors import ChainBrokenError, LayoutMismatchError, MissingBaseError
from p2p_sync.weights.patch import apply, diff, merge
from tests.codec.test_roundtrip_properties import KINDS, change, version_pairs
from tests.helpers import bit_equal, clone_set, random_bits


def chain_of(base: dict, steps: int, density: float, seed: int) -> list[dict]:
    chain = [base]
    for i in range(steps):
        kind = KINDS[(seed + i) % len(KINDS)]
        chain.append({k: change(v, density, kind, seed * 31 + i) for k, v in chain[-1].items()})
    return chain


@pytest.mark.slow  # started first by `make test`'s parallel pass
@settings(max_examples=60, deadline=None)
@given(
    version_pairs(),
    st.integers(1, 5),
    st.sampled_from([0.001, 0.05, 0.3, 1.0]),
    st.integers(0, 99),
    st.sampled_from([1, 3]),
    st.sampled_from([codec.BLOCK, 7]),
)
def test_merged_steps_equal_the_whole_patch_merge(
    pair: tuple[dict, dict], steps: int, density: float, seed: int, workers: int, block: int
) -> None:
    """Also with frames decoded 7 positions a block (each step's blocks are written end to
    end into one buffer before the sum)."""
    chain = chain_of(pair[0], steps, density, seed)
    encoded = [codec.encode(diff(a, b)) for a, b in zip(chain, chain[1:])]
    old, codec_frames.BLOCK = codec_frames.BLOCK, block
    try:
        data = merge_steps(encoded, workers=workers)
    finally:
        codec_frames.BLOCK = old
    assert data == codec.encode(merge([codec.decode(s) for s in encoded]))
    weights = clone_set(chain[0])
    apply(weights, codec.decode(data))
    assert bit_equal(weights, chain[-1])


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return {"w": random_bits((64, 8), torch.bfloat16, seed), "b": random_bits((8,), torch.int8, 1)}


def test_steps_that_do_not_chain_are_refused() -> None:
    chain = chain_of(tensors(0), 3, 0.1, 5)
    first, third = (codec.encode(diff(a, b)) for a, b in (chain[:2], chain[2:]))
    with pytest.raises(ChainBrokenError):
        merge_steps([first, third])


def test_steps_of_another_layout_are_refused() -> None:
    a = chain_of(tensors(0), 1, 0.1, 5)
    other = {"w": a[1]["w"], "c": random_bits((8,), torch.int8, 2)}
    step = codec.encode(diff(a[0], a[1]))
    foreign = codec.encode(diff(other, {**other, "w": change(other["w"], 0.1, "ulp", 9)}))
    with pytest.raises(LayoutMismatchError):
        merge_steps([step, foreign])


def test_exponent_class_steps_are_refused(tiny_versions: list) -> None:
    data = codec.encode(diff(tiny_versions[0], tiny_versions[1]), base=tiny_versions[0])
    assert any(r.coding == codec.CLASSED for r in codec.read_header(data).rows)
    with pytest.raises(MissingBaseError):
        merge_steps([data])


def test_a_span_of_real_steps_equals_the_direct_patch(tiny_versions: list) -> None:
    steps = [codec.encode(diff(a, b)) for a, b in zip(tiny_versions[:4], tiny_versions[1:5])]
    assert merge_steps(steps, workers=2) == codec.encode(diff(tiny_versions[0], tiny_versions[4]))


def test_no_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_steps([])
