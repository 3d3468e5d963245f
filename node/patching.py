"""What `p2psync patch create|apply|inspect` do: the codec on safetensors files. Imported
when one of them runs (``node.patch_cmd`` builds their flags without torch)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from node.errors import CommandError, read_input
from p2p_sync import codec
from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.errors import BaseMismatchError, ConfigError, PatchError
from p2p_sync.runtime import identity
from p2p_sync.weights.patch import Patch, apply, diff
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.weights_io import load_weights, save_weights

CODINGS = {
    codec.UNCHANGED: "unchanged",
    codec.SPARSE: "sparse",
    codec.DENSE: "dense",
    codec.CLASSED: "sparse-by-exponent",
    codec.SEGMENTED: "segments-by-exponent",
    codec.PARTS: "parts",
}


def pick_device(name: str) -> str:
    """The library's choice (``auto``: CUDA when present); a command refuses CUDA without one."""
    try:
        return identity.pick_device(name)
    except ConfigError as exc:
        raise CommandError(str(exc)) from None


def cmd_create(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    base = load_weights(args.base, device)
    new = load_weights(args.new, device)
    data = codec.encode(
        diff(base, new),
        level=args.level,
        workers=args.workers,
        base=base if args.format > 1 else None,
        segmented=args.format == 3,
    )
    atomic_write_bytes(args.out, data)
    info = codec.read_header(data)
    print(
        f"wrote {args.out}: {len(data):,} bytes, {info.changed:,} of {info.numel:,} elements "
        f"changed ({info.density:.3%}), {info.ratio:.1f}x smaller than dense"
    )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    data = read_input(args.patch, "patch")
    info = codec.read_header(data)
    weights = load_weights(args.base, device)
    try:  # decoding reads the base too: exponent-class positions are coded against it
        apply(weights, codec.decode(data, workers=args.workers, base=weights))
    except BaseMismatchError:
        raise BaseMismatchError(_which_is_wrong(args.patch, args.base, data, weights)) from None
    save_weights(args.out, weights)
    print(f"wrote {args.out}: state {info.target_hash.hex()}")
    return 0


def _which_is_wrong(patch: Path, base: Path, data: bytes, weights: dict) -> str:
    """A base hash mismatch: the weights are another base, or the patch's header is damaged
    (it has no checksum of its own). Decoding against the weights anyway tells them apart:
    reaching the header's target hash means only the header's base field changed."""
    info, have = codec.read_header(data), state_hash(weights)
    trial = {k: t.clone() for k, t in weights.items()}
    try:
        p = codec.decode(data, base=trial, base_hash=info.base_hash)
        apply(trial, Patch(p.layout, have, p.target_hash, p.deltas))
    except PatchError:
        return (
            f"{patch} was made for base {info.base_hash.hex()}, but {base} hashes to "
            f"{have.hex()}: another base (or the patch is corrupt too)"
        )
    return (
        f"{patch} is corrupt: its header names base {info.base_hash.hex()}, but its frames "
        f"turn {base} (which hashes to {have.hex()}) into its target {info.target_hash.hex()}"
    )


def _verify(args: argparse.Namespace, data: bytes) -> str:
    """--verify: decode every frame (against --base when given); without a base, what needs
    none. Returns what was checked, for stderr; corruption raises."""
    base = getattr(args, "base", None)  # `p2psync inspect` (any file) has no --base
    if base is None:
        need = codec.check_without_base(data)
        if need:
            return (
                f"verified without the base: checksums, structure and position codes; "
                f"{len(need)} exponent-class frame(s) need --base to check their values"
            )
        codec.decode(data)
        return "verified: every frame decoded"
    weights = load_weights(base, "cpu")
    try:
        apply({k: t.clone() for k, t in weights.items()}, codec.decode(data, base=weights))
    except BaseMismatchError:
        raise BaseMismatchError(_which_is_wrong(args.file, base, data, weights)) from None
    return f"verified against {base}: every frame decoded and the target hash reached"


def _row_dict(row: codec.FrameInfo) -> dict:
    spec = row.spec
    return {
        "name": spec.name,
        "shape": list(spec.shape),
        "dtype": str(spec.dtype).removeprefix("torch."),
        "coding": CODINGS[row.coding],
        "changed": row.count,
        "density": row.count / spec.numel if spec.numel else 0.0,
        "bytes": row.size,
        "bits_per_changed": 8 * row.size / row.count if row.count else None,
        "ratio_vs_dense": spec.nbytes / row.size if row.size else None,
    }


def inspect_dict(info: codec.PatchInfo) -> dict:
    """Everything `inspect` shows, as plain data (also its --json output)."""
    return {
        "format_version": info.version,
        "bytes": info.total_size,
        "dense_bytes": info.dense_bytes,
        "tensors": len(info.rows),
        "changed_tensors": sum(1 for r in info.rows if r.count),
        "elements": info.numel,
        "changed": info.changed,
        "density": info.density,
        "bits_per_changed": info.bits_per_changed if info.changed else None,
        "ratio_vs_dense": info.ratio,
        "base_hash": info.base_hash.hex(),
        "target_hash": info.target_hash.hex(),
        "layout_fingerprint": info.fingerprint.hex(),
        "rows": [_row_dict(r) for r in info.rows],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_inspect(path: Path, d: dict, console: Console) -> None:
    """What `inspect` prints without --json: the summary, then the table of tensors."""
    _print_summary(path, d, console)
    console.print(_rows_table(d["rows"]))


def _print_summary(path: Path, d: dict, console: Console) -> None:
    """The patch as a whole: format, size, the states it joins, how much it changes."""
    console.print(
        f"[bold]{path}[/]: p2psync patch v{d['format_version']}, {d['bytes']:,} bytes, "
        f"{d['tensors']} tensors ({d['changed_tensors']} changed)"
    )
    console.print(f"  base   {d['base_hash']}\n  target {d['target_hash']}")
    console.print(f"  layout {d['layout_fingerprint']}")
    console.print(
        f"  changed {d['changed']:,} of {d['elements']:,} elements ({d['density']:.3%}), "
        f"{_fmt(d['bits_per_changed'], '.2f')} bits per changed element, "
        f"{d['ratio_vs_dense']:.1f}x smaller than dense ({d['dense_bytes']:,} bytes)"
    )


def _rows_table(rows: list[dict]) -> Table:
    """One line per tensor: how its frame is coded and what it costs."""
    table = Table(
        "tensor",
        "shape",
        "dtype",
        "coding",
        "changed",
        "density",
        "bytes",
        "bits/changed",
        "vs dense",
    )
    for r in rows:
        table.add_row(
            r["name"],
            "x".join(map(str, r["shape"])) or "scalar",
            r["dtype"],
            r["coding"],
            f"{r['changed']:,}",
            f"{r['density']:.3%}",
            f"{r['bytes']:,}",
            _fmt(r["bits_per_changed"], ".2f"),
            _fmt(r["ratio_vs_dense"], ".1f"),
        )
    return table


def cmd_inspect(args: argparse.Namespace) -> int:
    data = read_input(args.file, "patch")
    info = codec.read_header(data)
    checked = _verify(args, data) if args.verify else None
    d = inspect_dict(info)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_inspect(args.file, d, Console(width=140))
    if checked:
        print(f"{args.file}: {checked}", file=sys.stderr)
    return 0
