"""What a sharded trainer's version costs per rank: diff and code where the blocks live,
gather the frames, join them into the patch on rank 0; against one process diffing the whole.

Each rank holds its row blocks (Shard(0), as FSDP2 places them) of a LLaMA-shaped bf16 model
and its fp32 master blocks; a version is one AdamW-like step on them. Per version it prints,
per rank, the diff + frame coding time (``ShardDiffer.step``, ``code_parts``) and the bytes
it sent to rank 0 (its pickled frames); rank 0's gather and join (``join_ranks``: coding-5
frames of the ranks' own bytes, then the file) and the patch size (rank 0 keeps no copy of
the model in format 1); then, for comparison in the same run, rank 0 decoding the frames and
coding the patch again (the path of formats 2 and 3), the unsharded baseline in one process
with as many threads as there are ranks (``diff`` + ``codec.encode`` of the whole model) and
every rank's peak RSS.

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
from p2p_sync.runtime.sharded import code_parts, decode_parts, join_ranks, write_snapshot
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

    def __init__(
        self, size: str, rank: int, ranks: int, mesh: object, lr: float, device: str = "cpu"
    ) -> None:
        self.lr, self.gen = lr, torch.Generator(device).manual_seed(1000 + rank)
        self.master: dict[str, torch.Tensor] = {}
        self.served: dict[str, DTensor] = {}
        for name, shape in llama_shapes(size).items():
            a, b = _rows(shape[0], rank, ranks)
            local = torch.empty((b - a, *shape[1:]), device=device)
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
    mesh = init_device_mesh(torch.device(args.device).type, (args.ranks,))
    blocks = Blocks(args.size, rank, args.ranks, mesh, args.lr, args.device)
    layout = layout_of(blocks.served)
    sums = gather_to(partial_sums(blocks.served))
    digest = digest_of(layout, sums) if sums is not None else None
    differ = ShardDiffer(blocks.served)
    lines = [_v0(rank, blocks, os.path.dirname(out))]
    resident, grew = status_kb("VmRSS"), 0
    for v in range(1, args.versions + 1):
        blocks.step()
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # the peak of this publish alone
        before = status_kb("VmRSS")
        t0 = time.perf_counter()
        stepped = differ.step(blocks.served)
        td = time.perf_counter()
        parts = code_parts(stepped)  # as Trainer.publish sends them
        del stepped
        t1 = time.perf_counter()
        sent = len(pickle.dumps(parts))
        gathered = gather_to(parts)
        t2 = time.perf_counter()
        if gathered is not None and digest is not None:
            lines.append(_rank0(v, layout, gathered, digest, (t0, t1, t2)))
            last, digest = (gathered, digest), join_ranks(layout, gathered, digest)[1]
        grew = max(grew, status_kb("VmHWM") - before)
        sent_all = gather_to((rank, td - t0, t1 - td, sent))
        if sent_all is not None:
            lines.append(
                "    per rank (diff + code s, MB sent): "
                + ", ".join(f"r{r} {d:.2f} + {c:.2f} s {s / 1e6:.1f} MB" for r, d, c, s in sent_all)
            )
    lines += _peaks(rank, blocks, resident, grew)
    if rank == 0:
        lines.append(_recoded(layout, *last))
        Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _v0(rank: int, blocks: Blocks, folder: str) -> str:
    """v0's snapshot written by the ranks into one file (format 1), and what it adds to rank
    0's resident memory: a block at a time, not the model."""
    path = Path(folder) / "v0.safetensors"
    if rank == 0:
        path.touch()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before, t0 = status_kb("VmRSS"), time.perf_counter()
    write_snapshot(blocks.served, path if rank == 0 else None)
    took, grew = time.perf_counter() - t0, (status_kb("VmHWM") - before) / 1e3
    if rank != 0:
        return ""
    size = path.stat().st_size / 1e6
    path.unlink()
    return (
        f"v0: the ranks wrote its {size:,.0f} MB snapshot in {took:.2f} s; rank 0 +{grew:,.0f} MB"
    )


def _rank0(v: int, layout: tuple, gathered: list, digest: StateDigest, t: tuple) -> str:
    """Rank 0's part of a version: join the frames into the patch."""
    t0, t1, t2 = t
    frames, target = join_ranks(layout, gathered, digest)
    data = codec.assemble(layout, digest.hash(), target.hash(), frames)
    t3 = time.perf_counter()
    return (
        f"v{v}: rank 0 diff+code {t1 - t0:.2f} s, gather {t2 - t1:.2f} s, join {t3 - t2:.2f} s, "
        f"publish's diff+code in all {t3 - t0:.2f} s; patch {len(data) / 1e6:.1f} MB"
    )


def _recoded(layout: tuple, gathered: list, digest: StateDigest) -> str:
    """For comparison, after the timed versions (it would disturb them): the last version's
    frames decoded and the patch coded again on rank 0, as formats 2 and 3 do."""
    t0 = time.perf_counter()
    patch, _ = assemble(layout, [decode_parts(r, layout) for r in gathered], digest)
    again = codec.encode(patch, workers=1)
    return (
        f"re-coding the last version instead (as formats 2 and 3 do): decode + assemble + "
        f"encode {time.perf_counter() - t0:.2f} s ({len(again) / 1e6:.1f} MB)"
    )


def _peaks(rank: int, blocks: Blocks, resident: int, grew: int) -> list[str]:
    shard_mb = sum(t.to_local().numel() * 2 for t in blocks.served.values()) / 1e6
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    peaks = gather_to((rank, peak, shard_mb, resident / 1e3, grew / 1e3))
    if peaks is None:
        return []
    return [
        f"  rank {r}: peak RSS {p:,.0f} MB; its bf16 blocks {s:,.0f} MB, fp32 masters "
        f"{2 * s:,.0f} MB (rss / (blocks + masters) {p / (3 * s):.2f}); resident before "
        f"publishing {at:,.0f} MB (blocks, masters, the kept last version, the runtime), "
        f"a publish adds at most {g:,.0f} MB ({(at + g) / at:.2f}x)"
        for r, p, s, at, g in peaks
    ]


def unsharded(args: argparse.Namespace) -> list[float]:
    """The same versions diffed and coded whole in one process with ``--ranks`` threads."""
    torch.set_num_threads(args.ranks)
    gen = torch.Generator(args.device).manual_seed(7)
    master = {}
    for name, shape in llama_shapes(args.size).items():
        t = torch.empty(shape, device=args.device)
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
        if args.device != "cpu":
            torch.cuda.synchronize()
        took.append(time.perf_counter() - t0)
        digest = patch.target_digest or digest
        del new
    return took


def main() -> None:
    ap = ranked_args(__doc__.split("\n", 1)[0])
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument(
        "--device", default="cpu", help="where the ranks' blocks live (cuda: all on one)"
    )
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
