"""A tensor-parallel engine's ranks, each with its blocks: the frames a node keeps while it
applies a version (exponent-class frames re-coded without the base) patch every block to the
new version's slice, and the blocks' sum moves add up to the whole tensors'."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync import codec
from p2p_sync.errors import LayoutMismatchError
from p2p_sync.runtime.tp_engine import FrameCollector, decoded
from p2p_sync.store.restore import apply_frames
from p2p_sync.weights.engine_shards import EngineShards
from p2p_sync.weights.layout import fused_qkv_gate_up
from p2p_sync.weights.patch import diff
from p2p_sync.weights.shards import Block, Box, add_sums
from p2p_sync.weights.statehash import StateDigest, sub, tensor_sums
from p2p_sync.weights.tensors import layout_of
from tests.helpers import vllm_rank


def _split(t: torch.Tensor, dim: int, ranks: int) -> list[tuple[Box, torch.Tensor]]:
    """``t`` split evenly along ``dim`` (column- or row-parallel), as each rank holds it."""
    size = t.shape[dim] // ranks
    out = []
    for r in range(ranks):
        offsets = tuple(r * size if d == dim else 0 for d in range(t.dim()))
        shape = tuple(size if d == dim else n for d, n in enumerate(t.shape))
        out.append((Box(tuple(t.shape), offsets, shape), t.narrow(dim, r * size, size).clone()))
    return out


def _model(seed: int, ranks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "qkv.weight": torch.randn(8 * ranks, 16, generator=g).bfloat16(),  # column-parallel
        "o.weight": torch.randn(16, 4 * ranks, generator=g).bfloat16(),  # row-parallel
        "norm.weight": torch.randn(16, generator=g).bfloat16(),  # replicated
    }


DIMS = {"qkv.weight": 0, "o.weight": 1}


def _ranks(
    weights: dict[str, torch.Tensor], ranks: int, dims: dict[str, int] = DIMS
) -> list[EngineShards]:
    layout = layout_of(weights)
    per_rank: list[dict[str, Block]] = [{} for _ in range(ranks)]
    for name, t in weights.items():
        if name in dims:
            for r, (box, local) in enumerate(_split(t, dims[name], ranks)):
                per_rank[r][name] = Block(local, box, True)
        else:  # every rank holds it whole; rank 0 counts it
            for r in range(ranks):
                per_rank[r][name] = Block(t.clone(), Box.of_whole(tuple(t.shape)), r == 0)
    return [EngineShards(layout, blocks) for blocks in per_rank]


def _changed(old: dict[str, torch.Tensor], seed: int, fraction: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    new = {}
    for n, t in old.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        moved = (t.float() * (1 + 0.01 * torch.randn(t.shape, generator=g))).to(t.dtype)
        new[n] = torch.where(mask, moved, t)
    return new


def _node_applies(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    classed: bool,
    shards: list[EngineShards],
) -> FrameCollector:
    """What a node keeps for its engine while it applies old -> new to its host copy."""
    host = {n: t.clone() for n, t in old.items()}
    data = codec.encode(diff(old, new), base=old if classed else None)
    if classed:
        assert any(r.coding == codec.CLASSED for r in codec.read_header(data).rows)
    collected = FrameCollector([s.boxes() for s in shards])
    info, digest = codec.read_header(data), StateDigest.of(host)
    apply_frames(host, memoryview(data), info, digest, 1, collected)
    assert all(torch.equal(host[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    return collected


@settings(max_examples=25, deadline=None)
@given(
    ranks=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**31 - 1),
    fraction=st.floats(0.0, 0.6),
)
def test_every_rank_patches_its_blocks_to_the_new_versions_slice(
    ranks: int, seed: int, fraction: float
) -> None:
    old = _model(seed, ranks)
    _check_ranks(old, _changed(old, seed + 1, fraction), _ranks(old, ranks), False)


def test_exponent_class_frames_reach_every_rank_re_coded(tiny_versions: list) -> None:
    """A real training step, coded against the base (format 2): ranks hold no base to decode
    those frames with, so the node re-codes what it decoded."""
    old, new = tiny_versions[0], tiny_versions[1]
    dims = {n: 0 if t.shape[0] % 2 == 0 else 1 for n, t in old.items() if t.dim() == 2}
    _check_ranks(old, new, _ranks(old, 2, dims), True)


def _check_ranks(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    shards: list[EngineShards],
    classed: bool,
) -> None:
    collected = _node_applies(old, new, classed, shards)
    sent = [f for frames in collected.frames for f in frames]
    assert all(f.coding != codec.CLASSED for f in sent)  # decodable without the base
    moves = [s.apply(decoded(collected.frames[r], s)) for r, s in enumerate(shards)]
    for name in new:
        want = sub(tensor_sums(new[name]), tensor_sums(old[name]))
        assert add_sums([m.get(name, (0, 0)) for m in moves]) == want, name
        for s in shards:
            b = s.blocks[name]
            region = tuple(slice(o, o + k) for o, k in zip(b.box.offsets, b.box.shape))
            assert torch.equal(b.local.view(torch.int16), new[name][region].view(torch.int16))


def test_a_rank_loads_its_block_of_a_whole_tensor_and_sums_its_share() -> None:
    w = _model(3, 2)
    shards = _ranks({n: torch.zeros_like(t) for n, t in w.items()}, 2)
    for s in shards:
        for name, t in w.items():
            s.load(name, t)
    sums = [s.sums() for s in shards]
    assert {n: add_sums([r[n] for r in sums]) for n in w} == StateDigest.of(w).sums


def test_an_engine_that_does_not_fit_is_named() -> None:
    shards = _ranks(_model(1, 2), 2)[0]
    other = {**_model(1, 2), "o.weight": torch.zeros(16, 12).bfloat16()}
    with pytest.raises(LayoutMismatchError, match="o.weight"):
        shards.check(layout_of(other))


# ---------------------------------------------------------------- a fused, sharded engine

CFG = SimpleNamespace(
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    hidden_size=16,
    intermediate_size=32,
    vocab_size=50,
    model_type="llama",
)
PADDED = 64  # the engine pads the vocabulary (vLLM: to a multiple of 64), then splits it


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, kv, i = CFG.hidden_size, CFG.num_key_value_heads * 2, CFG.intermediate_size
    shapes = {"model.embed_tokens.weight": (50, h), "lm_head.weight": (50, h)}
    shapes["model.norm.weight"] = (h,)
    for n in range(CFG.num_hidden_layers):
        a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        shapes |= {a + "q_proj.weight": (h, h), a + "k_proj.weight": (kv, h)}
        shapes |= {a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, h)}
        shapes |= {m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h)}
        shapes |= {m + "down_proj.weight": (h, i), f"model.layers.{n}.input_layernorm.weight": (h,)}
    return {k: torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}


@settings(max_examples=15, deadline=None)
@given(size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1), fraction=st.floats(0, 0.5))
def test_a_fused_tensor_parallel_engine_takes_patches_in_its_own_tensors(
    size: int, seed: int, fraction: float
) -> None:
    old = _checkpoint(seed)
    new = _changed(old, seed + 1, fraction)
    engines = [vllm_rank(old, r, size, PADDED) for r in range(size)]
    pointers = [{n: t.data_ptr() for n, t in e.items()} for e in engines]
    layouts = [
        fused_qkv_gate_up(CFG, vocab_size=50, padded_vocab=PADDED, tp_rank=r, tp_size=size)
        for r in range(size)
    ]
    shards = [EngineShards.laid(e, lay) for e, lay in zip(engines, layouts)]
    assert all(s.layout == layout_of(old) for s in shards)  # the checkpoint's, whole
    sums = [s.sums() for s in shards]
    assert {n: add_sums([r[n] for r in sums]) for n in old} == StateDigest.of(old).sums
    collected = _node_applies(old, new, False, shards)
    moves = [s.apply(decoded(collected.frames[r], s)) for r, s in enumerate(shards)]
    for r, engine in enumerate(engines):
        want = vllm_rank(new, r, size, PADDED)
        assert engine.keys() == want.keys()
        for name, t in engine.items():
            assert torch.equal(t.view(torch.int16), want[name].view(torch.int16)), (r, name)
            assert t.data_ptr() == pointers[r][name]  # in place
    for name in new:
        got = add_sums([m.get(name, (0, 0)) for m in moves])
        assert got == sub(tensor_sums(new[name]), tensor_sums(old[name])), name


def test_kv_heads_that_do_not_split_over_the_ranks_are_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="4 kv heads do not split over 8 ranks"):
        fused_qkv_gate_up(CFG, tp_rank=0, tp_size=8)
