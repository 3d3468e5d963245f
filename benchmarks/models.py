"""LLaMA-shaped bf16 models of real sizes and a realistic per-step update, for the benchmarks
(``scale.py`` runs them through nodes, ``device.py`` through the library on a device)."""

from __future__ import annotations

import argparse

import torch

# hidden, intermediate, layers, heads, kv heads, vocab
SIZES = {
    "0.5b": (1024, 2816, 24, 16, 16, 32000),
    "1b": (2048, 5632, 16, 16, 16, 32000),  # 0.95B: the reference model of docs/performance.md
    "2b": (2048, 5632, 32, 16, 16, 32000),
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "13b": (5120, 13824, 40, 40, 40, 32000),
}


def llama_shapes(size: str) -> dict[str, tuple[int, ...]]:
    h, inter, layers, heads, kv, vocab = SIZES[size]
    kv_dim = h * kv // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv_dim, h),
            p + "self_attn.v_proj.weight": (kv_dim, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    return shapes


class Model:
    """fp32 master weights and their bf16 copy; ``step`` is one AdamW-like update."""

    def __init__(self, size: str, lr: float, device: str, seed: int = 0) -> None:
        self.lr, self.gen = lr, torch.Generator(device).manual_seed(seed)
        self.master: dict[str, torch.Tensor] = {}
        for name, shape in llama_shapes(size).items():
            t = torch.empty(shape, device=device)
            if len(shape) == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=self.gen)
            self.master[name] = t
        self.bf16 = {k: v.to(torch.bfloat16) for k, v in self.master.items()}

    @property
    def params(self) -> int:
        return sum(t.numel() for t in self.master.values())

    def step(self) -> None:
        """Adam's normalized update is ~unit scale per element: w -= lr * (u + wd * w)."""
        for name, m in self.master.items():
            u = torch.empty_like(m).normal_(generator=self.gen)
            m.add_(u.clamp_(-3, 3), alpha=-self.lr)
            if m.dim() > 1:
                m.mul_(1 - 0.1 * self.lr)  # decoupled weight decay
            self.bf16[name].copy_(m)
            del u


def ranked_args(description: str) -> argparse.ArgumentParser:
    """The flags every multi-rank benchmark takes: model size, ranks, versions, step size."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    return ap
