"""The durable store: content addressing, self-check, eviction, and crash safety under SIGKILL."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_sync.keys import SigningKey
from p2p_sync.manifest import SwarmPolicy, parse
from p2p_sync.store import Store, StoreError, StoreLimits
from tests import store_writer

ROOT = Path(__file__).resolve().parents[1]
KEY = SigningKey.generate()
SWARM = SwarmPolicy("store", (KEY.public,)).swarm_id


def put_version(store: Store, version: int, size: int = 40_000):
    payload = random.Random(version).randbytes(size)
    return store_writer.put_version(store, KEY, SWARM, version, payload), payload


def test_chunks_manifests_and_weights_survive_reopen(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    m, payload = put_version(store, 0)
    store.set_weights(0, "11" * 16, lambda p: p.write_bytes(b"weights-0"))
    store.set_weights(1, "22" * 16, lambda p: p.write_bytes(b"weights-1"))
    again = Store.open(tmp_path)
    assert again.payload(m) == payload and again.manifests() == [m]
    assert again.state is not None and again.state.version == 1
    assert again.state.weights.read_bytes() == b"weights-1"
    assert len(list(again.weights_dir.iterdir())) == 1 and again.dropped == []


def test_self_check_drops_partial_and_corrupt_files(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    m, _ = put_version(store, 0)
    victim = store.chunk_path(m.chunks[1])
    victim.write_bytes(b"bit rot")
    (store.chunk_dir / ".x.tmp").write_bytes(b"half")
    (store.manifest_dir / ("00" * 32 + ".json")).write_bytes(b"{not json")
    again = Store.open(tmp_path)
    assert not victim.exists() and not (store.chunk_dir / ".x.tmp").exists()
    assert len(again.dropped) == 3 and again.manifests() == [m]
    assert again.payload(m) is None  # incomplete now: never served half-verified


def test_a_chunk_corrupted_while_running_is_never_served(tmp_path: Path) -> None:
    cached = Store.open(tmp_path / "a")  # served from the verified in-memory copy
    digest = cached.put_chunk(b"x" * 1000)
    cached.chunk_path(digest).write_bytes(b"y" * 1000)
    assert cached.get_chunk(digest) == b"x" * 1000
    uncached = Store.open(tmp_path / "b", StoreLimits(memory_cache_bytes=0))  # read from disk
    digest = uncached.put_chunk(b"x" * 1000)
    uncached.chunk_path(digest).write_bytes(b"y" * 1000)
    assert uncached.get_chunk(digest) is None and not uncached.has_chunk(digest)


def test_corrupt_weights_are_reported_not_served(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.set_weights(3, "11" * 16, lambda p: p.write_bytes(b"good"))
    assert store.state is not None
    store.state.weights.write_bytes(b"evil")
    with pytest.raises(StoreError, match="corrupt"):
        Store.open(tmp_path)


def test_store_refuses_to_go_back_a_version(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    store.set_weights(5, "11" * 16, lambda p: p.write_bytes(b"v5"))
    with pytest.raises(StoreError, match="older"):
        store.set_weights(4, "22" * 16, lambda p: p.write_bytes(b"v4"))
    assert Store.open(tmp_path).state.version == 5


def test_eviction_keeps_the_newest_anchor_and_its_chain(tmp_path: Path) -> None:
    store = Store.open(tmp_path, StoreLimits(max_chunk_bytes=200_000))
    manifests = [put_version(store, v)[0] for v in range(7)]
    store.put_chunk(b"orphan" * 100)
    dropped = store.evict()
    assert store.chunk_bytes() <= 200_000 and dropped
    for m in manifests[5:]:  # anchor v5 and its chain v6 stay complete
        assert store.has_payload(m)
    assert not store.has_payload(manifests[0])


def chunk_files_verify(store: Store) -> bool:
    return all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name
               for p in store.chunk_dir.iterdir())  # fmt: skip


def test_store_reopens_consistent_after_sigkill_at_random_points(tmp_path: Path) -> None:
    rnd = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    committed = -1
    for trial in range(60):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.store_writer", str(tmp_path), "--seed", str(trial)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        assert proc.stdout is not None
        for _ in range(rnd.randint(0, 4)):  # let it commit a few versions first
            line = proc.stdout.readline()
            assert line.startswith("committed"), line
            committed = int(line.split()[1])
        spin = rnd.randint(0, 200_000)  # then kill at a random instant mid-write
        while spin:
            spin -= 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        store = Store.open(tmp_path)
        assert all(d.endswith(("partial write", "not the accepted weights")) for d in store.dropped)
        assert chunk_files_verify(store)
        assert not [p for d in (store.root, store.chunk_dir, store.manifest_dir)
                    for p in d.iterdir() if p.name.endswith(".tmp")]  # fmt: skip
        for p in store.manifest_dir.iterdir():
            assert parse(p.read_bytes())[0].digest + ".json" == p.name
        if committed >= 0:  # nothing already accepted is lost
            assert store.state is not None and store.state.version >= committed
            doc = json.loads(store.state_path.read_text())
            assert (
                hashlib.sha256(store.state.weights.read_bytes()).hexdigest()
                == doc["weights_sha256"]
            )
