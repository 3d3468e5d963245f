"""What a sharded trainer's version costs per rank: diff where the blocks live, gather the
changes, assemble and code the patch on rank 0; against one process diffing the whole model.

Each rank holds its row blocks (Shard(0), as FSDP2 places them) of a LLaMA-shaped bf16 model
and its fp32 master blocks; a version is one AdamW-like step on them. Per version it prints,
per rank, the diff + frame coding time (``ShardDiffer.step``, ``code_parts``) and the bytes
it sent to rank 0 (its pickled frames), rank 0's gather + assemble + encode time, and the
patch size; then the unsharded baseline in one process with as many threads as there are
ranks (``diff`` + ``codec.encode`` of the whole model) and every rank's peak RSS.

    python benchmarks/sharded.py --size 1b --ranks 2

The engine side (a tensor-parallel engine's pause per version) is ``benchmarks/tp_engine.py``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from benchmarks.memory import status_kb
from benchmarks.models import llama_shapes, ranked_args
from p2p_sync import codec
from p2p_sync.runtime.sharded import code_parts, decode_parts
from p2p_sync.weights.dtensors import (
    ShardDiffer,
    assemble,
    digest_of,
    gather_to,
    partial_sums,
)
from p2p_sync.weights.patch import diff
from p2p_sync.weights.statehash import StateDigest
from p2p_sync.weights.tensors import layout_of


def _rows(n: int, rank: int, ranks: int) -> tuple[int, int]:
    per = -(-n // ranks)  # DTensor's Shard(0): ceil-sized blocks, the last one shorter
    return min(rank * per, n), min((rank + 1) * per, n)


class Blocks:
    """One rank's row blocks: fp32 masters and the bf16 DTensors published from them."""

    def __init__(self, size: str, rank: int, ranks: int, mesh: object, lr: float) -> None:
        self.lr, self.gen = lr, torch.Generator().manual_seed(1000 + rank)
        self.master: dict[str, torch.Tensor] = {}
        self.served: dict[str, DTensor] = {}
        for name, shape in llama_shapes(size).items():
            a, b = _rows(shape[0], rank, ranks)
            local = torch.empty((b - a, *shape[1:]))
            local.fill_(1.0) if len(shape) == 1 else local.normal_(0.0, 0.02, generator=self.gen)
            self.master[name] = local
            bf16 = local.to(torch.bfloat16)
            self.served[name] = DTensor.from_local(
                bf16,
                mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )

    def step(self) -> None:
        for name, m in self.master.items():
            u = torch.empty_like(m).normal_(generator=self.gen)
            m.add_(u.clamp_(-3, 3), alpha=-self.lr)
            self.served[name].to_local().copy_(m)


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    mesh = init_device_mesh("cpu", (args.ranks,))
    blocks = Blocks(args.size, rank, args.ranks, mesh, args.lr)
    layout = layout_of(blocks.served)
    sums = gather_to(partial_sums(blocks.served))
    digest = digest_of(layout, sums) if sums is not None else None
    differ = ShardDiffer(blocks.served)
    lines = []
    resident, grew = status_kb("VmRSS"), 0
    for v in range(1, args.versions + 1):
        blocks.step()
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # the peak of this publish alone
        before = status_kb("VmRSS")
        t0 = time.perf_counter()
        parts = code_parts(differ.step(blocks.served))  # as Trainer.publish sends them
        t1 = time.perf_counter()
        sent = len(pickle.dumps(parts))
        gathered = gather_to(parts)
        t2 = time.perf_counter()
        if gathered is not None and digest is not None:
            specs = {s.name: s for s in layout}
            patch, digest = assemble(layout, [decode_parts(r, specs) for r in gathered], digest)
            t3 = time.perf_counter()
            data = codec.encode(patch, workers=1)
            t4 = time.perf_counter()
            lines.append(
                f"v{v}: rank 0 diff+code {t1 - t0:.2f} s, gather {t2 - t1:.2f} s, assemble "
                f"{t3 - t2:.2f} s, encode {t4 - t3:.2f} s, total {t4 - t0:.2f} s; "
                f"patch {len(data) / 1e6:.1f} MB"
            )
        grew = max(grew, status_kb("VmHWM") - before)
        sent_all = gather_to((rank, t1 - t0, sent))
        if sent_all is not None:
            lines.append(
                "    per rank (diff+code s, MB sent): "
                + ", ".join(f"r{r} {d:.2f} s {s / 1e6:.1f} MB" for r, d, s in sent_all)
            )
    shard_mb = sum(t.to_local().numel() * 2 for t in blocks.served.values()) / 1e6
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    peaks = gather_to((rank, peak, shard_mb, resident / 1e3, grew / 1e3))
    if peaks is not None:
        lines += [
            f"  rank {r}: peak RSS {p:,.0f} MB; its bf16 blocks {s:,.0f} MB, fp32 masters "
            f"{2 * s:,.0f} MB (rss / (blocks + masters) {p / (3 * s):.2f}); resident before "
            f"publishing {at:,.0f} MB (blocks, masters, the kept last version, the runtime), "
            f"a publish adds at most {g:,.0f} MB ({(at + g) / at:.2f}x)"
            for r, p, s, at, g in peaks
        ]
        Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def unsharded(args: argparse.Namespace) -> list[float]:
    """The same versions diffed and coded whole in one process with ``--ranks`` threads."""
    torch.set_num_threads(args.ranks)
    gen = torch.Generator().manual_seed(7)
    master = {}
    for name, shape in llama_shapes(args.size).items():
        t = torch.empty(shape)
        t.fill_(1.0) if len(shape) == 1 else t.normal_(0.0, 0.02, generator=gen)
        master[name] = t
    prev = {k: v.to(torch.bfloat16) for k, v in master.items()}
    digest = StateDigest.of(prev, args.ranks)
    took = []
    for _ in range(args.versions):
        for m in master.values():
            m.add_(torch.empty_like(m).normal_(generator=gen).clamp_(-3, 3), alpha=-args.lr)
        new = {k: v.to(torch.bfloat16) for k, v in master.items()}
        t0 = time.perf_counter()
        patch = diff(prev, new, digest=digest, workers=args.ranks, advance=True)
        codec.encode(patch, workers=args.ranks)
        took.append(time.perf_counter() - t0)
        digest = patch.target_digest or digest
        del new
    return took


def main() -> None:
    ap = ranked_args(__doc__.split("\n", 1)[0])
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.txt")
        mp.spawn(_rank, args=(args, os.path.join(tmp, "store"), out), nprocs=args.ranks)
        print(f"{args.size}, {args.ranks} ranks x 1 thread (gloo, CPU):")
        print(Path(out).read_text(), end="")
    if not args.skip_baseline:
        took = unsharded(args)
        print(
            f"unsharded, 1 process x {args.ranks} threads: diff + encode per version "
            f"{statistics.median(took):.2f} s median ({', '.join(f'{t:.2f}' for t in took)})"
        )
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
        print(f"  peak RSS {peak:,.0f} MB")


if __name__ == "__main__":
    main()
