"""The store's head written one tensor at a time (what a sharded trainer's rank 0 writes its
anchors and checkpoints with, holding no copy of the model): the same bytes as writing the
whole weights, from a snapshot or a checkpoint base, and refused when it is not the head."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from p2p_sync.errors import PatchError, TargetMismatchError
from p2p_sync.store import Store
from p2p_sync.store.streamed import write_head
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.weights_io import write_to
from tests import store_writer

KEY = SigningKey.generate()
SWARM = SwarmPolicy("streamed", (KEY.public,)).swarm_id


def _published(root: Path, last: int) -> tuple[Store, list]:
    """v0 (a snapshot) and patches up to ``last``, recorded as a trainer records them."""
    store, rnd = Store.open(root), random.Random(3)
    versions = [store_writer._initial()]
    for v in range(last + 1):
        if v:
            versions.append(store_writer._next(versions[-1], rnd))
        prev = versions[v - 1] if v else None
        m = store_writer.publish(store, KEY, SWARM, v, prev, versions[v])
        store.record(v, m.target_state, m.digest)
    return store, versions


def _bytes(weights: dict) -> bytes:
    out = io.BytesIO()
    write_to(out, weights)
    return out.getvalue()


@pytest.mark.parametrize("base", ["snapshot", "checkpoint"])
def test_the_head_streamed_is_the_head_written_whole(tmp_path: Path, base: str) -> None:
    store, versions = _published(tmp_path, 3)
    if base == "checkpoint":  # the replay base becomes v1's checkpoint: patches 2 and 3 follow
        store.set_checkpoint(1, store.log[1].state_hash, lambda f: write_to(f, versions[1]))
    out = io.BytesIO()
    write_head(store, out, 3)
    assert out.getvalue() == _bytes(versions[3])


def test_a_version_that_is_not_the_head_is_refused(tmp_path: Path) -> None:
    store, _ = _published(tmp_path, 2)
    with pytest.raises(PatchError, match="head is v2, not v1"):
        write_head(store, io.BytesIO(), 1)


def test_a_base_that_does_not_lead_to_the_head_is_refused(tmp_path: Path) -> None:
    store, versions = _published(tmp_path, 2)
    wrong = {k: v.clone() for k, v in versions[1].items()}
    next(iter(wrong.values())).view(-1)[0] += 1  # one element off in the checkpoint's file
    store.set_checkpoint(1, store.log[1].state_hash, lambda f: write_to(f, wrong))
    with pytest.raises(TargetMismatchError, match="v2 rebuilt from the store"):
        write_head(store, io.BytesIO(), 2)


def _step_publisher(root: Path):  # type: ignore[no-untyped-def]
    from p2p_sync.protocol.versions import PublishPolicy
    from p2p_sync.runtime.config import NodeConfig
    from p2p_sync.runtime.sharded import StepPublisher
    from p2p_sync.runtime.trainer import TrainerNode

    cfg = NodeConfig(role="trainer", data_dir=root, key=root / "k", p2p=False)
    node = TrainerNode(cfg, SwarmPolicy("streamed", (KEY.public,)), Store.open(root))
    return StepPublisher(node, KEY, PublishPolicy(patch_format=1))


def test_a_sharded_publisher_in_format_1_starts_from_the_head_without_a_copy(
    tmp_path: Path,
) -> None:
    _, versions = _published(tmp_path, 3)
    publisher = _step_publisher(tmp_path)
    assert publisher.prev is None and publisher.digest is not None
    assert publisher.digest.hash() == state_hash(versions[3]) == publisher.prev_hash


def test_a_head_it_cannot_read_is_rebuilt_as_any_publisher_rebuilds_it(tmp_path: Path) -> None:
    """v3's payload is gone: the store is repaired by ``restore`` (the log cut before v3), and
    the publisher starts from v2, still holding no copy of the model."""
    store, versions = _published(tmp_path, 3)
    v3 = next(m for m in store.manifests() if m.version == 3)
    store.pack_path(v3.digest).unlink()
    publisher = _step_publisher(tmp_path)
    assert publisher.prev is None and publisher.prev_hash == state_hash(versions[2])
    assert publisher.next_version == 3
