"""Diff, apply, merge on the built-in workload and on hand-built cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2p_sync import codec
from p2p_sync.errors import ChainBrokenError, LayoutMismatchError, TargetMismatchError
from p2p_sync.weights.patch import Patch, TensorDelta, apply, diff, merge
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.tensors import layout_of
from p2p_sync.weights.workloads import Workload
from tests.helpers import bit_equal, clone_set


def test_chain_of_ten_patches_reaches_the_final_version(tiny_versions: list) -> None:
    weights = clone_set(tiny_versions[0])
    for prev, nxt in zip(tiny_versions, tiny_versions[1:]):
        data = codec.encode(diff(prev, nxt))
        apply(weights, codec.decode(data))
        assert bit_equal(weights, nxt)
    assert state_hash(weights) == state_hash(tiny_versions[10])


def test_merged_chain_equals_direct_diff_on_workload(tiny_versions: list) -> None:
    patches = [
        codec.decode(codec.encode(diff(a, b))) for a, b in zip(tiny_versions, tiny_versions[1:])
    ]
    merged = merge(patches)
    direct = diff(tiny_versions[0], tiny_versions[10])
    assert codec.encode(merged) == codec.encode(direct)
    weights = clone_set(tiny_versions[0])
    apply(weights, merged)
    assert bit_equal(weights, tiny_versions[10])


def test_workload_changes_a_small_fraction_and_is_deterministic(tiny_versions: list) -> None:
    again = list(Workload("tiny", lr=1e-4, seed=1).versions(3))
    assert all(bit_equal(a, b) for a, b in zip(again, tiny_versions))
    p = diff(tiny_versions[0], tiny_versions[1])
    assert 0.001 < p.changed / p.numel < 0.5
    assert all(t.dtype == torch.bfloat16 for t in tiny_versions[0].values())


def test_changes_that_cancel_out_vanish_from_the_merge() -> None:
    a = {"w": torch.zeros(10, dtype=torch.bfloat16)}
    b = {"w": a["w"].clone()}
    b["w"][3] = 1.0
    merged = merge([diff(a, b), diff(b, a)])
    assert merged.deltas == {} and merged.base_hash == merged.target_hash == state_hash(a)


def test_merge_refuses_a_broken_chain(tiny_versions: list) -> None:
    p01 = diff(tiny_versions[0], tiny_versions[1])
    p23 = diff(tiny_versions[2], tiny_versions[3])
    with pytest.raises(ChainBrokenError, match="does not follow"):
        merge([p01, p23])


def test_dense_and_sparse_codings_are_chosen_by_size() -> None:
    base = {"dense": torch.zeros(4096, dtype=torch.bfloat16), "sparse": torch.zeros(4096)}
    new = {"dense": torch.ones(4096, dtype=torch.bfloat16), "sparse": torch.zeros(4096)}
    new["sparse"][[5, 4000]] = 2.0
    info = codec.read_header(codec.encode(diff(base, new)))
    coding = {r.spec.name: r.coding for r in info.rows}
    assert coding == {"dense": codec.DENSE, "sparse": codec.SPARSE}


def test_large_gaps_use_escapes_and_round_trip() -> None:
    base = {"w": torch.zeros(300_000, dtype=torch.float16)}
    new = {"w": base["w"].clone()}
    new["w"][[0, 70_000, 299_999]] = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float16)
    weights = clone_set(base)
    apply(weights, codec.decode(codec.encode(diff(base, new))))
    assert bit_equal(weights, new)


def test_apply_refuses_a_different_layout(tiny_versions: list) -> None:
    patch = diff(tiny_versions[0], tiny_versions[1])
    weights = clone_set(tiny_versions[0])
    name = next(iter(weights))
    weights[name] = weights[name].float()
    before = clone_set(weights)
    with pytest.raises(LayoutMismatchError, match=name):
        apply(weights, patch)
    assert bit_equal(weights, before)


def test_inconsistent_patch_is_undone_after_target_check(tiny_versions: list) -> None:
    good = diff(tiny_versions[0], tiny_versions[1])
    name, delta = next(iter(good.deltas.items()))
    tampered = dict(good.deltas)
    tampered[name] = TensorDelta(delta.spec, delta.positions, delta.deltas + 1)
    bad = Patch(good.layout, good.base_hash, good.target_hash, tampered)
    weights = clone_set(tiny_versions[0])
    with pytest.raises(TargetMismatchError, match="undone"):
        apply(weights, bad)
    assert bit_equal(weights, tiny_versions[0])


def test_diff_refuses_mismatched_layouts() -> None:
    with pytest.raises(LayoutMismatchError, match="'b'"):
        diff({"a": torch.zeros(3)}, {"a": torch.zeros(3), "b": torch.zeros(1)})


def test_layout_is_name_sorted_and_hash_sees_every_bit() -> None:
    t = {"z": torch.zeros(4), "a": torch.zeros(2, dtype=torch.bfloat16)}
    assert [s.name for s in layout_of(t)] == ["a", "z"]
    flipped = clone_set(t)
    flipped["z"][1] = -0.0  # same float value, different bits
    assert state_hash(flipped) != state_hash(t)
    assert np.array_equal(flipped["z"].numpy(), t["z"].numpy())
