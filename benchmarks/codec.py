"""Codec benchmark on the built-in workload: sizes, ratios and speeds.

For each learning rate and each patch span (1 step, 8 steps) it prints the density, bits per
changed element, ratio vs dense, ratio vs a grail v3.1-style reference encoder on the same
pair, the order-0 entropy bound of gaps + deltas, and create (diff + encode) and apply (decode +
apply, base and target hash checks included) throughput in MB/s of dense model size, on one CPU
core and on CUDA when present. `make demo` runs it; `make bench` too.

    python benchmarks/codec.py [--size medium] [--lrs 1e-6,3e-6,1e-5] [--steps 1,8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grail_reference  # noqa: E402

from p2p_sync import codec  # noqa: E402
from p2p_sync.patch import Patch, apply, diff, invert  # noqa: E402
from p2p_sync.tensors import TensorSet, total_bytes  # noqa: E402
from p2p_sync.workloads import Workload, parameter_count  # noqa: E402


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` runs (the least disturbed by other work on the machine)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _h0(x: np.ndarray) -> float:
    """Order-0 entropy of ``x`` in bits, times its length."""
    _, counts = np.unique(x, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


def entropy_bits(patch: Patch) -> float:
    """Order-0 entropy of the gaps plus that of the deltas, per tensor, summed (bits)."""
    total = 0.0
    for delta in patch.deltas.values():
        pos, d = delta.to_sparse()
        total += _h0(np.diff(pos.numpy(), prepend=-1)) + _h0(d.numpy())
    return total


def clone_to(tensors: TensorSet, device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device).clone() for k, v in tensors.items()}


def speeds(base: TensorSet, new: TensorSet, data: bytes, device: str, repeat: int) -> tuple:
    """(create MB/s, apply MB/s) on ``device``, in MB of dense model size per second."""
    b, n = clone_to(base, device), clone_to(new, device)
    dense = total_bytes(base) / 1e6
    create = best_time(lambda: codec.encode(diff(b, n)), repeat)
    work, undo = clone_to(base, device), invert(codec.decode(data))
    times = []
    for _ in range(repeat):
        times.append(best_time(lambda: apply(work, codec.decode(data)), 1))
        apply(work, undo)  # back to the base for the next round, untimed
    return dense / create, dense / min(times)


def measure(base: TensorSet, new: TensorSet, devices: list[str], repeat: int) -> dict:
    """Every figure of one table row for the pair (base, new)."""
    patch = diff(base, new)
    data = codec.encode(patch)
    reference = grail_reference.encode(base, new)
    check = clone_to(base, "cpu")
    grail_reference.decode_apply(check, reference)
    assert all(torch.equal(check[k], new[k]) for k in new), "reference encoder is not lossless"
    dense, changed = total_bytes(base), patch.changed
    row = {
        "density": changed / patch.numel,
        "bytes": len(data),
        "bits_per_changed": 8 * len(data) / changed,
        "ratio_vs_dense": dense / len(data),
        "grail_bytes": len(reference),
        "vs_grail": len(reference) / len(data),
        "entropy_bits_per_changed": entropy_bits(patch) / changed,
    }
    row["entropy_ratio"] = 16 * patch.numel / (row["entropy_bits_per_changed"] * changed)
    for device in devices:
        row[f"create_mbs_{device}"], row[f"apply_mbs_{device}"] = speeds(
            base, new, data, device, repeat
        )
    return row


def run(size: str, lrs: list[float], spans: list[int], devices: list[str], repeat: int,
        console: Console) -> list[dict]:  # fmt: skip
    rows = []
    for lr in lrs:
        with console.status(f"training the {size} workload at lr {lr:g}"):
            versions = list(Workload(size, lr=lr).versions(max(spans) + 1))
        for span in spans:
            with console.status(f"measuring lr {lr:g}, {span}-step patch"):
                row = measure(versions[0], versions[span], devices, repeat)
            rows.append({"lr": lr, "steps": span, **row})
    return rows


def render(rows: list[dict], devices: list[str], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "lr",
        "steps",
        "density",
        "bits/changed",
        "vs dense",
        "vs grail-style",
        "entropy bound",
        *(f"{k} {d} MB/s" for d in devices for k in ("create", "apply")),
    ):
        table.add_column(col, justify="right")  # fmt: skip
    for r in rows:
        table.add_row(
            f"{r['lr']:g}", str(r["steps"]), f"{r['density']:.2%}",
            f"{r['bits_per_changed']:.2f}", f"{r['ratio_vs_dense']:.1f}x", f"{r['vs_grail']:.2f}x",
            f"{r['entropy_bits_per_changed']:.2f} b ({r['entropy_ratio']:.0f}x)",
            *(f"{r[f'{k}_mbs_{d}']:,.0f}" for d in devices for k in ("create", "apply")),
        )  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=["tiny", "medium"])
    parser.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    parser.add_argument("--steps", default="1,8", help="patch spans in optimizer steps")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best counts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--demo", action="store_true", help="fewer repeats, for make demo")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lrs = [float(x) for x in args.lrs.split(",")]
    spans = [int(x) for x in args.steps.split(",")]
    console = Console(width=160)
    n = parameter_count(args.size)
    console.print(f"[bold]p2psync codec[/] on the built-in {args.size} workload: {n / 1e6:.1f}M "
                  f"parameters, {2 * n / 1e6:.1f} MB of bf16; CPU timings on {args.threads} "
                  f"thread(s){', plus CUDA' if 'cuda' in devices else ''}")  # fmt: skip
    rows = run(args.size, lrs, spans, devices, 2 if args.demo else args.repeat, console)
    console.print(render(rows, devices, "patch from version 0 to version <steps>"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
