"""Codec benchmark on the built-in workload: sizes, ratios and speeds of formats 1, 2 and 3.

For each learning rate and each patch span (1 step, 8 steps) it prints the density; bits per
changed element and ratio vs dense for format 1 (``encode(patch)``: no base, v1 codings only),
format 2 (``encode(patch, base=...)``: exponent-class positions where they are smaller) and
format 3 (``segmented=True``: exponent classes per segment, no zstd); format 2's ratio vs a
grail v3.1-style reference encoder on the same pair; two entropy bounds (bits per changed
element and the ratio they would give): order 0 of gaps + deltas per tensor, and the
exponent-conditioned one (changed-or-not per element given tensor and base exponent, plus
deltas given tensor and base exponent); and create (diff + encode) and apply (decode + apply,
base and target hash checks included) throughput in MB/s of dense model size for each format,
on one CPU core and on CUDA when present. Formats 2 and 3 are timed the way a trainer and a
rollout call them: against the base, with its state hash already known (the trainer's patch
carries it; a rollout that verified its last apply knows it), so the base is not hashed twice.
`make demo` runs it; `make bench` too.

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
from p2p_sync.weights.patch import Patch, apply, diff, invert  # noqa: E402
from p2p_sync.weights.statehash import state_hash  # noqa: E402
from p2p_sync.weights.tensors import TensorSet, flat_bits, total_bytes  # noqa: E402
from p2p_sync.weights.workloads import Workload, parameter_count  # noqa: E402


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


def _h_binary(changed: np.ndarray, total: np.ndarray) -> float:
    """Sum over contexts of total * H(changed / total), in bits."""
    p = changed / np.maximum(total, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(p > 0, p * np.log2(p), 0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0))
    return float((total * h).sum())


def exponent_bits(patch: Patch, base: TensorSet) -> float:
    """Exponent-conditioned bound (bits): per tensor and base exponent value, the binary
    entropy of changed-or-not over its elements plus the order-0 entropy of its deltas."""
    total = 0.0
    for name, delta in patch.deltas.items():
        pos, d = (t.numpy() for t in delta.to_sparse())
        dtype = delta.spec.dtype
        if dtype not in codec.MANTISSA_BITS:  # no exponent: fall back to order 0
            total += _h0(np.diff(pos, prepend=-1)) + _h0(d)
            continue
        u = flat_bits(base[name]).cpu().numpy().view(f"<u{delta.spec.itemsize}")
        exp_bits = 8 * delta.spec.itemsize - 1 - codec.MANTISSA_BITS[dtype]
        e = ((u >> codec.MANTISSA_BITS[dtype]) & ((1 << exp_bits) - 1)).astype(np.int64)
        ne, ke = np.bincount(e), np.bincount(e[pos], minlength=1 << exp_bits)
        total += _h_binary(ke[: ne.size], ne)
        order = np.argsort(e[pos], kind="stable")
        bounds = np.searchsorted(e[pos][order], np.unique(e[pos]))
        total += sum(_h0(part) for part in np.split(d[order], bounds[1:]))
    return total


def clone_to(tensors: TensorSet, device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device).clone() for k, v in tensors.items()}


# format: (encodes against the base, segmented frames)
FORMATS = {"v1": (False, False), "v2": (True, False), "v3": (True, True)}


def _create(b: TensorSet, n: TensorSet, fmt: str) -> bytes:
    """diff + encode as a trainer does it; formats 2 and 3 encode against the base, whose
    state hash the patch already carries (diff computed it), so the base is not hashed twice."""
    patch = diff(b, n)
    based, segmented = FORMATS[fmt]
    return codec.encode(
        patch, base=b if based else None, base_hash=patch.base_hash, segmented=segmented
    )


def speeds(
    base: TensorSet, new: TensorSet, data: bytes, device: str, repeat: int, fmt: str
) -> tuple:
    """(create MB/s, apply MB/s) on ``device``, in MB of dense model size per second. Format 2
    decodes against the weights being patched and is given their state hash, as a rollout that
    verified its last apply knows it (apply still hashes base and target itself)."""
    b, n = clone_to(base, device), clone_to(new, device)
    dense = total_bytes(base) / 1e6
    create = best_time(lambda: _create(b, n, fmt), repeat)
    work = clone_to(base, device)
    known = state_hash(work)
    base_arg = work if FORMATS[fmt][0] else None
    undo = invert(codec.decode(data, base=base_arg, base_hash=known))

    def decode_apply() -> None:
        apply(work, codec.decode(data, base=base_arg, base_hash=known))

    times = []
    for _ in range(repeat):
        times.append(best_time(decode_apply, 1))
        apply(work, undo)  # back to the base for the next round, untimed
    return dense / create, dense / min(times)


def measure(base: TensorSet, new: TensorSet, devices: list[str], repeat: int) -> dict:
    """Every figure of one table row for the pair (base, new)."""
    patch = diff(base, new)
    data = {
        "v1": codec.encode(patch),
        "v2": codec.encode(patch, base=base),
        "v3": codec.encode(patch, base=base, segmented=True),
    }
    for fmt in ("v2", "v3"):
        decoded = codec.decode(data[fmt], base=base)
        assert all(decoded.deltas[k].same_change(d) for k, d in patch.deltas.items()), fmt
    reference = grail_reference.encode(base, new)
    check = clone_to(base, "cpu")
    grail_reference.decode_apply(check, reference)
    assert all(torch.equal(check[k], new[k]) for k in new), "reference encoder is not lossless"
    dense, changed = total_bytes(base), patch.changed
    row = {
        "density": changed / patch.numel,
        "grail_bytes": len(reference),
        "vs_grail": len(reference) / len(data["v2"]),
    }
    for fmt, blob in data.items():
        row[f"bytes_{fmt}"] = len(blob)
        row[f"bits_per_changed_{fmt}"] = 8 * len(blob) / changed
        row[f"ratio_vs_dense_{fmt}"] = dense / len(blob)
    for bound, bits in (("order0", entropy_bits(patch)), ("exponent", exponent_bits(patch, base))):
        row[f"{bound}_bits_per_changed"] = bits / changed
        row[f"{bound}_ratio"] = 8 * dense / bits
    for device in devices:
        for fmt, blob in data.items():
            row[f"create_mbs_{fmt}_{device}"], row[f"apply_mbs_{fmt}_{device}"] = speeds(
                base, new, blob, device, repeat, fmt
            )
    return row


def run(
    size: str, lrs: list[float], spans: list[int], devices: list[str], repeat: int, console: Console
) -> list[dict]:
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
    speed_cols = [(k, f, d) for d in devices for k in ("create", "apply") for f in FORMATS]
    for col in (
        "lr",
        "steps",
        "density",
        "v1 bits/chg",
        "v1 vs dense",
        "v2 bits/chg",
        "v2 vs dense",
        "v2 vs grail",
        "v3 bits/chg",
        "v3 vs dense",
        "order-0 bound",
        "exponent bound",
        *(f"{k} {f} {d} MB/s" for k, f, d in speed_cols),
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['lr']:g}",
            str(r["steps"]),
            f"{r['density']:.2%}",
            f"{r['bits_per_changed_v1']:.2f}",
            f"{r['ratio_vs_dense_v1']:.1f}x",
            f"{r['bits_per_changed_v2']:.2f}",
            f"{r['ratio_vs_dense_v2']:.1f}x",
            f"{r['vs_grail']:.2f}x",
            f"{r['bits_per_changed_v3']:.2f}",
            f"{r['ratio_vs_dense_v3']:.1f}x",
            f"{r['order0_bits_per_changed']:.2f} b ({r['order0_ratio']:.0f}x)",
            f"{r['exponent_bits_per_changed']:.2f} b ({r['exponent_ratio']:.0f}x)",
            *(f"{r[f'{k}_mbs_{f}_{d}']:,.0f}" for k, f, d in speed_cols),
        )
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
    console = Console(width=230)
    n = parameter_count(args.size)
    console.print(
        f"[bold]p2psync codec[/] on the built-in {args.size} workload: {n / 1e6:.1f}M "
        f"parameters, {2 * n / 1e6:.1f} MB of bf16; CPU timings on {args.threads} "
        f"thread(s){', plus CUDA' if 'cuda' in devices else ''}"
    )
    rows = run(args.size, lrs, spans, devices, 2 if args.demo else args.repeat, console)
    console.print(render(rows, devices, "patch from version 0 to version <steps>"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
