"""Built-in training workload: a small decoder-only transformer that produces weight versions.

Why it exists: every test, benchmark and demo needs successive versions of real model weights
with the statistics of RL post-training (fp32 AdamW master weights, a bf16 copy on the rollout
side, tiny per-step updates). A random perturbation would not do: which bf16 elements flip
depends on Adam's normalised step size against each weight's own ulp, which only real
optimizer steps reproduce. Everything is seeded and runs on the CPU deterministically, so two
runs with the same arguments yield bit-identical state dicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ModelSize:
    """Shape of the built-in transformer."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int


SIZES: dict[str, ModelSize] = {
    # ~0.2M parameters: a version in milliseconds, for unit tests.
    "tiny": ModelSize(vocab=256, d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=4),
    # ~30M parameters (~60 MB of bf16): the benchmark and demo model.
    "medium": ModelSize(vocab=8192, d_model=512, n_layers=8, n_heads=8, seq_len=64, batch=8),
}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """A plain-torch decoder-only transformer (GPT-2 layout, tied embeddings)."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.d_model)
        self.pos = nn.Embedding(size.seq_len, size.d_model)
        self.blocks = nn.ModuleList(
            _Block(size.d_model, size.n_heads) for _ in range(size.n_layers)
        )
        self.ln_f = nn.LayerNorm(size.d_model)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.embed.weight.T


class Workload:
    """Seeded trainer loop whose bf16 weights are the versions a trainer would publish.

    ``versions()`` first warms up at ``warmup_lr`` (so Adam's moment estimates settle, as in a
    model that has been trained before RL starts), yields the bf16 copy as version 0, then
    yields one bf16 state dict per optimizer step at ``lr``.
    """

    def __init__(
        self,
        size: str = "tiny",
        lr: float = 1e-6,
        seed: int = 0,
        warmup_steps: int = 6,
        warmup_lr: float = 1e-3,
        steps_per_version: int = 1,
    ) -> None:
        if size not in SIZES:
            raise ValueError(f"unknown workload size {size!r}; choose one of {sorted(SIZES)}")
        self.size = SIZES[size]
        self.lr = lr
        self.seed = seed
        self.warmup_steps = warmup_steps
        self.warmup_lr = warmup_lr
        self.steps_per_version = steps_per_version

    def versions(self, count: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Yield ``count`` successive bf16 state dicts (endless when ``count`` is None)."""
        gen = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = TinyGPT(self.size)
        opt = torch.optim.AdamW(model.parameters(), lr=self.warmup_lr, weight_decay=0.01)
        for _ in range(self.warmup_steps):
            self._step(model, opt, gen)
        for group in opt.param_groups:
            group["lr"] = self.lr
        produced = 0
        while count is None or produced < count:
            if produced:
                for _ in range(self.steps_per_version):
                    self._step(model, opt, gen)
            yield bf16_copy(model)
            produced += 1

    def _step(self, model: TinyGPT, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
        tokens = synthetic_tokens(self.size, gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, self.size.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def synthetic_tokens(size: ModelSize, gen: torch.Generator) -> torch.Tensor:
    """Learnable synthetic text: arithmetic progressions mod vocab with a random start and stride.

    A model can learn to predict them, so gradients keep a consistent direction across steps
    (as in real fine-tuning) instead of being pure noise.
    """
    b, t = size.batch, size.seq_len + 1
    start = torch.randint(0, size.vocab, (b, 1), generator=gen)
    stride = torch.randint(1, 8, (b, 1), generator=gen)
    return (start + stride * torch.arange(t)) % size.vocab


def bf16_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """The rollout side's weights: every parameter cast to bf16 (the master stays fp32)."""
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def parameter_count(size: str) -> int:
    """Number of parameters of a built-in size (without building the model)."""
    s = SIZES[size]
    per_layer = 12 * s.d_model**2 + 4 * s.d_model
    return s.vocab * s.d_model + s.seq_len * s.d_model + s.n_layers * per_layer + 2 * s.d_model


__all__ = ["SIZES", "ModelSize", "TinyGPT", "Workload", "bf16_copy", "parameter_count"]
