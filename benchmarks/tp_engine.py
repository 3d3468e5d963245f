"""What a version costs a tensor-parallel engine: its pause on every rank against the pause of
the same model applied in one process.

The trainer's patches (one AdamW-like step each, coded as a trainer codes them: format 2,
exponent classes against the base) are made first. Then ``--ranks`` processes (gloo, CPU, one
thread each) hold the blocks Hugging Face's LLaMA tensor-parallel plan gives them: q/k/v,
gate/up, embedding and LM head split by rows, o/down by columns, norms replicated. Rank 0 also
plays the node: it applies each version to its host copy with the frames kept for the engine
(``runtime.tp_engine.FrameCollector``, timed apart: the engine does not wait for it), then every
rank runs ``EngineSync.apply`` (broadcast, decode, patch its blocks, sums checked at rank 0):
the engine's pause. The baseline is the in-process rollout's pause on the same patches: decode,
apply in place and check the target hash (``restore.apply_frames``) with ``--ranks`` threads.

    python benchmarks/tp_engine.py --size 1b --ranks 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory import status_kb  # noqa: E402
from benchmarks.models import Model, ranked_args  # noqa: E402
from p2p_sync import codec  # noqa: E402
from p2p_sync.protocol.versions import PeerState  # noqa: E402
from p2p_sync.runtime.tp_engine import EngineQueue, EngineSync  # noqa: E402
from p2p_sync.store.restore import apply_frames  # noqa: E402
from p2p_sync.weights.dtensors import gather_to  # noqa: E402
from p2p_sync.weights.engine_shards import EngineShards  # noqa: E402
from p2p_sync.weights.patch import diff  # noqa: E402
from p2p_sync.weights.shards import (
    Block,  # noqa: E402
    Box,  # noqa: E402
)
from p2p_sync.weights.statehash import StateDigest  # noqa: E402
from p2p_sync.weights.tensors import layout_of  # noqa: E402

ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
COLUMNS = ("o_proj", "down_proj")


def _split_dim(name: str) -> int | None:
    """Hugging Face's LLaMA plan: colwise (rows of the weight) and rowwise (its columns)."""
    if any(k in name for k in ROWS):
        return 0
    return 1 if any(k in name for k in COLUMNS) else None


def _block(t: torch.Tensor, name: str, rank: int, ranks: int) -> Block:
    dim = _split_dim(name)
    if dim is None:
        return Block(t.clone(), Box.of_whole(tuple(t.shape)), rank == 0)
    size = t.shape[dim] // ranks
    offsets = tuple(rank * size if d == dim else 0 for d in range(t.dim()))
    shape = tuple(size if d == dim else n for d, n in enumerate(t.shape))
    local = t.narrow(dim, rank * size, size).contiguous().clone()
    return Block(local, Box(tuple(t.shape), offsets, shape), True)


def _rank(rank: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=args.ranks
    )
    host = load_file(f"{tmp}/v0.safetensors")
    blocks = {n: _block(t, n, rank, args.ranks) for n, t in sorted(host.items())}
    shards = EngineShards(layout_of(host), blocks)
    queue = EngineQueue() if rank == 0 else None
    digest = StateDigest.of(host) if rank == 0 else None
    state = PeerState(0, digest.hash().hex()) if digest else None
    if rank != 0:
        del host
    sync = EngineSync(shards, None, queue, (lambda fn: fn(host, state)) if rank == 0 else None)
    sync.attach()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here: the versions alone
    base_kb = status_kb("VmRSS")
    lines = []
    for v in range(1, args.versions + 1):
        node_s = 0.0
        if queue is not None and digest is not None:
            data = Path(f"{tmp}/v{v}.patch").read_bytes()
            t0 = time.perf_counter()
            collector = queue.collector()
            info = codec.read_header(data)
            apply_frames(host, memoryview(data), info, digest, 1, collector)
            queue.took(SimpleNamespace(version=v, target_state=info.target_hash.hex()), collector)
            state = PeerState(v, info.target_hash.hex())
            node_s = time.perf_counter() - t0
            shipped = collector.size
        dist.barrier()
        t0 = time.perf_counter()
        done = sync.apply()
        pause = time.perf_counter() - t0
        assert [u.kind for u in done] == ["patch"] and sync.state.version == v, done
        if rank == 0:
            lines.append(
                f"v{v}: pause {pause:.3f} s; node's own apply + cut + re-code {node_s:.2f} s; "
                f"sent to the ranks {shipped / 1e6:.1f} MB in all (patch {len(data) / 1e6:.1f} MB)"
            )
            print(lines[-1], flush=True)
    grew = (status_kb("VmHWM") - base_kb) / 1e3
    mine = sum(b.local.numel() * b.local.element_size() for b in blocks.values()) / 1e6
    peaks = gather_to((rank, base_kb / 1e3, grew, mine))
    if peaks is not None:
        for r, at, g, s in peaks:
            print(
                f"  rank {r}: its blocks {s:,.0f} MB; RSS {at:,.0f} MB before the versions, "
                f"peak +{g:,.0f} MB while applying them"
            )
    dist.destroy_process_group()


def make_versions(args: argparse.Namespace, tmp: str) -> None:
    """v0 as a weights file and each next version's patch, coded as a trainer codes it."""
    model = Model(args.size, args.lr, "cpu")
    prev = {k: v.clone() for k, v in model.bf16.items()}
    save_file(prev, f"{tmp}/v0.safetensors")
    for v in range(1, args.versions + 1):
        model.step()
        data = codec.encode(diff(prev, model.bf16), base=prev, workers=2)
        Path(f"{tmp}/v{v}.patch").write_bytes(data)
        prev = {k: t.clone() for k, t in model.bf16.items()}


def unsharded(args: argparse.Namespace, tmp: str) -> list[float]:
    """The in-process rollout's pause on the same patches, ``--ranks`` threads."""
    torch.set_num_threads(args.ranks)
    weights = load_file(f"{tmp}/v0.safetensors")
    digest = StateDigest.of(weights, args.ranks)
    took = []
    for v in range(1, args.versions + 1):
        data = Path(f"{tmp}/v{v}.patch").read_bytes()
        t0 = time.perf_counter()
        apply_frames(weights, memoryview(data), codec.read_header(data), digest, args.ranks)
        took.append(time.perf_counter() - t0)
    return took


def main() -> None:
    ap = ranked_args(__doc__.split("\n", 1)[0])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_versions(args, tmp)
        print(f"{args.size}, tensor-parallel engine, {args.ranks} ranks x 1 thread (gloo, CPU):")
        mp.spawn(_rank, args=(args, tmp), nprocs=args.ranks)
        took = unsharded(args, tmp)
    print(
        f"in-process engine, 1 process x {args.ranks} threads: pause per version "
        f"{statistics.median(took):.3f} s median ({', '.join(f'{t:.3f}' for t in took)})"
    )


if __name__ == "__main__":
    main()
