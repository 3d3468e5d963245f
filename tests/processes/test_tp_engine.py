"""A tensor-parallel engine following the swarm (real torch.distributed, gloo on CPU, 2 ranks):
Hugging Face transformers' own tensor parallelism (``tp_plan="auto"``) shards a LLaMA model;
rank 0's node fetches and verifies, every rank patches its own shards in place, and after each
version each shard is the trainer's slice bit for bit and greedy generation equals a fresh
tensor-parallel model loaded from the trainer's weights."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

WORLD = 2
PADDED = 192  # the fused engine's vocabulary rows (the checkpoint's 128, padded)
PROMPT = [[1, 7, 42, 9, 3]]


def _config() -> object:
    from tests.helpers import tiny_llama_config

    return tiny_llama_config()


def _step(full: dict[str, torch.Tensor], v: int) -> None:
    """A sparse optimizer-like step, the same on every rank (seeded by the version)."""
    g = torch.Generator().manual_seed(v)
    for t in full.values():
        mask = torch.rand(t.shape, generator=g) < 0.05
        t[mask] = (t.float() * (1 + torch.randn(t.shape, generator=g) * 0.05)).to(t.dtype)[mask]


def _save(full: dict[str, torch.Tensor], where: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(_config()).to(torch.bfloat16)
    model.load_state_dict(full)
    model.save_pretrained(where)


def _load_tp(where: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(where, tp_plan="auto", dtype=torch.bfloat16)


def _generate(model: torch.nn.Module) -> list[list[int]]:
    out = model.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)  # type: ignore[operator]
    return out.tolist()


def _shards_equal(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> list[str]:
    """Names whose local shard differs from the trainer's slice of the whole tensor."""
    from p2p_sync.weights.dtensors import block_of

    wrong = []
    for name, t in model.state_dict().items():
        b = block_of(t)
        region = tuple(slice(o, o + n) for o, n in zip(b.box.offsets, b.box.shape))
        want = full[name][region] if region else full[name]
        if not torch.equal(b.local.view(torch.int16), want.view(torch.int16)):
            wrong.append(name)
    return wrong


def _follow(rollout: object, version: int) -> list[str]:
    """Apply versions as they come until the engine holds ``version`` (every rank together:
    the calls are collective); the kinds of update applied."""
    kinds: list[str] = []
    for _ in range(120):  # bounded: a version a second at the least
        if rollout.version is not None and rollout.version >= version:  # type: ignore[attr-defined]
            return kinds
        if rollout.wait_for_update(1.0):  # type: ignore[attr-defined]
            kinds += [u.kind for u in rollout.apply_updates().updates]  # type: ignore[attr-defined]
    raise AssertionError(f"the engine did not reach v{version}")


def _rank(root: str) -> None:
    """One rank under torchrun (its environment names the rank and the rendezvous); rank 0
    also runs the trainer, publishing whole (unsharded) tensors."""
    from transformers import LlamaForCausalLM

    from p2p_sync import Rollout, Trainer

    dist.init_process_group("gloo")
    rank, base = dist.get_rank(), Path(root)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).to(torch.bfloat16)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        _save(full, base / "v0")
    dist.barrier()
    trainer = Trainer(key=base / "trainer.key", data_dir=base / "t").open() if rank == 0 else None
    url = [trainer.url if trainer is not None else None]
    dist.broadcast_object_list(url, src=0)
    engine = _load_tp(base / "v0")  # the checkpoint the trainer starts from
    with pytest.raises(RuntimeError, match="synchronous face on every rank"):  # no async face
        asyncio.run(Rollout(trust=[str(base / "trainer.key.pub")], model=engine).__aenter__())
    rollout = Rollout(
        trust=[str(base / "trainer.key.pub")],
        peers=[url[0]],
        data_dir=base / "r",
        model=engine,
        download={"have_poll_s": 0.05},
        directory={"poll_interval_s": 0.2},
    ).open()
    try:
        assert rollout.tp is not None  # DTensor parameters: the tensor-parallel path
        kinds = []
        for v in range(5):
            if v:
                _step(full, v)
            if v == 4:  # an engine shard that drifted: its sums miss v4, the head comes whole
                engine.model.layers[0].mlp.down_proj.weight.to_local().view(torch.int16)[0, 0] ^= 1
            if trainer is not None:
                trainer.publish(full)
            kinds += _follow(rollout, v)
            assert rollout.version == v
            assert _shards_equal(engine, full) == [], v
        # v0: the engine loaded it (found by its hash: nothing sent); v1-v3 patched in place;
        # v4's patch missed its target on the drifted shard: the head came whole, checked
        assert kinds == ["patch", "patch", "patch", "whole"], kinds
        tokens = _generate(engine)
        if rank == 0:
            _save(full, base / "v4")
        dist.barrier()
        assert tokens == _generate(_load_tp(base / "v4"))
        _fused_engine(rank, base, url[0], trainer, full)
        dist.barrier()  # leave together: a rank gone while another still talks aborts it
    finally:
        rollout.close()
        if trainer is not None:
            trainer.close()
        dist.destroy_process_group()


def _fused_engine(rank: int, base: Path, url: str, trainer: object, full: dict) -> None:
    """An engine laid out as vLLM loads LLaMA under tensor parallelism (fused q/k/v and
    gate/up row blocks, o/down column blocks, a padded vocabulary in row blocks), loaded from
    v4, takes v5 in its own tensors through ``fused_qkv_gate_up(..., tp_rank, tp_size)``."""
    from p2p_sync import Rollout
    from p2p_sync.weights.layout import fused_qkv_gate_up
    from tests.helpers import vllm_rank

    fused = vllm_rank(full, rank, WORLD, PADDED)
    layout = fused_qkv_gate_up(
        _config(), vocab_size=128, padded_vocab=PADDED, tp_rank=rank, tp_size=WORLD
    )
    rollout = Rollout(
        trust=[str(base / "trainer.key.pub")],
        peers=[url],
        data_dir=base / "r2",
        model=fused,
        layout=layout,
        download={"have_poll_s": 0.05},
        directory={"poll_interval_s": 0.2},
    ).open()
    try:
        _node_at(rollout, 4)
        assert _follow(rollout, 4) == []  # found to hold v4 by its hash: nothing sent
        _step(full, 5)
        if trainer is not None:
            trainer.publish(full)  # type: ignore[attr-defined]
        assert _follow(rollout, 5) == ["patch"]
        want = vllm_rank(full, rank, WORLD, PADDED)
        assert [n for n, t in fused.items() if not torch.equal(t, want[n])] == []
    finally:
        rollout.close()


def _node_at(rollout: object, version: int) -> None:
    """Wait (bounded) until rank 0's node holds ``version``, then go on together."""
    if rollout.node is not None:  # type: ignore[attr-defined]
        for _ in range(600):
            state = rollout.node.store.state  # type: ignore[attr-defined]
            if state is not None and state.version >= version:
                break
            time.sleep(0.05)  # polls the node's own state: bounded, not a synchronisation
    dist.barrier()


@pytest.mark.slow  # two ranks, each loading transformers: started first
def test_a_tensor_parallel_engine_patches_its_shards_in_place(tmp_path: Path) -> None:
    from p2p_sync.trust.keys import SigningKey, write_keypair

    write_keypair(SigningKey.generate(), tmp_path / "trainer.key")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run += [f"--nproc-per-node={WORLD}", __file__, str(tmp_path)]
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


if __name__ == "__main__":
    _rank(sys.argv[1])
