"""What an engine's own layout and the served dtype cost per version, at real model sizes.

1. **Fused layout.** The same 1-step patch applied in place, as a rollout in the engine's
   process does (state hash kept in O(patch), target checked), into plain LLaMA tensors and
   into an engine that fuses ``q/k/v`` and ``gate/up`` (``fused_qkv_gate_up``: views of the
   fused tensors). Prints the pause of each (median of ``--repeats``, alternating), their ratio,
   and the peak RSS each apply added (a tensor-sized temporary would show here).
2. **Served dtype.** fp32 master weights published as they are against
   ``ServedWeights(master, bfloat16)``: the patch bytes and the diff+encode time of the same
   step, through the trainer's own code path (``Publisher``-free: ``diff`` + ``codec.encode``).

    python benchmarks/engine_layout.py --size 1b
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.models import SIZES, Model
from p2p_sync import codec
from p2p_sync.weights.layout import fused_qkv_gate_up
from p2p_sync.weights.patch import apply, diff, invert
from p2p_sync.weights.served import ServedWeights
from p2p_sync.weights.statehash import StateDigest


def _config(size: str) -> SimpleNamespace:
    h, inter, layers, heads, kv, _ = SIZES[size]
    return SimpleNamespace(
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        model_type="llama",
    )


def _fused(weights: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The engine's own tensors: q/k/v and gate/up stacked (what vLLM loads a LLaMA into)."""
    out = dict(weights)
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"{a}qkv_proj.weight"] = torch.cat([out.pop(f"{a}{p}_proj.weight") for p in "qkv"])
        gate_up = [out.pop(f"{m}{p}_proj.weight") for p in ("gate", "up")]
        out[f"{m}gate_up_proj.weight"] = torch.cat(gate_up)
    return out


def _peak_kb() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _timed_apply(weights: dict[str, torch.Tensor], patch: object, digest: StateDigest) -> tuple:
    """One apply there and back (only the forward one timed); (seconds, peak RSS growth MB)."""
    Path("/proc/self/clear_refs").write_text("5")
    rss, _ = _peak_kb()
    t0 = time.perf_counter()
    apply(weights, patch, digest=digest)  # type: ignore[arg-type]
    took = time.perf_counter() - t0
    _, peak = _peak_kb()
    apply(weights, invert(patch), digest=digest)  # type: ignore[arg-type]
    return took, (peak - rss) / 1024


def layouts(args: argparse.Namespace) -> None:
    model = Model(args.size, args.lr, "cpu")
    old = {k: v.clone() for k, v in model.bf16.items()}
    model.step()
    patch = diff(old, model.bf16)
    del model
    changed = sum(d.count for d in patch.deltas.values())
    plain = old
    cfg = _config(args.size)
    engine = _fused(old, cfg.num_hidden_layers)
    views = fused_qkv_gate_up(cfg).views(engine)
    del old
    digests = {"plain": StateDigest.of(plain), "fused": StateDigest.of(views)}
    runs: dict[str, list[tuple[float, float]]] = {"plain": [], "fused": []}
    for _ in range(args.repeats):
        runs["plain"].append(_timed_apply(plain, patch, digests["plain"]))
        runs["fused"].append(_timed_apply(views, patch, digests["fused"]))
    params = sum(t.numel() for t in plain.values())
    print(f"{args.size}: {params / 1e9:.2f}B parameters, {changed:,} changed elements per step")
    pause = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    grew = {k: max(g for _, g in v) for k, v in runs.items()}
    for k in runs:
        print(f"  {k:>5}: apply pause {pause[k]:.3f} s median, peak RSS +{grew[k]:.0f} MB")
    print(f"  fused / plain pause: {pause['fused'] / pause['plain']:.2f}x")


def served(args: argparse.Namespace) -> None:
    model = Model(args.size, args.lr, "cpu")
    old32 = {k: v.clone() for k, v in model.master.items()}
    model.step()
    for label, base, new in (
        ("fp32 as it is", old32, model.master),
        (
            "served bf16",
            ServedWeights(old32, torch.bfloat16),
            ServedWeights(model.master, torch.bfloat16),
        ),
    ):
        base_t = {k: base[k] for k in base}
        t0 = time.perf_counter()
        data = codec.encode(diff(base_t, new), workers=args.workers)
        took = time.perf_counter() - t0
        print(f"  {label:>14}: patch {len(data) / 1e6:.1f} MB, diff+encode {took:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-served", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    layouts(args)
    if not args.skip_served:
        served(args)


if __name__ == "__main__":
    main()
