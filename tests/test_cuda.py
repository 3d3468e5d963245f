"""The GPU path gives the same patches and the same weights as the CPU path.

These run only where a CUDA device exists (CI has none; they ran on a lent H100, see the notes).
"""

from __future__ import annotations

import pytest
import torch

from p2p_sync import codec
from p2p_sync.patch import apply, diff
from p2p_sync.tensors import state_hash
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
