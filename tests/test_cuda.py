"""The GPU path gives the same patches and the same weights as the CPU path.

These run only where a CUDA device exists (CI has none; they ran on a lent H100, see the notes).
"""

from __future__ import annotations

import pytest
import torch

from p2p_sync import codec
from p2p_sync.patch import apply, diff
from p2p_sync.statehash import state_hash
from tests.helpers import bit_equal, clone_set

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_gpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in tensors.items()}


def test_gpu_diff_encodes_to_the_same_bytes_as_cpu(tiny_versions: list) -> None:
    for a, b in zip(tiny_versions, tiny_versions[1:4]):
        assert codec.encode(diff(on_gpu(a), on_gpu(b))) == codec.encode(diff(a, b))


def test_gpu_apply_is_bit_exact_and_hashes_match(tiny_versions: list) -> None:
    weights = on_gpu(clone_set(tiny_versions[0]))
    for a, b in zip(tiny_versions, tiny_versions[1:]):
        apply(weights, codec.decode(codec.encode(diff(a, b))))
    assert weights[next(iter(weights))].is_cuda
    assert state_hash(weights) == state_hash(tiny_versions[-1])
    assert bit_equal({k: v.cpu() for k, v in weights.items()}, tiny_versions[-1])


def test_gpu_state_hash_is_computed_on_the_device_and_matches_the_host(tiny_versions) -> None:
    from p2p_sync.statehash import StateDigest, tensor_sums, word_sums

    weights = on_gpu(tiny_versions[0])
    assert StateDigest.of(weights).sums == StateDigest.of(tiny_versions[0]).sums
    t = torch.randn(3 * 2**20 + 3).to(torch.bfloat16)  # several device chunks and a tail word
    from p2p_sync import statehash

    old, statehash.DEVICE_CHUNK_WORDS = statehash.DEVICE_CHUNK_WORDS, 2**18
    try:
        assert tensor_sums(t.cuda()) == tensor_sums(t)
    finally:
        statehash.DEVICE_CHUNK_WORDS = old
    words = torch.tensor([0, 7, 1000, (t.numel() * 2 - 1) // 8])
    assert word_sums(t.cuda(), words) == word_sums(t, words)


def test_gpu_format2_encodes_and_applies_in_place_like_the_host(tiny_versions) -> None:
    from p2p_sync.restore import apply_frames
    from p2p_sync.statehash import StateDigest

    a, b = tiny_versions[0], tiny_versions[1]
    host = codec.encode(diff(a, b), base=a)
    ga, gb = on_gpu(a), on_gpu(b)
    assert codec.encode(diff(ga, gb), base=ga) == host  # scans ran on the GPU
    assert codec.read_header(host).version == 2
    digest = StateDigest.of(ga)
    apply_frames(ga, memoryview(host), codec.read_header(host), digest)
    assert digest.hash() == state_hash(b)
    assert bit_equal({k: v.cpu() for k, v in ga.items()}, b)


def test_engine_model_on_the_gpu_follows_the_trainer_in_place(tmp_path) -> None:
    """The embedding API end to end with weights on the GPU at both ends: the trainer diffs
    and hashes there, the engine's CUDA tensors are patched in place between generations."""
    from p2p_sync import Rollout, Trainer
    from p2p_sync.keys import SigningKey, write_keypair
    from tests.test_embedding import tiny_llama, train_step

    def generate(model: torch.nn.Module) -> list[int]:
        prompt = torch.tensor([[1, 5, 9, 17, 33]], device="cuda")
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        return out[0].tolist()

    key = SigningKey.generate()
    pub = write_keypair(key, tmp_path / "trainer.key")
    trained = tiny_llama(seed=1)
    master = {n: p.detach().float().clone() for n, p in trained.named_parameters()}
    engine = tiny_llama(seed=2).cuda()
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
    with Trainer(key=tmp_path / "trainer.key", data_dir=tmp_path / "t", chunk_size=16384,
                 poll_interval_s=0.2) as trainer:  # fmt: skip
        with Rollout(trust=[str(pub)], peers=[trainer.url], data_dir=tmp_path / "r",
                     model=engine, have_poll_s=0.05, poll_interval_s=0.2) as rollout:  # fmt: skip
            for v in range(4):
                if v:
                    train_step(trained, master, v)
                gpu_state = {k: t.cuda() for k, t in trained.state_dict().items()}
                assert trainer.publish(gpu_state) == v
                while rollout.version != v:
                    assert rollout.wait_for_update(timeout=60)
                    rollout.apply_updates()
                got = {k: t.cpu() for k, t in engine.state_dict().items()}
                assert bit_equal(got, trained.state_dict())
                fresh = tiny_llama(seed=3).cuda()
                fresh.load_state_dict(gpu_state)
                assert generate(engine) == generate(fresh)
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == ptrs  # in place
