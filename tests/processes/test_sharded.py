"""A sharded trainer's state (real torch.distributed, gloo on CPU, 2 ranks): every rank diffs its
own DTensor blocks, only the changes reach rank 0, and the patch it assembles is the unsharded
diff of the same weights, with the same state hashes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from p2p_sync import codec
from p2p_sync.runtime.sharded import code_parts, join_ranks, write_snapshot
from p2p_sync.weights.dtensors import (
    ShardDiffer,
    assemble,
    digest_of,
    gather_to,
    partial_sums,
    seed_blocks,
    whole_at,
)
from p2p_sync.weights.patch import apply, diff
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.tensors import layout_of
from p2p_sync.weights.weights_io import load_weights

WORLD = 2
PLACED = {  # name: (shape, dtype, placement): row- and column-sharded, uneven, replicated
    "attn.qkv.weight": ((8, 16), torch.bfloat16, Shard(0)),
    "attn.o.weight": ((4, 16), torch.bfloat16, Shard(1)),
    "embed.weight": ((5, 8), torch.bfloat16, Shard(0)),  # 3 rows and 2
    "norm.weight": ((16,), torch.bfloat16, Replicate()),
    "head.bias": ((8,), torch.float32, Shard(0)),
}


def _weights(step: int) -> dict[str, torch.Tensor]:
    """The whole model at ``step`` (every rank builds the same): a sparse change per step."""
    g = torch.Generator().manual_seed(0)
    out = {n: torch.randn(shape, generator=g).to(dt) for n, (shape, dt, _) in PLACED.items()}
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(s)
        for t in out.values():
            mask = torch.rand(t.shape, generator=g) < 0.2
            t[mask] = (t.float() + torch.randn(t.shape, generator=g)).to(t.dtype)[mask]
    return out


def _sparse(d: object) -> tuple[list[int], list[int]]:
    pos = d.positions if d.positions is not None else torch.nonzero(d.deltas).reshape(-1)  # type: ignore[attr-defined]
    vals = d.deltas if d.positions is not None else d.deltas[pos]  # type: ignore[attr-defined]
    return pos.tolist(), vals.tolist()


def _rank(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))

        def sharded(step: int) -> dict[str, torch.Tensor]:
            w = _weights(step)
            return {n: distribute_tensor(w[n], mesh, [PLACED[n][2]]) for n in PLACED}

        v0 = sharded(0)
        for name, t in v0.items():  # whole at rank 0 only, from the blocks the ranks count
            whole = whole_at(t)
            assert (whole is None) == (rank != 0)
            if whole is not None:
                assert torch.equal(whole.view(torch.uint8), _weights(0)[name].view(torch.uint8))
        snapshot = Path(store).with_name("v0.safetensors")
        if rank == 0:
            snapshot.touch()
        write_snapshot(v0, snapshot if rank == 0 else None)  # written a block at a time
        if rank == 0:
            written = load_weights(snapshot)
            for name, t in _weights(0).items():
                assert torch.equal(written[name].view(torch.uint8), t.view(torch.uint8)), name
        _check_seeding(rank, v0)
        layout = layout_of(v0)
        sums = gather_to(partial_sums(v0))
        differ = ShardDiffer(v0)
        digest = digest_of(layout, sums) if sums is not None else None
        if digest is not None:
            assert digest.hash() == state_hash(_weights(0))
        for step in (1, 2):
            mine = differ.step(sharded(step))
            parts, coded = gather_to(mine), gather_to(code_parts(mine))
            if parts is None or coded is None:
                continue
            assert digest is not None
            base = digest
            patch, digest = assemble(layout, parts, digest)
            old, new = _weights(step - 1), _weights(step)
            assert patch.target_hash == state_hash(new)
            want = diff(old, new)
            assert patch.deltas.keys() == want.deltas.keys()
            for name, d in want.deltas.items():
                assert _sparse(patch.deltas[name]) == _sparse(d), name
            _check_joined(layout, coded, base, want, state_hash(new))
            apply(old, patch)  # checks the base and the target hash in full
            assert all(torch.equal(old[n].view(torch.uint8), new[n].view(torch.uint8)) for n in new)
        dist.barrier()  # leave together: a rank gone while another still talks aborts it
    finally:
        dist.destroy_process_group()


def _check_seeding(rank: int, v0: dict[str, torch.Tensor]) -> None:
    """Every rank's kept blocks set from whole tensors rank 0 reads one at a time; a read that
    fails part-way makes every rank raise (none waits for blocks that never come)."""
    from p2p_sync.errors import PatchError, PublishError

    names = sorted(PLACED)

    def broken():  # type: ignore[no-untyped-def]
        yield from sorted(_weights(1).items())[:2]
        raise PatchError("the store cannot rebuild its head")

    differ = ShardDiffer(v0)
    with pytest.raises(PatchError if rank == 0 else PublishError):
        seed_blocks(differ.prev, broken() if rank == 0 else None, names)
    seed_blocks(differ.prev, iter(sorted(_weights(1).items())) if rank == 0 else None, names)
    for name, b in differ.prev.items():
        want = _weights(1)[name][b.box.region]
        assert torch.equal(b.local.view(torch.uint8), want.contiguous().view(torch.uint8)), name


def _check_joined(layout, coded, base, want, target: bytes) -> None:  # type: ignore[no-untyped-def]
    """The ranks' frames joined without decoding (coding 5 for row blocks; column blocks
    re-coded) decode to the unsharded diff, and the ranks' sums give its target."""
    frames, digest = join_ranks(layout, coded, base)
    assert digest.hash() == target
    data = codec.assemble(layout, base.hash(), target, frames)
    codings = {r.spec.name: r.coding for r in codec.read_header(data).rows}
    assert codings["attn.qkv.weight"] == codings["embed.weight"] == codec.PARTS
    assert codings["attn.o.weight"] in (codec.SPARSE, codec.DENSE)  # columns interleave
    assert codings["norm.weight"] in (codec.SPARSE, codec.DENSE)  # one rank counts it whole
    joined = codec.decode(data)
    assert joined.deltas.keys() == want.deltas.keys()
    for name, d in want.deltas.items():
        assert _sparse(joined.deltas[name]) == _sparse(d), name


def test_ranks_diff_their_own_blocks_into_the_unsharded_patch(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def _box_slices(box: object) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape))  # type: ignore[attr-defined]


def _check_written(data_dir: Path, full: dict[str, torch.Tensor]) -> None:
    """v3's anchor and the checkpoint at close (v4), written by rank 0 with no copy of the
    model in format 1 (from the store, a tensor at a time), hold those versions bit for bit."""
    from p2p_sync.store import Store
    from p2p_sync.trust.manifest import SNAPSHOT
    from p2p_sync.weights.weights_io import load_weights

    store = Store.open(data_dir)
    anchor = [m for m in store.manifests() if m.kind == SNAPSHOT and m.version == 3]
    assert len(anchor) == 1
    checkpoint = store.checkpoint
    assert checkpoint is not None and checkpoint.version == 4
    for path, want in ((store.pack_path(anchor[0].digest), 3), (checkpoint.weights, 4)):
        held = load_weights(path)
        assert held.keys() == full[want].keys()
        for n, t in full[want].items():
            assert torch.equal(held[n].view(torch.int16), t.view(torch.int16)), (want, n)


def _step(model: torch.nn.Module, full: dict[str, torch.Tensor], v: int) -> None:
    """A sparse step of the whole weights, written into each rank's own shards."""
    from p2p_sync.weights.dtensors import block_of

    g = torch.Generator().manual_seed(v)
    for t in full.values():
        mask = torch.rand(t.shape, generator=g) < 0.1
        t[mask] = (t.float() + 0.5).to(t.dtype)[mask]
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.to_local().copy_(full[name][_box_slices(block_of(p).box)])


def _check_restarted(data_dir: Path, full: dict[str, torch.Tensor]) -> None:
    from p2p_sync.store import Store
    from p2p_sync.store.restore import restore
    from p2p_sync.trust.manifest import PATCH

    store = Store.open(data_dir)
    v5 = [m for m in store.manifests() if m.version == 5]
    assert [(m.kind, m.base_version) for m in v5] == [(PATCH, 4)]
    restored = restore(store)
    assert restored is not None and restored.state.version == 5
    for n, t in full.items():
        assert torch.equal(restored.weights[n].view(torch.int16), t.view(torch.int16)), n


def _trainer_rank(rank: int, store: str, root: str, patch_format: int) -> None:
    """FSDP2 (fully_shard) on 2 ranks publishing 5 versions through Trainer.publish on every
    rank (a failed one before v2), then one more after a restart; rank 0 also follows them
    with a rollout and checks it bit for bit (and that the asyncio face, which cannot be
    collective, refuses the sharded state dict). Format 1 joins the ranks' frames as they are
    and rank 0 holds no model (v0 written by the ranks, anchors, checkpoints and the head after
    a failure or a restart read from the store); format 3 decodes them and codes against rank
    0's copy of the head."""
    from torch.distributed.fsdp import fully_shard

    from p2p_sync import Rollout, Trainer
    from p2p_sync.errors import PublishError, ShardLayoutError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        model = model.to(torch.bfloat16)
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        kept = {}  # the whole weights of each version
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        base = Path(root)
        publish = {"patch_format": patch_format, "anchor_every": 3}
        with Trainer(
            key=base / "trainer.key", data_dir=base / f"t{rank}", publish=publish
        ) as trainer:
            follower = None
            if rank == 0:  # the asyncio face refuses a sharded state dict: publishing is collective
                with pytest.raises(PublishError, match=r"publish\(\) on every rank"):
                    asyncio.run(trainer.apublish(model.state_dict()))
                follower = Rollout(
                    trust=[str(base / "trainer.key.pub")],
                    peers=[trainer.url],
                    data_dir=base / "r",
                    download={"have_poll_s": 0.05},
                    directory={"poll_interval_s": 0.2},
                ).open()
            try:
                for v in range(5):
                    if v:
                        _step(model, full, v)
                    if v == 2:  # a failed version first: every rank raises, none hangs
                        bad = {**model.state_dict(), "extra": torch.zeros(4)}
                        with pytest.raises(ShardLayoutError, match="names, shapes or dtypes"):
                            trainer.publish(bad)
                    assert trainer.publish(model.state_dict()) == v  # and the next one works
                    kept[v] = {n: t.clone() for n, t in full.items()}
                    if follower is not None:
                        follower.wait_for_version(v)
                        held = follower.weights or {}
                        assert held.keys() == full.keys()
                        for n, t in full.items():
                            assert torch.equal(held[n].view(torch.int16), t.view(torch.int16)), n
            finally:
                if follower is not None:
                    follower.close()
        if rank == 0:
            _check_written(base / "t0", kept)
        _step(model, full, 5)  # after a restart: v5 is a patch from the store's head (v4)
        with Trainer(
            key=base / "trainer.key", data_dir=base / f"t{rank}", publish=publish
        ) as again:
            assert again.publish(model.state_dict()) == 5
        if rank == 0:
            _check_restarted(base / "t0", full)
        dist.barrier()  # leave together (on success: a failed rank is ended by spawn)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two ranks, each importing torch.distributed: started first
@pytest.mark.parametrize("patch_format", [1, 3])
def test_an_fsdp2_trainer_publishes_from_every_rank_and_a_rollout_follows(
    tmp_path: Path, patch_format: int
) -> None:
    from p2p_sync.trust.keys import SigningKey, write_keypair

    write_keypair(SigningKey.generate(), tmp_path / "trainer.key")
    args = (str(tmp_path / "store"), str(tmp_path), patch_format)
    mp.spawn(_trainer_rank, args=args, nprocs=WORLD, join=True)
