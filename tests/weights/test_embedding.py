"""The embedding API with a real Hugging Face causal LM (a tiny LLaMA built locally, never
downloaded), and recovery from a damaged checkpoint or log: real nodes on loopback."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from p2p_sync import Rollout, Trainer
from p2p_sync.errors import LayoutMismatchError
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import TrainerNode
from p2p_sync.store import Store
from p2p_sync.trust.keys import SigningKey, write_keypair
from p2p_sync.trust.manifest import SwarmPolicy
from tests import store_writer
from tests.helpers import bit_equal, rollout_config, tiny_llama_config, trainer_config

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int) -> torch.nn.Module:
    cfg = tiny_llama_config(tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def train_step(model: torch.nn.Module, master: dict[str, torch.Tensor], step: int) -> None:
    """An AdamW-like step on fp32 master weights, copied into the bf16 model (what RL
    post-training does): only some bf16 elements change bits."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = master[name]
            m.add_(torch.randn(m.shape, generator=g).sign(), alpha=-3e-3)
            p.copy_(m)


def generate(model: torch.nn.Module) -> list[int]:
    prompt = torch.tensor([[1, 5, 9, 17, 33]], device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    return out[0].tolist()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_engine_model_follows_the_trainer_in_place(tmp_path: Path, device: str) -> None:
    """On the GPU, both ends work there: the trainer diffs and hashes the published CUDA
    tensors, and the engine's CUDA tensors are patched in place between generations."""
    key = SigningKey.generate()
    pub = write_keypair(key, tmp_path / "trainer.key")
    trained = tiny_llama(seed=1)
    master = {n: p.detach().float().clone() for n, p in trained.named_parameters()}
    engine = tiny_llama(seed=2).to(device)  # other weights at first: v0 overwrites them
    engine_params = {n: p.data_ptr() for n, p in engine.named_parameters()}
    with Trainer(
        key=tmp_path / "trainer.key",
        data_dir=tmp_path / "t",
        publish={"chunk_size": 16384},
        directory={"poll_interval_s": 0.2},
    ) as trainer:
        with Rollout(
            trust=[str(pub)],
            peers=[trainer.url],
            data_dir=tmp_path / "r",
            model=engine,
            download={"have_poll_s": 0.05},
            directory={"poll_interval_s": 0.2},
        ) as rollout:
            for v in range(4):
                if v:
                    train_step(trained, master, v)
                published = {k: t.to(device) for k, t in trained.state_dict().items()}
                assert trainer.publish(published) == v
                assert rollout.wait_for_update(timeout=60)
                before = [p.clone() for p in engine.parameters()] if v else None
                while rollout.version != v:  # applied only when the engine asks
                    assert rollout.wait_for_update(timeout=60)
                    hand = rollout.apply_updates()
                    assert hand.pause_s >= sum(u.apply_s for u in hand.updates)
                if before is not None:
                    assert any(not torch.equal(a, b) for a, b in zip(before, engine.parameters()))
                held = {k: t.cpu() for k, t in engine.state_dict().items()}
                assert bit_equal(held, trained.state_dict())
                fresh = tiny_llama(seed=3).to(device)
                fresh.load_state_dict(published)
                assert generate(engine) == generate(fresh)
            assert trainer.last_publish is not None and trainer.last_publish["version"] == 3
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == engine_params  # in place


def test_an_engine_model_of_another_layout_is_refused_untouched(tmp_path: Path) -> None:
    key = SigningKey.generate()
    pub = write_keypair(key, tmp_path / "trainer.key")
    weights = {"a.weight": torch.randn(8, 4).bfloat16(), "b.weight": torch.randn(4).bfloat16()}
    engine = {"a.weight": torch.zeros(8, 4).bfloat16(), "b.weight": torch.zeros(5).bfloat16()}
    with Trainer(key=tmp_path / "trainer.key", data_dir=tmp_path / "t") as trainer:
        trainer.publish(weights)
        with Rollout(
            trust=[str(pub)],
            peers=[trainer.url],
            data_dir=tmp_path / "r",
            model=engine,
            download={"have_poll_s": 0.05},
        ) as rollout:
            assert rollout.wait_for_update(timeout=60)
            with pytest.raises(LayoutMismatchError, match="'b.weight'"):
                rollout.apply_updates()
            assert rollout.version is None
    assert all(not t.any() for t in engine.values())  # nothing written


def test_layout_errors_name_the_tensor(tmp_path: Path) -> None:
    from p2p_sync.weights.weights_io import load_into, save_weights

    save_weights(tmp_path / "w.safetensors", {"x": torch.ones(3), "y": torch.ones(2)})
    target = {"x": torch.zeros(3), "y": torch.zeros(4)}
    with pytest.raises(LayoutMismatchError, match="'y'"):
        load_into(tmp_path / "w.safetensors", target)
    assert not target["x"].any()


def _written_store(root: Path, key: SigningKey, swarm: str, n: int) -> list[dict]:
    """A store holding v0 (snapshot) .. v{n-1} (patches), every version logged."""
    store = Store.open(root)
    rnd = store_writer.random.Random(5)
    versions, prev = [], None
    for v in range(n):
        new = store_writer._next(prev, rnd) if prev is not None else store_writer._initial()
        m = store_writer.publish(store, key, swarm, v, prev, new)
        store.record(v, m.target_state, m.digest)
        versions.append(new)
        prev = new
    return versions


async def _follow(rollout: Node, done: Callable[[Follower], bool]) -> Follower:
    """Run a follower on ``rollout`` until ``done`` holds (a bounded poll, 60 s at most)."""
    await rollout.start()
    follower = Follower(rollout)
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    try:
        for _ in range(600):
            if done(follower):
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await task
        await rollout.stop()
    return follower


async def _recover(tmp_path: Path, damage) -> tuple[Follower, Store]:
    key = SigningKey.generate()
    policy = SwarmPolicy("crash", (key.public,))
    versions = _written_store(tmp_path / "t", key, policy.swarm_id, 4)
    shutil.copytree(tmp_path / "t", tmp_path / "r")
    damage(Store.open(tmp_path / "r"))
    tcfg = trainer_config(tmp_path)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    url = await trainer.start()
    rcfg = rollout_config(tmp_path, key, url)
    store = Store.open(rcfg.data_dir)
    try:
        follower = await _follow(Node(rcfg, policy, store), lambda f: f.state.version == 3)
    finally:
        await trainer.stop()
    assert follower.weights is not None and bit_equal(follower.weights, versions[-1])
    return follower, store


def test_a_logged_patch_that_fails_its_hash_is_refetched_not_applied(tmp_path: Path) -> None:
    def rot_v2(store: Store) -> None:
        m = store.manifest(store.log[2].manifest)
        with open(store.pack_path(m.digest), "r+b") as f:
            f.write(b"bit rot")

    follower, store = asyncio.run(_recover(tmp_path, rot_v2))
    assert any("chunk 0: does not match" in d for d in store.dropped), store.dropped
    assert [u.version for u in follower.updates] == [2, 3]  # v0-v1 replayed, v2 fetched again


def test_a_checkpoint_that_fails_its_hash_is_dropped_and_the_state_refetched(
    tmp_path: Path,
) -> None:
    def corrupt_checkpoint(store: Store) -> None:
        from p2p_sync.store.restore import restore

        restored = restore(store)
        assert restored is not None
        state = store.state
        store.set_checkpoint(state.version, state.state_hash, lambda f: f.write(b"not the weights"))

    follower, store = asyncio.run(_recover(tmp_path, corrupt_checkpoint))
    assert any("failed verification" in d for d in store.dropped), store.dropped
    assert [u.version for u in follower.updates] == [0, 1, 2, 3]  # from the anchor again


async def _follow_until_refused(tmp_path: Path) -> tuple[Follower, list[dict]]:
    from p2p_sync.weights.patch import Patch, diff

    key = SigningKey.generate()
    policy = SwarmPolicy("torn", (key.public,))
    versions = _written_store(tmp_path / "r", key, policy.swarm_id, 2)
    store = Store.open(tmp_path / "r")
    bad_next = store_writer._next(versions[-1], store_writer.random.Random(9))
    good = diff(versions[-1], bad_next)
    lying = Patch(good.layout, good.base_hash, b"\x07" * 16, good.deltas)  # signed, inconsistent
    data = store_writer.codec.encode(lying)
    m = store_writer.manifest_for(
        data,
        swarm=policy.swarm_id,
        version=2,
        kind="patch",
        target_state=lying.target_hash.hex(),
        layout=store_writer.layout_fingerprint(good.layout).hex(),
        now=0,
        chunk_size=16 * 1024,
        base_version=1,
        base_state=good.base_hash.hex(),
    )
    store.put_payload(m, data)
    store.put_manifest(m, store_writer.sign(m, [key]))
    cfg = NodeConfig(role="rollout", data_dir=tmp_path / "r", trust=(key.public.text(),), p2p=False)
    follower = await _follow(Node(cfg, policy, store), lambda f: m.digest in f.refused)
    return follower, versions


def test_a_signed_patch_that_misses_its_target_is_refused_and_the_weights_rebuilt(
    tmp_path: Path,
) -> None:
    follower, versions = asyncio.run(_follow_until_refused(tmp_path))
    assert follower.state.version == 1 and follower.weights is not None
    assert bit_equal(follower.weights, versions[1])  # torn writes undone by rebuilding
