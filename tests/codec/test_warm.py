"""A fresh node compiles its codec's scans at start (``p2p_sync.runtime.warm.warm_codec``), not on
its
first version: numba compiles per argument types, and a warm-up that misses a path leaves
seconds of compiling to the first real patch (7 s for the median rollout of the emulated
swarm). Checked in a fresh process with an empty numba cache, through numba's compile
events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
from numba.core import event
from p2p_sync.runtime.warm import warm_codec
from p2p_sync import codec
from p2p_sync.weights.patch import diff
from p2p_sync.store.restore import apply_frames
from p2p_sync.weights.statehash import StateDigest

warm_codec()
g = torch.Generator().manual_seed(1)
late = []
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    base = {
        "a": torch.randn(400_000, generator=g).to(dtype),
        "b": torch.randn(300, 700, generator=g).to(dtype),
    }
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    dense = {k: (v.float() * 1.01 + 0.001).to(dtype) for k, v in base.items()}
    pick = {k: torch.rand(v.shape, generator=g) < 0.03 for k, v in base.items()}
    sparse = {k: torch.where(pick[k], dense[k], v) for k, v in base.items()}
    for name, new in (("dense", dense), ("sparse", sparse)):
        step = diff(base, new)
        for fmt, data in ((2, codec.encode(step, base=base)), (1, codec.encode(step))):
            with event.install_recorder("numba:compile") as rec:
                for workers in (1, 2):
                    w = {k: v.clone() for k, v in base.items()}
                    digest = StateDigest.of(w)
                    apply_frames(w, memoryview(data), codec.read_header(data), digest, workers)
                    assert all(torch.equal(w[k].view(bits), new[k].view(bits)) for k in w)
            for ev in rec.buffer:
                if ev[1].is_start:
                    late.append([str(dtype), name, fmt, str(ev[1].data.get("dispatcher"))])
print(json.dumps(late))
"""


@pytest.mark.slow  # started first by `make test`'s parallel pass
def test_after_warm_up_a_real_patch_compiles_nothing(tmp_path: Path) -> None:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    late = json.loads(out.stdout.strip().splitlines()[-1])
    assert late == [], late  # each: dtype, pattern, format, the scan compiled on first use
