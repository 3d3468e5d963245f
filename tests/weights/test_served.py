"""The served dtype: fp32 master weights published as the engines serve them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from p2p_sync import Rollout, Trainer
from p2p_sync.trust.keys import SigningKey, write_keypair
from p2p_sync.weights.served import ServedWeights
from p2p_sync.weights.tensors import layout_of


def _master(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.bias": torch.randn(32, generator=g),
        "steps": torch.arange(4),  # an integer buffer: never cast
    }


def _step(master: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for name in ("a.weight", "b.bias"):
        master[name] -= 1e-3 * torch.randn(master[name].shape, generator=g).sign()


def test_served_weights_cast_floats_on_read_and_know_their_layout_without_casting() -> None:
    master = _master()
    served = ServedWeights(master, torch.bfloat16)
    assert {s.name: s.dtype for s in layout_of(served)} == {
        "a.weight": torch.bfloat16,
        "b.bias": torch.bfloat16,
        "steps": torch.int64,
    }
    assert layout_of(served) == layout_of({k: served[k] for k in served})
    assert torch.equal(served["a.weight"], master["a.weight"].bfloat16())
    assert served["steps"] is not master["steps"] and torch.equal(served["steps"], master["steps"])
    owned = served.owned("steps")
    assert owned.data_ptr() != master["steps"].data_ptr()


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64])
def test_a_served_dtype_patches_cannot_carry_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="serve_dtype"):
        ServedWeights(_master(), dtype)


def _follow(tmp: Path, versions: int, **trainer: object) -> tuple[list[int], dict]:
    """Publish ``versions`` steps of fp32 master weights; the patch sizes and what the
    rollout holds at the end."""
    tmp.mkdir(parents=True, exist_ok=True)
    pub = write_keypair(SigningKey.generate(), tmp / "trainer.key")
    master, sizes = _master(), []
    with (
        Trainer(key=tmp / "trainer.key", data_dir=tmp / "t", **trainer) as t,
        Rollout(trust=[str(pub)], peers=[t.url], data_dir=tmp / "r") as r,
    ):
        for v in range(versions):
            if v:
                _step(master, v)
            t.publish(master)
            r.wait_for_version(v)
            if v:
                sizes.append(t.last_publish["patch_bytes"])
        held = {k: x.clone() for k, x in (r.weights or {}).items()}
    return sizes, {"held": held, "master": master}


def test_fp32_masters_are_published_as_the_bf16_the_engines_serve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    served, got = _follow(tmp_path / "served", 3, serve_dtype=torch.bfloat16)
    held, master = got["held"], got["master"]
    assert held["a.weight"].dtype == torch.bfloat16
    for name in ("a.weight", "b.bias"):
        assert torch.equal(held[name].view(torch.int16), master[name].bfloat16().view(torch.int16))
    assert torch.equal(held["steps"], master["steps"])
    assert not [r for r in caplog.records if "float32" in r.getMessage()]
    caplog.set_level(logging.WARNING, logger="p2psync")
    as_is, _ = _follow(tmp_path / "fp32", 3)  # the same steps published as fp32
    assert sum(served) < sum(as_is)  # half the bits per value or less
    # which costs a warning, once, with the patch size
    warned = [r.getMessage() for r in caplog.records if "float32" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("v1: float32 weights"), warned
    assert "-byte patch" in warned[0] and "serve_dtype=torch.bfloat16" in warned[0]
