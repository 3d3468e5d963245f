"""Engine layouts: where each checkpoint tensor lives among an inference engine's tensors.

Engines keep weights in their own layout: vLLM and SGLang fuse ``q_proj/k_proj/v_proj`` into
one ``qkv_proj`` and ``gate_proj/up_proj`` into ``gate_up_proj``, and pad the vocabulary. A
patch is in checkpoint coordinates, so a layout says, declaratively, which rows of which engine
tensor hold each checkpoint tensor (:class:`Piece`); :meth:`EngineLayout.views` turns the
engine's tensors into the checkpoint's, each a view of the engine's own memory. Everything a
rollout does with weights (apply a patch, load a snapshot, track the state hash, export) then
runs on those views unchanged: in place, O(changes), never a full-size temporary.

A piece is a block of rows (dim 0): the only concatenation that leaves each checkpoint tensor
contiguous in the engine's memory, and the one the engines above use. A layout that does not
fit the engine (a missing tensor, rows out of range, other trailing dims or dtype) raises
``LayoutMismatchError`` naming the tensor, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from p2p_sync.errors import LayoutMismatchError


@dataclass(frozen=True)
class Piece:
    """Checkpoint tensor ``name`` is rows ``[offset, offset + rows)`` of engine tensor
    ``engine`` (``rows`` None: to the engine tensor's end). A rename is one piece."""

    name: str
    engine: str
    offset: int = 0
    rows: int | None = None


@dataclass(frozen=True)
class EngineLayout:
    """The pieces of an engine's layout; engine tensors no piece names are checkpoint tensors
    of the same name and shape."""

    pieces: tuple[Piece, ...] = ()

    def views(self, engine: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as views of ``engine``'s (checked first, nothing written)."""
        covered = {p.engine for p in self.pieces}
        out = {name: t for name, t in engine.items() if name not in covered}
        for piece in self.pieces:
            if piece.name in out:
                raise LayoutMismatchError(f"layout: tensor {piece.name!r} is placed twice")
            out[piece.name] = _view(piece, engine)
        return out


def _view(piece: Piece, engine: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Rows ``piece`` names, checked: the engine tensor exists, is contiguous, the rows fit."""
    t = engine.get(piece.engine)
    where = f"layout: checkpoint tensor {piece.name!r} in engine tensor {piece.engine!r}"
    if t is None:
        raise LayoutMismatchError(f"{where}: the engine has no such tensor")
    if t.dim() == 0 or not t.is_contiguous():
        raise LayoutMismatchError(f"{where}: needs a contiguous tensor with rows, got {t.shape}")
    rows = t.shape[0] - piece.offset if piece.rows is None else piece.rows
    if piece.offset < 0 or rows <= 0 or piece.offset + rows > t.shape[0]:
        raise LayoutMismatchError(
            f"{where}: rows {piece.offset}..{piece.offset + rows} outside its {t.shape[0]}"
        )
    return t.narrow(0, piece.offset, rows)


def _fused(prefix: str, parts: list[tuple[str, int]], engine: str, bias: bool) -> list[Piece]:
    """Pieces for checkpoint tensors ``parts`` (suffix, rows) stacked in that order into
    ``engine`` (weights, and biases when the model has them)."""
    out, offset = [], 0
    for suffix, rows in parts:
        for kind in ("weight", "bias") if bias else ("weight",):
            out.append(Piece(f"{prefix}{suffix}.{kind}", f"{prefix}{engine}.{kind}", offset, rows))
        offset += rows
    return out


def fused_qkv_gate_up(config: Any, *, vocab_size: int | None = None) -> EngineLayout:
    """The fused layout vLLM and SGLang load LLaMA, Qwen2/3 and Mistral checkpoints into (and
    Hugging Face's Phi-3 uses): per layer ``q_proj, k_proj, v_proj`` stacked into
    ``qkv_proj`` and ``gate_proj, up_proj`` into ``gate_up_proj``; ``config`` is the
    checkpoint's (a transformers config or anything with its fields). ``vocab_size``: the
    checkpoint's vocabulary, when the engine pads its embedding and LM head beyond it."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
    mlp = config.intermediate_size
    pieces: list[Piece] = []
    for i in range(config.num_hidden_layers):
        attn, ff = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [("q_proj", heads * head_dim), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)]
        pieces += _fused(attn, qkv, "qkv_proj", bias)
        pieces += _fused(ff, [("gate_proj", mlp), ("up_proj", mlp)], "gate_up_proj", False)
    if vocab_size is not None:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            pieces.append(Piece(name, name, 0, vocab_size))
    return EngineLayout(tuple(pieces))


__all__ = ["EngineLayout", "Piece", "fused_qkv_gate_up"]
