"""Engine layouts: where each checkpoint tensor lives among an inference engine's tensors.

Engines keep weights in their own layout: vLLM and SGLang fuse ``q_proj/k_proj/v_proj`` into
one ``qkv_proj`` and ``gate_proj/up_proj`` into ``gate_up_proj``, and pad the vocabulary. A
patch is in checkpoint coordinates, so a layout says, declaratively, which rows of which engine
tensor hold each checkpoint tensor (:class:`Piece`); :meth:`EngineLayout.views` turns the
engine's tensors into the checkpoint's, each a view of the engine's own memory. Everything a
rollout does with weights (apply a patch, load a snapshot, track the state hash, export) then
runs on those views unchanged: in place, O(changes), never a full-size temporary.

A piece is a block of rows (dim 0): the only concatenation that leaves each checkpoint tensor
contiguous in the engine's memory, and the one the engines above use. Under tensor parallelism
a piece holds one rank's block of its checkpoint tensor (``Piece.box``: rows for a
column-parallel layer, columns for a row-parallel one, a vocabulary slice), and the rank's
blocks (:meth:`EngineLayout.blocks`) take patches through ``runtime.tp_engine``. A layout that
does not fit the engine (a missing tensor, rows out of range, other trailing dims or dtype)
raises ``LayoutMismatchError`` naming the tensor, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from p2p_sync.errors import LayoutMismatchError
from p2p_sync.weights.shards import Block, Box


@dataclass(frozen=True)
class Piece:
    """Checkpoint tensor ``name`` is rows ``[offset, offset + rows)`` of engine tensor
    ``engine`` (``rows`` None: to the engine tensor's end). A rename is one piece."""

    name: str
    engine: str
    offset: int = 0
    rows: int | None = None
    box: Box | None = None  # tensor parallel: the block of ``name`` these rows hold


@dataclass(frozen=True)
class EngineLayout:
    """The pieces of an engine's layout; engine tensors no piece names are checkpoint tensors
    of the same name and shape (replicated, under tensor parallelism), except ``ignored`` ones
    (a rank's slice of vocabulary padding). ``rank``: the engine rank the layout is for."""

    pieces: tuple[Piece, ...] = ()
    ignored: tuple[str, ...] = ()
    rank: int = 0

    @property
    def sharded(self) -> bool:
        return any(p.box is not None for p in self.pieces)

    def views(self, engine: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (their blocks, when sharded) as views of ``engine``'s
        (checked first, nothing written)."""
        covered = {p.engine for p in self.pieces} | set(self.ignored)
        out = {name: t for name, t in engine.items() if name not in covered}
        for piece in self.pieces:
            if piece.name in out:
                raise LayoutMismatchError(f"layout: tensor {piece.name!r} is placed twice")
            out[piece.name] = _view(piece, engine)
        return out

    def blocks(self, engine: Mapping[str, torch.Tensor]) -> dict[str, Block]:
        """This rank's block of every checkpoint tensor, in the engine's memory; replicated
        tensors are counted (in the state hash) by rank 0 only."""
        boxes = {p.name: p.box for p in self.pieces if p.box is not None}
        out = {}
        for name, view in self.views(engine).items():
            box = boxes.get(name)
            whole = Box.of_whole(tuple(view.shape))
            out[name] = Block(view, box or whole, box is not None or self.rank == 0)
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
    view = t.narrow(0, piece.offset, rows)
    if piece.box is not None and tuple(view.shape) != piece.box.shape:
        raise LayoutMismatchError(f"{where}: holds {tuple(view.shape)}, not {piece.box.shape}")
    return view


def _split(name: str, shape: tuple[int, int], dim: int, tp: tuple[int, int]) -> Box | None:
    """Rank ``tp[0]`` of ``tp[1]``'s even block of ``name`` along ``dim`` (None: one rank)."""
    rank, size = tp
    if size == 1:
        return None
    if shape[dim] % size:
        raise LayoutMismatchError(f"layout: {name} {shape} does not split over {size} ranks")
    n = shape[dim] // size
    offsets = tuple(rank * n if d == dim else 0 for d in range(len(shape)))
    block = tuple(n if d == dim else k for d, k in enumerate(shape))
    return Box(tuple(shape), offsets, block)


def _fused(
    prefix: str, parts: list[tuple[str, int]], engine: str, cols: int, tp: tuple[int, int]
) -> list[Piece]:
    """Pieces for checkpoint weights ``parts`` (suffix, rows) stacked in that order into
    ``engine``, each split by rows over the ranks (column-parallel)."""
    out, offset = [], 0
    for suffix, rows in parts:
        name = f"{prefix}{suffix}.weight"
        box = _split(name, (rows, cols), 0, tp)
        held = rows // tp[1]
        out.append(Piece(name, f"{prefix}{engine}.weight", offset, held, box))
        offset += held
    return out


def _biases(
    prefix: str, parts: list[tuple[str, int]], engine: str, tp: tuple[int, int]
) -> list[Piece]:
    out, offset = [], 0
    for suffix, rows in parts:
        name = f"{prefix}{suffix}.bias"
        box = _split(name, (rows, 1), 0, tp)
        held = rows // tp[1]
        flat = Box((rows,), box.offsets[:1], (held,)) if box is not None else None
        out.append(Piece(name, f"{prefix}{engine}.bias", offset, held, flat))
        offset += held
    return out


def _layer(config: Any, i: int, tp: tuple[int, int]) -> list[Piece]:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hidden, mlp = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attn, ff = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    qkv = [("q_proj", heads * head_dim), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)]
    pieces = _fused(attn, qkv, "qkv_proj", hidden, tp)
    if bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2":
        pieces += _biases(attn, qkv, "qkv_proj", tp)
    pieces += _fused(ff, [("gate_proj", mlp), ("up_proj", mlp)], "gate_up_proj", hidden, tp)
    if tp[1] > 1:  # row-parallel: each rank holds a block of columns, whole in its memory
        for name, cols in (
            (f"{attn}o_proj.weight", heads * head_dim),
            (f"{ff}down_proj.weight", mlp),
        ):
            pieces.append(Piece(name, name, 0, None, _split(name, (hidden, cols), 1, tp)))
    return pieces


def _vocab(
    config: Any, vocab_size: int | None, padded: int | None, tp: tuple[int, int]
) -> tuple[list[Piece], list[str]]:
    """The embedding and LM head: the checkpoint's vocabulary, padded by the engine to
    ``padded`` rows and split into equal row blocks over the ranks (vocabulary parallel)."""
    rank, size = tp
    names = ("model.embed_tokens.weight", "lm_head.weight")
    if size == 1:  # the rows the checkpoint has, when the engine pads beyond them
        return [Piece(n, n, 0, vocab_size) for n in names if vocab_size is not None], []
    vocab = vocab_size or config.vocab_size
    per = -(-(padded or vocab) // size)
    first, last = min(rank * per, vocab), min((rank + 1) * per, vocab)
    if last == first:  # this rank holds padding only
        return [], list(names)
    box = Box((vocab, config.hidden_size), (first, 0), (last - first, config.hidden_size))
    return [Piece(n, n, 0, last - first, box) for n in names], []


def fused_qkv_gate_up(
    config: Any,
    *,
    vocab_size: int | None = None,
    padded_vocab: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> EngineLayout:
    """The fused layout vLLM and SGLang load LLaMA, Qwen2/3 and Mistral checkpoints into (and
    Hugging Face's Phi-3 uses): per layer ``q_proj, k_proj, v_proj`` stacked into
    ``qkv_proj`` and ``gate_proj, up_proj`` into ``gate_up_proj``; ``config`` is the
    checkpoint's (a transformers config or anything with its fields). ``vocab_size``: the
    checkpoint's vocabulary, when the engine pads its embedding and LM head beyond it (to
    ``padded_vocab`` rows in all, under tensor parallelism). With ``tp_size`` ranks, rank
    ``tp_rank``'s tensors: q/k/v and gate/up each split by rows (their blocks stacked in that
    order), o/down by columns, the vocabulary in row blocks, norms replicated."""
    tp = (tp_rank, tp_size)
    if tp_size > 1 and config.num_key_value_heads % tp_size:
        raise LayoutMismatchError(
            f"layout: {config.num_key_value_heads} kv heads do not split over {tp_size} ranks "
            "(engines that replicate kv heads are not covered)"
        )
    pieces: list[Piece] = []
    for i in range(config.num_hidden_layers):
        pieces += _layer(config, i, tp)
    vocab, ignored = _vocab(config, vocab_size, padded_vocab, tp)
    return EngineLayout(tuple(pieces + vocab), tuple(ignored), tp_rank)


__all__ = ["EngineLayout", "Piece", "fused_qkv_gate_up"]
