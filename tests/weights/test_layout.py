"""Engine layouts: checkpoint tensors as views of an engine's fused, padded tensors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync import Rollout, Trainer
from p2p_sync.errors import LayoutMismatchError
from p2p_sync.trust.keys import SigningKey, write_keypair
from p2p_sync.weights.layout import EngineLayout, Piece, fused_qkv_gate_up
from p2p_sync.weights.patch import apply, diff
from tests.weights.test_embedding import generate, tiny_llama, train_step

transformers = pytest.importorskip("transformers")


def _config(layers: int = 1, vocab: int = 16) -> SimpleNamespace:
    return SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=8,
        head_dim=2,
        intermediate_size=6,
        num_hidden_layers=layers,
        model_type="llama",
        vocab_size=vocab,
    )


def _fused_engine(cfg: SimpleNamespace, vocab: int) -> dict[str, torch.Tensor]:
    embed = torch.zeros(vocab, cfg.hidden_size)
    out = {"model.embed_tokens.weight": embed, "lm_head.weight": embed}  # tied
    for i in range(cfg.num_hidden_layers):
        out[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.zeros(16, cfg.hidden_size)
        out[f"model.layers.{i}.mlp.gate_up_proj.weight"] = torch.zeros(12, cfg.hidden_size)
        out[f"model.layers.{i}.mlp.down_proj.weight"] = torch.zeros(cfg.hidden_size, 6)
    return out


def test_fused_views_are_the_engines_own_rows() -> None:
    cfg = _config()
    engine = _fused_engine(cfg, vocab=20)
    views = fused_qkv_gate_up(cfg, vocab_size=16).views(engine)
    shapes = {k: tuple(v.shape) for k, v in views.items()}
    assert shapes == {
        "model.embed_tokens.weight": (16, 8),  # padded to 20 in the engine
        "lm_head.weight": (16, 8),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.mlp.gate_proj.weight": (6, 8),
        "model.layers.0.mlp.up_proj.weight": (6, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 6),  # not fused: itself
    }
    assert all(v.is_contiguous() for v in views.values())
    views["model.layers.0.self_attn.k_proj.weight"].fill_(1.0)
    qkv = engine["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv[8:12].eq(1).all() and qkv[:8].eq(0).all() and qkv[12:].eq(0).all()


@pytest.mark.parametrize(
    ("piece", "words"),
    [
        (Piece("a.weight", "missing.weight"), "'a.weight' in engine tensor 'missing.weight'"),
        (Piece("a.weight", "fused.weight", 4, 8), "rows 4..12 outside its 10"),
        (Piece("a.weight", "fused.weight", -1, 2), "rows -1..1 outside its 10"),
    ],
)
def test_a_layout_that_does_not_fit_names_the_tensor(piece: Piece, words: str) -> None:
    engine = {"fused.weight": torch.zeros(10, 3)}
    with pytest.raises(LayoutMismatchError, match=words):
        EngineLayout((piece,)).views(engine)
    assert not engine["fused.weight"].any()


def test_a_checkpoint_tensor_placed_twice_is_refused() -> None:
    engine = {"fused.weight": torch.zeros(10, 3)}
    twice = EngineLayout((Piece("a", "fused.weight", 0, 2), Piece("a", "fused.weight", 2, 2)))
    with pytest.raises(LayoutMismatchError, match="'a' is placed twice"):
        twice.views(engine)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    cols=st.integers(1, 5),
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
    fraction=st.floats(0.0, 1.0),
)
def test_a_patch_applied_through_a_layout_equals_one_applied_then_fused(
    rows: list[int], cols: int, pad: int, seed: int, fraction: float
) -> None:
    """Any stacking of row blocks (with padding rows after them): the engine's fused tensor
    after the patch is the concatenation of the patched checkpoint tensors, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    names = [f"t{i}" for i in range(len(rows))]
    old = {n: torch.randn(r, cols, generator=g).bfloat16() for n, r in zip(names, rows)}
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        mask = torch.rand(t.shape, generator=g) < fraction
        t[mask] = torch.randn(t.shape, generator=g).bfloat16()[mask]
    offsets = [sum(rows[:i]) for i in range(len(rows))]
    pieces = tuple(Piece(n, "fused", o, r) for n, o, r in zip(names, offsets, rows))
    fused = torch.cat([*old.values(), torch.zeros(pad, cols).bfloat16()])
    views = EngineLayout(pieces).views({"fused": fused})
    apply(views, diff(old, new))
    expected = torch.cat([*new.values(), torch.zeros(pad, cols).bfloat16()])
    assert torch.equal(fused.view(torch.int16), expected.view(torch.int16))


def _peak_rss_growth(work: object) -> int:
    """Bytes the process's peak RSS grew by while ``work()`` ran (Linux: VmHWM, reset first)."""

    def kb(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    before = kb("VmRSS:")
    work()  # type: ignore[operator]
    return kb("VmHWM:") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_applying_through_a_fused_layout_allocates_no_tensor_sized_buffer() -> None:
    """A 1% patch of a 128 MiB fused tensor: the apply's peak is a few MB (positions and
    deltas), nowhere near a temporary of the tensor's size."""
    rows, cols = 3 * 4096, 4096  # three 4096 x 4096 bf16 checkpoint tensors, 32 MiB each
    fused = torch.randn(rows, cols).bfloat16()
    pieces = tuple(Piece(f"t{i}", "fused", i * 4096, 4096) for i in range(3))
    views = EngineLayout(pieces).views({"fused": fused})
    new = {k: v.clone() for k, v in views.items()}
    g = torch.Generator().manual_seed(0)
    for t in new.values():
        idx = torch.randint(0, t.numel(), (t.numel() // 100,), generator=g)
        t.view(-1)[idx] = t.view(-1)[idx] + 1
    patch = diff(views, new)
    del new
    grew = _peak_rss_growth(lambda: apply(views, patch))
    assert grew < 32 * 2**20 // 2, f"apply grew the peak RSS by {grew / 2**20:.1f} MiB"


def _phi3_like(llama: torch.nn.Module, seed: int) -> torch.nn.Module:
    c = llama.config
    cfg = transformers.Phi3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return transformers.Phi3ForCausalLM(cfg).to(torch.bfloat16).eval()


def _converted(llama_sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """A LLaMA state dict in Phi-3's fused names, built offline (the reference)."""
    out = dict(llama_sd)
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [out.pop(f"{a}{p}_proj.weight") for p in "qkv"]
        out[f"{a}qkv_proj.weight"] = torch.cat(qkv)
        gate_up = [out.pop(f"{m}{p}_proj.weight") for p in ("gate", "up")]
        out[f"{m}gate_up_proj.weight"] = torch.cat(gate_up)
    return out


def test_a_llama_checkpoint_follows_into_a_fused_phi3_engine_in_place(tmp_path: Path) -> None:
    key = SigningKey.generate()
    pub = write_keypair(key, tmp_path / "trainer.key")
    trained = tiny_llama(seed=1)
    master = {n: p.detach().float().clone() for n, p in trained.named_parameters()}
    engine = _phi3_like(trained, seed=2)  # other weights at first: v0 overwrites them
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
    layers = trained.config.num_hidden_layers
    with (
        Trainer(key=tmp_path / "trainer.key", data_dir=tmp_path / "t") as trainer,
        Rollout(
            trust=[str(pub)],
            peers=[trainer.url],
            data_dir=tmp_path / "r",
            model=engine,
            layout=fused_qkv_gate_up(trained.config),
            download={"have_poll_s": 0.05},
            directory={"poll_interval_s": 0.2},
        ) as rollout,
    ):
        for v in range(3):
            if v:
                train_step(trained, master, v)
            assert trainer.publish(trained.state_dict()) == v
            rollout.wait_for_version(v)
            want = _converted(dict(trained.state_dict()), layers)
            held = engine.state_dict()
            assert held.keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(held[name].view(torch.int16), t.view(torch.int16)), name
            reference = _phi3_like(trained, seed=3)
            reference.load_state_dict(want)
            assert generate(engine) == generate(reference)
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == ptrs  # in place


def test_an_engine_the_layout_does_not_fit_is_refused_before_it_starts(tmp_path: Path) -> None:
    trained = tiny_llama(seed=1)
    engine = _phi3_like(trained, seed=2)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    wider = SimpleNamespace(**{**trained.config.to_dict(), "intermediate_size": 256})
    with pytest.raises(LayoutMismatchError, match="'model.layers.0.mlp.up_proj.weight'"):
        Rollout(
            trust=[SigningKey.generate().public.text()],
            data_dir=tmp_path / "r",
            model=engine,
            layout=fused_qkv_gate_up(wider),
        )
    assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
