"""What a merged catch-up patch costs the trainer at real model sizes: time and peak RSS.

Builds a LLaMA-shaped model (``models.py``), takes ``--span`` AdamW-like steps, codes each 1-step
patch (format 1, as the trainer's history keeps them) and writes them to a work dir. Then, each in a
fresh process so that its peak RSS is its own: the whole-patch merge the trainer used to run (decode
every step, merge them pairwise, encode) and ``p2p_sync.codec.catchup.merge_steps`` (one tensor at
a time). Prints seconds, peak RSS against the model size, the merged patch's size, and whether both
files are the same bytes.

    python benchmarks/catchup.py --size 1b --span 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.models import Model  # noqa: E402
from p2p_sync import codec  # noqa: E402
from p2p_sync.codec.catchup import merge_steps  # noqa: E402
from p2p_sync.weights.patch import diff, merge  # noqa: E402

WORKERS = os.cpu_count() or 1


def write_steps(size: str, span: int, lr: float, root: Path) -> int:
    """The ``span`` coded steps as files; returns the model's bytes (bf16)."""
    model = Model(size, lr, "cpu")
    for i in range(span):
        old = {k: v.clone() for k, v in model.bf16.items()}
        model.step()
        (root / f"step{i}.patch").write_bytes(codec.encode(diff(old, model.bf16), workers=WORKERS))
        del old
    return 2 * model.params


def whole(steps: list[bytes]) -> bytes:
    acc = codec.decode(steps[0], workers=WORKERS)
    for data in steps[1:]:
        acc = merge([acc, codec.decode(data, workers=WORKERS)])
    return codec.encode(acc, workers=WORKERS)


def peak_rss() -> int:
    """This process's peak RSS (``VmHWM``: reset by exec, unlike ``ru_maxrss``, which a child
    inherits from the parent that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(method: str, root: Path, span: int) -> None:
    """Run one method on the step files; print its figures as JSON."""
    steps = [(root / f"step{i}.patch").read_bytes() for i in range(span)]
    base = peak_rss()
    t0 = time.perf_counter()
    out = merge_steps(steps, workers=WORKERS) if method == "tensorwise" else whole(steps)
    took = time.perf_counter() - t0
    peak = peak_rss()
    digest = hashlib.sha256(out).hexdigest()
    print(json.dumps({"s": took, "peak": peak, "steps_in": base, "bytes": len(out), "sha": digest}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--span", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--child", choices=["whole", "tensorwise"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.dir, args.span)
        return 0
    with tempfile.TemporaryDirectory(prefix="catchup-") as tmp:
        root = Path(tmp)
        model_bytes = write_steps(args.size, args.span, args.lr, root)
        step_mb = sum(p.stat().st_size for p in root.glob("step*.patch")) / args.span / 1e6
        size = f"model {model_bytes / 1e9:.2f} GB bf16"
        print(f"{args.size}: {size}, {args.span} steps of ~{step_mb:.1f} MB")
        shas = set()
        for method in ("whole", "tensorwise"):
            cmd = [sys.executable, __file__, "--child", method, "--dir", tmp]
            cmd += ["--span", str(args.span)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
            shas.add(r["sha"])
            print(
                f"{method:>10}: {r['s']:.2f} s, peak RSS {r['peak'] / 1e9:.2f} GB = "
                f"{r['peak'] / model_bytes:.2f}x the model (steps held: "
                f"{r['steps_in'] / 1e9:.2f} GB), merged patch {r['bytes'] / 1e6:.1f} MB"
            )
        print("same bytes" if len(shas) == 1 else "DIFFERENT BYTES")
        return 0 if len(shas) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
