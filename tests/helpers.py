"""Shared test helpers: building tensor sets with chosen changes, rebuilding patch bytes, the
configs of a trainer and a rollout run in one test process, and a snapshot's manifest."""

from __future__ import annotations

import random
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2p_sync import codec
from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.protocol.swarmconfig import SwarmConfig
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.node import Node
from p2p_sync.store import Store
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, SwarmPolicy, sign
from p2p_sync.weights.tensors import flat_bits


def snapshot_manifest(payload: bytes, chunk_size: int = 16 * 1024, swarm: str = "t") -> Manifest:
    """Version 0 of ``swarm`` carrying ``payload`` (unsigned; no tensors behind it). A node
    admits it only with a real swarm id (``SwarmPolicy.swarm_id``); "t" suits the store."""
    return manifest_for(
        payload,
        swarm=swarm,
        version=0,
        kind=SNAPSHOT,
        target_state="00" * 16,
        layout="00" * 16,
        now=int(time.time()),
        chunk_size=chunk_size,
    )


def make_node(tmp_path: Path, **kw: Any) -> Node:
    """A rollout node (not started) with a fresh key and slow polls: one a test drives."""
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path,
        trust=("x",),
        directory=PeerLimits(poll_interval_s=60),
        **kw,
    )
    policy = SwarmPolicy("t", (SigningKey.generate().public,))
    return Node(cfg, policy, Store.open(tmp_path))


def node_holding(
    tmp_path: Path, payload: bytes, chunk_size: int, http: HttpLimits
) -> tuple[Node, Manifest]:
    """A rollout node (not started) whose store holds ``payload`` as a signed snapshot."""
    key = SigningKey.generate()
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path,
        trust=(key.public.text(),),
        directory=PeerLimits(poll_interval_s=60),
        http=http,
    )
    node = Node(cfg, SwarmPolicy("t", (key.public,)), Store.open(tmp_path))
    m = snapshot_manifest(payload, chunk_size=chunk_size)
    node.store.put_payload(m, payload)
    node.store.put_manifest(m, sign(m, [key]))
    return node, m


def trainer_config(tmp_path: Path, **overrides: Any) -> NodeConfig:
    """A trainer in ``tmp_path/t`` signing with the key file ``tmp_path/k``."""
    return NodeConfig(
        **{"role": "trainer", "data_dir": tmp_path / "t", "key": tmp_path / "k", **overrides}
    )


def rollout_config(tmp_path: Path, key: SigningKey, url: str, **overrides: Any) -> NodeConfig:
    """A rollout in ``tmp_path/r`` trusting ``key``, following the trainer at ``url``, and
    polling its peers and have-maps often (a test waits for it)."""
    values: dict[str, Any] = {
        "role": "rollout",
        "data_dir": tmp_path / "r",
        "trust": (key.public.text(),),
        "peers": (url,),
        "directory": PeerLimits(poll_interval_s=0.2),
        "download": SwarmConfig(have_poll_s=0.05),
    }
    return NodeConfig(**{**values, **overrides})


def clone_set(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, shapes, dtypes and bit patterns (NaN payloads and -0.0 included)."""
    if a.keys() != b.keys():
        return False
    return all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(flat_bits(a[k]), flat_bits(b[k]))
        for k in a
    )


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose bits are uniformly random (so every NaN/Inf/-0.0 pattern can occur)."""
    n = int(np.prod(shape, dtype=np.int64))
    width = dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=n * width, dtype=np.uint8)
    t = torch.from_numpy(raw).view(torch.uint8)
    if dtype == torch.bool:
        return (t & 1).to(torch.bool).reshape(shape)
    return t.view(dtype).reshape(shape).clone()


Mutator = Callable[[list[codec.FrameInfo], dict[str, bytes]], None]


def rebuild(data: bytes, mutate: Mutator, header_version: int = codec.FORMAT_VERSION) -> bytes:
    """Re-serialize a valid patch after ``mutate`` edits its rows or frames (for crafting attacks).

    Rows are FrameInfo objects (replace entries to change counts or codings); frames maps a tensor
    name to its zstd frame bytes. Sizes and the table are recomputed, so only the edit is wrong.
    """
    info = codec.read_header(data)
    rows = list(info.rows)
    frames = {r.spec.name: bytes(data[r.offset : r.offset + r.size]) for r in rows if r.size}
    mutate(rows, frames)
    table_raw = b"".join(
        codec._row_bytes(r.spec, r.coding, r.count, len(frames.get(r.spec.name, b""))) for r in rows
    )
    table = codec._compress([table_raw], 1)
    header = struct.pack(
        "<8sHHIII16s16s16s",
        codec.MAGIC,
        header_version,
        0,
        len(rows),
        len(table),
        len(table_raw),
        info.fingerprint,
        info.base_hash,
        info.target_hash,
    )
    body = b"".join(frames.get(r.spec.name, b"") for r in rows)
    return header + table + body


def mutate_bytes(
    data: bytes, rng: random.Random, flips: float = 0.6, cuts: float = 0.8, bits: bool = False
) -> bytes:
    """A random byte flip, truncation or insertion (sometimes several): a flip below
    ``flips``, a cut below ``cuts``, else an insertion; with ``bits`` half the flips are of a
    single bit (what a frame without a checksum must survive)."""
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind, i = rng.random(), rng.randrange(len(out) + 1)
        if kind < flips and i < len(out):
            out[i] ^= (
                1 << rng.randrange(8) if bits and rng.random() < 0.5 else rng.randrange(1, 256)
            )
        elif kind < cuts:
            del out[i:]
        else:
            out[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        if not out:
            break
    return bytes(out)


def frame_from_streams(streams: list[bytes]) -> bytes:
    return codec._compress(streams, 1)


async def stop_follower_pair(
    stop: Any, task: Any, publisher: Any, rollout: Node, trainer: Node
) -> None:
    """End a test's trainer + following rollout on loopback: the follower's loop, then the
    publisher, then both nodes."""
    stop.set()
    await task
    await publisher.aclose()
    await rollout.stop()
    await trainer.stop()


def publish_snapshot(
    node: Node, key: SigningKey, version: int, size: int = 70_000
) -> tuple[Manifest, bytes]:
    """A signed snapshot of ``version`` (``size`` seeded random bytes, distinct chunks) in
    ``node``'s store: payload and manifest, as a trainer's publish leaves them."""
    payload = random.Random(version).randbytes(size)
    m = manifest_for(
        payload,
        swarm=node.policy.swarm_id,
        version=version,
        kind=SNAPSHOT,
        target_state=f"{version:032x}",
        layout="bb" * 16,
        now=int(time.time()),
        chunk_size=16 * 1024,
    )
    node.store.put_payload(m, payload)
    node.store.put_manifest(m, sign(m, [key]))
    return m, payload


def vllm_rank(
    ck: dict[str, torch.Tensor], rank: int, size: int, padded: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of ``size``'s tensors of LLaMA checkpoint ``ck`` as vLLM's loader makes
    them: q/k/v and gate/up row blocks stacked, o/down column blocks, the vocabulary padded to
    ``padded`` rows and cut into row blocks, norms whole."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(size, 0)[rank]

    out = {}
    for name, t in ck.items():
        if name.endswith(("q_proj.weight", "gate_proj.weight")):
            fused = "qkv_proj" if "q_proj" in name else "gate_up_proj"
            parts = ("q_proj", "k_proj", "v_proj") if "q_proj" in name else ("gate_proj", "up_proj")
            prefix = name.rsplit(".", 2)[0]
            out[f"{prefix}.{fused}.weight"] = torch.cat(
                [rows(ck[f"{prefix}.{p}.weight"]) for p in parts]
            )
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = t.chunk(size, 1)[rank].contiguous().clone()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            pad = torch.zeros(padded - t.shape[0], t.shape[1], dtype=t.dtype)
            padded_t = torch.cat([t, pad])
            out[name] = rows(padded_t).clone()
        elif not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            out[name] = t.clone()
    return out


def tiny_llama_config(**overrides: Any) -> Any:
    """A transformers LLaMA config small enough for a test (built locally, never downloaded)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaConfig(**{**fields, **overrides})


def heavy_modules_after(cli_lines: str) -> subprocess.CompletedProcess:
    """Run ``cli_lines`` (Python calling ``node.entry.main``) in a fresh interpreter, then
    print which of torch and numba it imported: what a command costs a user at start-up
    (this interpreter has imported them all)."""
    snippet = (
        "import sys\n"
        "from node.entry import main\n"
        f"{cli_lines}\n"
        "print([m for m in ('torch', 'numba') if m in sys.modules])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, check=True
    )
