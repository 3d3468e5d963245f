"""One version's work at both ends, on the weights' own device (a GPU when there is one).

Builds a LLaMA-shaped bf16 model of the chosen size on ``--device`` (fp32 master weights; each
version is one AdamW-like step, ~1-3% of bf16 elements change), then per version times what a
trainer and a rollout do with weights that live there, through the library (no network):

* trainer: ``diff`` against the previous version (with the previous version's state digest,
  so the target state hash costs O(patch)), ``encode`` in formats 1, 2 and 3 (the
  exponent-class scans of 2 and 3 run on the device, and format 3's coding too);
* rollout: decode + apply in place, one frame at a time (``restore.apply_frames``), formats 1
  and 3 (each undone after), then format 2, checking the target state hash incrementally;
* the full state hash of the whole model on the device, against what format 1 of the hash
  needed (copy every tensor to the host, then XXH3).

Every version checks that the rollout's weights are bit-identical to the trainer's. Peak device
memory and host RSS are printed at the end.

    python benchmarks/device.py --size 7b --device cuda --versions 3
    python benchmarks/device.py --size 1b --device cpu
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.models import SIZES, Model  # noqa: E402
from p2p_sync import codec  # noqa: E402
from p2p_sync.store.restore import apply_frames  # noqa: E402
from p2p_sync.weights.patch import diff, invert  # noqa: E402
from p2p_sync.weights.statehash import StateDigest  # noqa: E402
from p2p_sync.weights.tensors import TensorSet, total_bytes  # noqa: E402


def timed(device: str, fn: Callable[[], object]) -> tuple[object, float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def host_xxh3(weights: TensorSet) -> bytes:
    """What the state hash cost before format 2: every tensor to the host, then XXH3."""
    h = xxhash.xxh3_128()
    for name in sorted(weights):
        h.update(weights[name].detach().reshape(-1).cpu().view(torch.uint8).numpy())
    return h.digest()


def equal(a: TensorSet, b: TensorSet) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def apply_payload(weights: TensorSet, data: bytes, digest: StateDigest, workers: int) -> None:
    apply_frames(weights, memoryview(data), codec.read_header(data), digest, workers)  # type: ignore[arg-type]


def one_version(args: argparse.Namespace, model: Model, prev: dict, digest: StateDigest) -> dict:
    dev, w = args.device, args.workers
    model.step()
    new = model.bf16
    row: dict = {}
    patch, row["diff"] = timed(dev, lambda: diff(prev, new, digest=digest, workers=w))
    row["changed"] = patch.changed / patch.numel
    v1, row["encode1"] = timed(dev, lambda: codec.encode(patch, workers=w))
    v2, row["encode2"] = timed(
        dev, lambda: codec.encode(patch, workers=w, base=prev, base_hash=patch.base_hash)
    )
    v3, row["encode3"] = timed(
        dev,
        lambda: codec.encode(
            patch, workers=w, base=prev, base_hash=patch.base_hash, segmented=True
        ),
    )
    row["bytes1"], row["bytes2"], row["bytes3"] = len(v1), len(v2), len(v3)
    # the rollout: formats 1 and 3 applied and undone (exactly), then format 2 for good
    probe = digest.copy()
    undo = codec.encode(invert(patch))
    for name, data in (("apply1", v1), ("apply3", v3)):
        _, row[name] = timed(dev, functools.partial(apply_payload, prev, data, probe, w))
        assert probe.hash() == patch.target_hash
        apply_payload(prev, undo, probe, w)
        assert probe.hash() == patch.base_hash
    for n in args.sweep:  # the same two payloads with n threads each, applied and undone
        for name, data in (("f1", v1), ("f2", v2), ("f3", v3)):
            run = functools.partial(apply_payload, prev, data, probe, n)
            _, row[f"{name}@{n}"] = timed(dev, run)
            assert probe.hash() == patch.target_hash
            apply_payload(prev, undo, probe, w)
    _, row["apply2"] = timed(dev, lambda: apply_payload(prev, v2, digest, w))
    assert digest.hash() == patch.target_hash and equal(prev, new), "rollout differs"
    return row


def profiled(path: Path, fn: Callable[[], dict]) -> dict:
    """``fn()`` under cProfile; the stats (by own and by cumulative time) go to ``path``: where
    a version's seconds go on a machine one rarely holds, for reading after it is gone."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    path.write_text(text.getvalue())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--workers", type=int, default=2, help="threads for host-side work")
    parser.add_argument(
        "--sweep",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[],
        help="also time decode + apply with each of these thread counts, e.g. 1,2,4,8,16",
    )
    parser.add_argument(
        "--skip-host-hash", action="store_true", help="skip timing format 1's host-copy hash"
    )
    parser.add_argument(
        "--profile", type=Path, help="write a cProfile of the last version's steps here (text)"
    )
    args = parser.parse_args()
    dev = args.device
    model = Model(args.size, args.lr, dev)
    size = total_bytes(model.bf16)
    prev = {k: v.clone() for k, v in model.bf16.items()}
    print(
        f"{args.size}: {model.params / 1e9:.2f}B params, {size / 1e9:.2f} GB bf16 on {dev}"
        f"{' (' + torch.cuda.get_device_name() + ')' if dev.startswith('cuda') else ''}"
    )
    codec.encode(diff({"w": prev[next(iter(prev))][:8]}, {"w": prev[next(iter(prev))][:8]}))
    digest, full = timed(dev, lambda: StateDigest.of(prev, args.workers))
    _, full = timed(dev, lambda: StateDigest.of(prev, args.workers))  # warm (numba, kernels)
    old = "skipped" if args.skip_host_hash else f"{timed(dev, lambda: host_xxh3(prev))[1]:.3f} s"
    print(
        f"full state hash on {dev}: {full:.3f} s ({size / full / 1e9:.1f} GB/s); "
        f"format-1 hash (host copy + XXH3): {old}"
    )
    head = (
        f"{'v':>2} {'changed':>8} {'diff':>6} {'enc f1':>7} {'enc f2':>7} {'enc f3':>7} "
        f"{'MB f1':>7} {'MB f2':>7} {'MB f3':>7} {'apply f1':>8} {'apply f2':>8} {'apply f3':>8}"
    )
    print(head)
    for v in range(1, args.versions + 1):
        if args.profile and v == args.versions:
            r = profiled(args.profile, lambda: one_version(args, model, prev, digest))
        else:
            r = one_version(args, model, prev, digest)  # type: ignore[arg-type]
        print(
            f"{v:>2} {r['changed']:>8.2%} {r['diff']:>6.3f} {r['encode1']:>7.3f} "
            f"{r['encode2']:>7.3f} {r['encode3']:>7.3f} {r['bytes1'] / 1e6:>7.1f} "
            f"{r['bytes2'] / 1e6:>7.1f} {r['bytes3'] / 1e6:>7.1f} "
            f"{r['apply1']:>8.3f} {r['apply2']:>8.3f} {r['apply3']:>8.3f}"
        )
        if args.sweep:
            print(
                "   apply by threads: "
                + ", ".join(
                    f"{n}: " + " ".join(f"{f} {r[f'{f}@{n}']:.3f}" for f in ("f1", "f2", "f3"))
                    for n in args.sweep
                )
            )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    gpu = ""
    if dev.startswith("cuda"):
        gpu = f", peak device memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB"
    print(
        f"peak host RSS {rss:.1f} GB{gpu}; seconds; dense {size / 1e6:,.0f} MB "
        f"(1 Gbit/s: {size * 8 / 1e9:.1f} s)"
    )


if __name__ == "__main__":
    main()
