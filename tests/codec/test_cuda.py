"""The GPU path gives the same patches and the same weights as the CPU path.

These run only where a CUDA device exists (CI has none; they ran on a lent H100, see the notes).
"""

from __future__ import annotations

import pytest
import torch

from p2p_sync import codec
from p2p_sync.codec import frames as codec_frames
from p2p_sync.weights.patch import apply, diff
from p2p_sync.weights.statehash import state_hash
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
    from p2p_sync.weights.statehash import StateDigest, tensor_sums, word_sums

    weights = on_gpu(tiny_versions[0])
    assert StateDigest.of(weights).sums == StateDigest.of(tiny_versions[0]).sums
    t = torch.randn(3 * 2**20 + 3).to(torch.bfloat16)  # several device chunks and a tail word
    from p2p_sync.weights import statehash

    old, statehash.DEVICE_CHUNK_WORDS = statehash.DEVICE_CHUNK_WORDS, 2**18
    try:
        assert tensor_sums(t.cuda()) == tensor_sums(t)
    finally:
        statehash.DEVICE_CHUNK_WORDS = old
    words = torch.tensor([0, 7, 1000, (t.numel() * 2 - 1) // 8])
    assert word_sums(t.cuda(), words) == word_sums(t, words)


def test_gpu_format2_encodes_and_applies_in_place_like_the_host(tiny_versions) -> None:
    from p2p_sync.store.restore import apply_frames
    from p2p_sync.weights.statehash import StateDigest

    a, b = tiny_versions[0], tiny_versions[1]
    host = codec.encode(diff(a, b), base=a)
    ga, gb = on_gpu(a), on_gpu(b)
    assert codec.encode(diff(ga, gb), base=ga) == host  # scans ran on the GPU
    assert codec.read_header(host).version == 2
    digest = StateDigest.of(ga)
    apply_frames(ga, memoryview(host), codec.read_header(host), digest)
    assert digest.hash() == state_hash(b)
    assert bit_equal({k: v.cpu() for k, v in ga.items()}, b)


def test_gpu_apply_in_small_blocks_and_threads_keeps_the_digest_exact(
    tiny_versions, monkeypatch
) -> None:
    """Sums moved on the device across many blocks (``track_on_device``), several threads,
    read back per tensor: the digest equals the host's after every version."""
    from p2p_sync.store.restore import apply_frames
    from p2p_sync.weights.statehash import StateDigest

    monkeypatch.setattr(codec_frames, "BLOCK", 64)
    weights = on_gpu(clone_set(tiny_versions[0]))
    digest = StateDigest.of(weights)
    for a, b in zip(tiny_versions, tiny_versions[1:4]):
        data = codec.encode(diff(a, b))
        apply_frames(weights, memoryview(data), codec.read_header(data), digest, workers=4)
        assert not digest.moved and digest.hash() == state_hash(b)
    assert bit_equal({k: v.cpu() for k, v in weights.items()}, tiny_versions[3])


def test_gpu_weights_cap_the_apply_threads_by_coding(tiny_versions) -> None:
    from p2p_sync.store.restore import GPU_APPLY_THREADS, apply_threads

    a, b = tiny_versions[0], tiny_versions[1]
    plain = codec.read_header(codec.encode(diff(a, b)))
    classed = codec.read_header(codec.encode(diff(a, b), base=a))
    assert any(r.coding == codec.CLASSED for r in classed.rows)
    gpu = on_gpu(a)
    assert apply_threads(gpu, plain, 16) == GPU_APPLY_THREADS[False] < 16
    assert apply_threads(gpu, classed, 16) == GPU_APPLY_THREADS[True] < 16
    assert apply_threads(gpu, classed, 2) == 2
