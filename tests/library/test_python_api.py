"""The Python API in one process: Publisher.publish after each step, a Follower with a callback
and an --on-update hook, real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from p2p_sync import codec
from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.store import Store, StoreLimits
from p2p_sync.store.restore import restore
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.weights.export import write_export
from p2p_sync.weights.patch import apply
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.threads import BACKGROUND_NICE, usable_cores
from tests.helpers import bit_equal, rollout_config, stop_follower_pair, trainer_config

CHUNK = 16 * 1024  # small chunks: tiny payloads still span several


async def _sync(
    tmp_path: Path,
    versions: list[dict[str, torch.Tensor]],
    limits: StoreLimits = StoreLimits(),
    publish: PublishPolicy = PublishPolicy(anchor_every=100, catchup_spans=(2,), chunk_size=CHUNK),
    checkpoint_every: int = 10,
    workers: int = 0,
) -> dict:
    key = SigningKey.generate()
    policy = SwarmPolicy("api", (key.public,))
    tcfg = trainer_config(tmp_path, directory=PeerLimits(poll_interval_s=0.2), workers=workers)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir, limits))
    url = await trainer.start()
    rcfg = rollout_config(tmp_path, key, url, workers=workers)
    rollout = Node(rcfg, policy, Store.open(rcfg.data_dir, limits))
    await rollout.start()
    seen: list[tuple[int, str]] = []
    applied = asyncio.Event()
    hook_log = tmp_path / "hook.log"

    def callback(version: int, weights: dict[str, torch.Tensor]) -> None:
        seen.append((version, state_hash(weights).hex()))
        applied.set()

    hook = f'echo "$P2PSYNC_VERSION $P2PSYNC_STATE_HASH" >> {hook_log}'
    follower = Follower(
        rollout,
        export=tmp_path / "export",
        callback=callback,
        on_update_cmd=hook,
        checkpoint_every=checkpoint_every,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    publisher = Publisher(trainer, key, publish, checkpoint_every)
    held: list = []  # per store, before the clean shutdown: (logged versions, payloads held)
    try:
        for v, weights in enumerate(versions):
            manifests = await publisher.publish(weights)
            assert {m.version for m in manifests} == {v}
            async with asyncio.timeout(60):
                while not seen or seen[-1][0] != v:
                    applied.clear()
                    await applied.wait()
        for store in (trainer.store, rollout.store):
            held.append(
                (
                    [r.version for r in store.log],
                    {m.version for m in store.manifests() if store.has_payload(m)},
                )
            )
    finally:
        await stop_follower_pair(stop, task, publisher, rollout, trainer)
    return {
        "seen": seen,
        "weights": follower.weights,
        "hook": hook_log.read_text(),
        "export": json.loads((tmp_path / "export" / "version.json").read_text()),
        "stores": (trainer.store, rollout.store),
        "held": held,
    }


def test_publish_and_follow_in_process(tmp_path: Path, tiny_versions: list) -> None:
    versions = tiny_versions[:4]
    out = asyncio.run(_sync(tmp_path, versions))
    assert [v for v, _ in out["seen"]] == [0, 1, 2, 3]
    assert [h for _, h in out["seen"]] == [state_hash(v).hex() for v in versions]
    assert bit_equal(out["weights"], versions[-1])
    assert out["export"] == {"version": 3, "state_hash": state_hash(versions[-1]).hex()}
    assert out["hook"].splitlines() == [
        f"{i} {state_hash(v).hex()}" for i, v in enumerate(versions)
    ]


def test_the_workers_setting_is_each_sides_thread_count(
    tmp_path: Path, tiny_versions: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``workers`` (config, ``--workers``, a keyword of the Python API) is the thread count of
    the trainer's per-tensor diff and coding and of the rollout's apply; 0 means one per
    usable core."""
    import p2p_sync.runtime.rollout as rollout_mod
    import p2p_sync.runtime.trainer as trainer_mod

    used: list[tuple[str, int]] = []
    map_workers, apply_artifact = trainer_mod.map_workers, rollout_mod.apply_artifact

    def spy_map(fn, items, workers):  # noqa: ANN001, ANN202 - the wrapped signature
        used.append(("trainer", workers))
        return map_workers(fn, items, workers)

    def spy_apply(store, m, weights, digest, workers=1, sink=None):  # noqa: ANN001, ANN202
        used.append(("rollout", workers))
        return apply_artifact(store, m, weights, digest, workers, sink)

    monkeypatch.setattr(trainer_mod, "map_workers", spy_map)
    monkeypatch.setattr(rollout_mod, "apply_artifact", spy_apply)
    out = asyncio.run(_sync(tmp_path, tiny_versions[:3], workers=3))
    assert bit_equal(out["weights"], tiny_versions[2])
    assert {side for side, _ in used} == {"trainer", "rollout"}
    assert {w for _, w in used} == {3}
    assert NodeConfig().threads == usable_cores() and NodeConfig(workers=5).threads == 5


def test_status_reports_a_version_only_once_it_is_exported(
    tmp_path: Path, tiny_versions: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log record comes before the export (its fsync would wait behind the export's
    writeback), but ``/status`` must not say ``v`` while the export still holds ``v - 1``."""
    real, seen = Follower._export, []

    async def spy(self: Follower, version: int, state: str) -> bool:
        seen.append((self.node.status()["version"], self.node.store.state.version, version))
        return await real(self, version, state)

    monkeypatch.setattr(Follower, "_export", spy)
    asyncio.run(_sync(tmp_path, tiny_versions[:3]))
    assert [(logged, v) for _, logged, v in seen] == [(0, 0), (1, 1), (2, 2)]
    assert [reported for reported, _, _ in seen] == [None, 0, 1]


def test_a_failed_export_is_logged_and_the_rollout_carries_on(
    tmp_path: Path, tiny_versions: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up while v1 is exported: v1 is applied and logged but not handed off
    (no hook, the engine keeps v0's files); v2 and v3 export and hand off as usual."""
    from p2p_sync.runtime import rollout as rollout_mod

    real = rollout_mod.write_export

    def full_at_v1(directory: Path, weights: dict, info: bytes) -> Path:
        if json.loads(info)["version"] == 1:
            raise OSError(28, "No space left on device")
        return real(directory, weights, info)

    monkeypatch.setattr(rollout_mod, "write_export", full_at_v1)
    versions = tiny_versions[:4]
    out = asyncio.run(_sync(tmp_path, versions))
    assert [v for v, _ in out["seen"]] == [0, 1, 2, 3]  # applied in process all the same
    assert [line.split()[0] for line in out["hook"].splitlines()] == ["0", "2", "3"]
    assert out["export"] == {"version": 3, "state_hash": state_hash(versions[-1]).hex()}


def test_an_export_behind_the_log_is_rewritten_at_start(
    tmp_path: Path, tiny_versions: list
) -> None:
    """A crash after the log record and before the export (the rollout logs first): the
    restarted node finds ``version.json`` behind its state, exports that state again, and
    reports the version only then."""
    versions = tiny_versions[:3]
    asyncio.run(_sync(tmp_path, versions))
    export = tmp_path / "export"
    write_export(export, versions[1])
    stale = {"version": 1, "state_hash": state_hash(versions[1]).hex()}
    (export / "version.json").write_text(json.dumps(stale))

    async def restart() -> tuple:
        key = SigningKey.generate()
        rcfg = rollout_config(tmp_path, key, "http://127.0.0.1:9")
        node = Node(rcfg, SwarmPolicy("api", (key.public,)), Store.open(rcfg.data_dir))
        follower = Follower(node, export=export)
        before = node.handed_off
        await follower._export_if_stale()
        return before, node.handed_off

    before, after = asyncio.run(restart())
    assert before is None and after is not None and after.version == 2
    head = {"version": 2, "state_hash": state_hash(versions[2]).hex()}
    assert json.loads((export / "version.json").read_text()) == head
    assert bit_equal(load_file(export / "model.safetensors"), versions[2])


def test_stores_evict_old_artifacts_but_keep_the_newest_anchor_chain(
    tmp_path: Path, tiny_versions: list
) -> None:
    versions = tiny_versions[:5]
    out = asyncio.run(
        _sync(
            tmp_path,
            versions,
            StoreLimits(max_gb=1e-9),
            PublishPolicy(anchor_every=3, catchup_spans=(2,), chunk_size=CHUNK),
            checkpoint_every=1,
        )
    )
    assert bit_equal(out["weights"], versions[-1])
    for store in out["stores"]:
        kept = {m.version for m in store.manifests() if store.has_payload(m)}
        assert kept and min(kept) == 3  # anchor v3 and what follows it: all a newcomer needs
        assert min(m.version for m in store.manifests()) == 3  # nor manifests before it
        assert not list(store.pack_dir.glob("*")) or all(
            store.pack_path(m.digest).exists() == store.has_payload(m) for m in store.manifests()
        )


def test_eviction_keeps_every_artifact_replay_needs(tmp_path: Path, tiny_versions: list) -> None:
    versions = tiny_versions[:5]
    out = asyncio.run(
        _sync(
            tmp_path,
            versions,
            StoreLimits(max_gb=1e-9),
            PublishPolicy(anchor_every=100, catchup_spans=(), chunk_size=CHUNK),
            checkpoint_every=100,
        )
    )
    for logged, held in out["held"]:  # no checkpoint since v0: the v0 anchor and every patch
        assert logged == [0, 1, 2, 3, 4] and held == {0, 1, 2, 3, 4}


def test_a_restart_replays_the_log_and_writes_weights_only_at_checkpoints(
    tmp_path: Path, tiny_versions: list
) -> None:
    versions = tiny_versions[:6]
    out = asyncio.run(
        _sync(
            tmp_path,
            versions,
            publish=PublishPolicy(anchor_every=100, catchup_spans=(), chunk_size=CHUNK),
            checkpoint_every=2,
        )
    )
    for store in out["stores"]:
        again = Store.open(store.root)
        # clean shutdown checkpointed the head: v5 (checkpoints at v2, v4, then at close)
        assert again.checkpoint is not None and again.checkpoint.version == 5 and not again.log
        assert len(list(again.weights_dir.iterdir())) == 1
        restored = restore(again)
        assert restored is not None and restored.replayed == 0
        assert bit_equal(restored.weights, versions[-1])


async def _checkpoints_behind(tmp_path: Path, versions: list) -> list[tuple[int, int | None]]:
    """(version, the store's checkpoint version) when ``publish`` returned, then once the
    work behind the announcement is done."""
    key = SigningKey.generate()
    cfg = NodeConfig(role="trainer", data_dir=tmp_path, key=tmp_path / "k")
    node = TrainerNode(cfg, SwarmPolicy("api", (key.public,)), Store.open(tmp_path))
    publisher = Publisher(node, key, PublishPolicy(anchor_every=100, catchup_spans=()), 2)
    seen = []
    for v, weights in enumerate(versions):
        await publisher.publish(weights)
        at_announce = node.store.checkpoint
        await publisher.spans_done()
        after = node.store.checkpoint
        seen.append((v, at_announce and at_announce.version, after and after.version))
    await publisher.aclose()
    return seen


def test_the_trainers_checkpoint_is_written_after_the_announcement(
    tmp_path: Path, tiny_versions: list
) -> None:
    """A due checkpoint (every 2nd version past the replay base here) is not on the way to
    the rollouts: when ``publish`` returns the version is announced and the old checkpoint
    is still the store's; the new one lands behind it, before the next publish."""
    seen = asyncio.run(_checkpoints_behind(tmp_path, tiny_versions[:5]))
    assert seen == [(0, None, None), (1, None, None), (2, None, 2), (3, 2, 2), (4, 2, 4)]
    again = Store.open(tmp_path)
    restored = restore(again)
    assert restored is not None and bit_equal(restored.weights, tiny_versions[4])


async def _refresh(tmp_path: Path, weights: dict[str, torch.Tensor]) -> tuple:
    from p2p_sync.trust.manifest import verify

    key = SigningKey.generate()
    policy = SwarmPolicy("api", (key.public,))
    cfg = NodeConfig(role="trainer", data_dir=tmp_path, key=tmp_path / "k")
    node = TrainerNode(cfg, policy, Store.open(tmp_path))
    publisher = Publisher(node, key, PublishPolicy(lifetime_s=1000))
    (anchor,) = await publisher.publish(weights)
    early = publisher.refresh(anchor.created + 100)  # not yet half-way: nothing to do
    renewed = publisher.refresh(anchor.created + 600)
    data = node.store.manifest_bytes(renewed[0].digest)
    assert data is not None
    accepted = verify(data, policy, now=anchor.created + 1500, accepted_version=None)
    return anchor, early, renewed, accepted


def test_trainer_re_signs_manifests_before_they_expire(tmp_path: Path, tiny_versions) -> None:
    anchor, early, renewed, accepted = asyncio.run(_refresh(tmp_path, tiny_versions[0]))
    assert early == [] and len(renewed) == 1
    assert accepted.chunks == anchor.chunks and accepted.expires == anchor.created + 1600
    assert accepted.digest != anchor.digest  # a newcomer after the old expiry can still join


async def _publish_files(tmp_path: Path, versions: list, patch_format: int) -> tuple:
    from p2p_sync.runtime import trainer as trainer_mod
    from p2p_sync.weights.weights_io import WeightsFileError, save_weights

    key = SigningKey.generate()
    cfg = NodeConfig(role="trainer", data_dir=tmp_path / "t", key=tmp_path / "k", p2p=False)
    node = TrainerNode(cfg, SwarmPolicy("files", (key.public,)), Store.open(cfg.data_dir))
    policy = PublishPolicy(anchor_every=100, catchup_spans=(2,), patch_format=patch_format)
    publisher = Publisher(node, key, policy)
    files = []
    for v, weights in enumerate(versions[:3]):
        files.append(tmp_path / f"v{v}.safetensors")
        save_weights(files[-1], weights)
    await publisher.publish_file(files[0])
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(files[1].read_bytes()[:-1000])  # a file cut short mid-tensor
    with pytest.raises(WeightsFileError, match="do not fit"):
        await publisher.publish_file(torn)
    real_read, calls = trainer_mod.pread_into, []

    def failing_read(*args) -> None:  # the disk fails on the third tensor, mid-stream
        calls.append(args)
        if len(calls) == 3:
            raise WeightsFileError("injected read error")
        real_read(*args)

    trainer_mod.pread_into = failing_read
    try:
        with pytest.raises(WeightsFileError, match="injected"):
            await publisher.publish_file(files[1])
    finally:
        trainer_mod.pread_into = real_read
    after_torn = bit_equal(publisher.prev, versions[0])  # rebuilt: nothing half-replaced
    real_merge, nice = trainer_mod.merge_steps, []

    def spy_merge(*args, **kwargs) -> bytes:  # the catch-up runs below the head's priority
        nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_merge(*args, **kwargs)

    trainer_mod.merge_steps = spy_merge
    try:
        manifests = [await publisher.publish_file(f) for f in files[1:]]
        await publisher.spans_done()  # v2's catch-up from v0 follows its announcement
    finally:
        trainer_mod.merge_steps = real_merge
    assert nice == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)]
    return after_torn, manifests, publisher.prev, node.store


@pytest.mark.parametrize("patch_format", [1, 2, 3])
def test_watched_files_publish_streaming_and_a_torn_file_changes_nothing(
    tmp_path: Path, tiny_versions: list, patch_format: int
) -> None:
    """Each tensor is read into a reused buffer and ``prev`` moves in place: in the diff's
    own pass (format 1) or after coding against the old bits (formats 2 and 3)."""
    run = _publish_files(tmp_path, tiny_versions, patch_format)
    after_torn, manifests, prev, store = asyncio.run(run)
    assert after_torn and bit_equal(prev, tiny_versions[2])
    assert [[(m.kind, m.version, m.base_version) for m in ms] for ms in manifests] == [
        [("patch", 1, 0)],
        [("patch", 2, 1)],
    ]
    span = [m for m in store.manifests() if (m.version, m.base_version) == (2, 0)]
    assert len(span) == 1 and store.has_payload(span[0])
    base = {k: v.clone() for k, v in tiny_versions[0].items()}
    payload = store.payload(span[0])
    assert payload is not None
    apply(base, codec.decode(payload))
    assert bit_equal(base, tiny_versions[2])
    restored = restore(Store.open(store.root))  # the published chain rebuilds the last file
    assert restored is not None and bit_equal(restored.weights, tiny_versions[2])


async def _publish_in_memory(tmp_path: Path, versions: list, patch_format: int) -> tuple:
    """v0 handed over with two names on one memory (tied weights), v1 and v2 read only; the
    store fails while v2 is stored, after the diff moved ``prev`` to v2 in place."""
    key = SigningKey.generate()
    cfg = NodeConfig(role="trainer", data_dir=tmp_path / "t", key=tmp_path / "k", p2p=False)
    node = TrainerNode(cfg, SwarmPolicy("mem", (key.public,)), Store.open(cfg.data_dir))
    policy = PublishPolicy(anchor_every=100, catchup_spans=(), patch_format=patch_format)
    publisher = Publisher(node, key, policy)
    tie = next(iter(versions[0]))
    tied = [{**v, "tied.copy": v[tie]} for v in versions[:3]]  # one memory, two names
    handed = {k: v.clone() for k, v in versions[0].items()}  # handed over: moved in place later
    await publisher.publish({**handed, "tied.copy": handed[tie]}, owned=True)
    await publisher.publish({k: v.clone() for k, v in tied[1].items()})
    real_record = node.store.record

    def full_disk(*args) -> None:
        raise OSError(28, "No space left on device")

    node.store.record = full_disk
    with pytest.raises(OSError, match="No space"):
        await publisher.publish(tied[2])
    node.store.record = real_record
    after_failure = bit_equal(publisher.prev, tied[1]) and publisher.prev_hash == state_hash(
        tied[1]
    )
    manifests = await publisher.publish(tied[2])
    return after_failure, manifests, publisher, tied


@pytest.mark.parametrize("patch_format", [1, 2, 3])
def test_an_in_memory_publish_moves_prev_in_its_diff_and_a_failure_moves_it_back(
    tmp_path: Path, tiny_versions: list, patch_format: int
) -> None:
    after_failure, manifests, publisher, tied = asyncio.run(
        _publish_in_memory(tmp_path, tiny_versions, patch_format)
    )
    assert after_failure  # rebuilt from the store: v1, not the half-published v2
    assert bit_equal(publisher.prev, tied[2]) and publisher.prev_hash == state_hash(tied[2])
    weights = {k: v.clone() for k, v in tied[1].items()}
    payload = bytes(publisher.node.store.payload(manifests[0]) or b"")
    assert (codec.read_header(payload).version == 3) == (patch_format == 3)
    patch = codec.decode(payload, base=weights)  # formats 2 and 3 decode against their base
    assert manifests[0].base_version == 1 and "tied.copy" in patch.deltas  # both names change
    apply(weights, patch)  # checks the signed target: the tie did not hide a change
    assert bit_equal(weights, tied[2])


async def _anchor_behind(tmp_path: Path, versions: list) -> tuple:
    """v2 is an anchor version: its head (the 1-step patch) is announced first, the anchor
    follows; then the anchor is corrupted on disk and the store reopened."""
    key = SigningKey.generate()
    cfg = NodeConfig(role="trainer", data_dir=tmp_path / "t", key=tmp_path / "k", p2p=False)
    node = TrainerNode(cfg, SwarmPolicy("anchor", (key.public,)), Store.open(cfg.data_dir))
    policy = PublishPolicy(anchor_every=2, catchup_spans=(), patch_format=1)
    publisher = Publisher(node, key, policy, checkpoint_every=2)
    heads = [await publisher.publish(v) for v in versions[:3]]
    held_back = [m.kind for m in node.store.manifests() if m.version == 2]
    await publisher.spans_done()
    return heads, held_back, node.store


def test_an_anchor_follows_its_head_and_is_the_replay_base_beside_the_log(
    tmp_path: Path, tiny_versions: list
) -> None:
    heads, held_back, store = asyncio.run(_anchor_behind(tmp_path, tiny_versions))
    assert [[m.kind for m in ms] for ms in heads] == [["snapshot"], ["patch"], ["patch"]]
    assert held_back == ["patch"]  # publish() returned before the anchor was built
    anchor = next(m for m in store.manifests() if m.version == 2 and m.kind == "snapshot")
    assert store.log[-1].manifest == heads[2][0].digest  # the patch is what the log records
    base, chain = store.replay_chain()
    assert base == anchor and chain == []  # the anchor saves a full checkpoint write
    assert store.checkpoint is None  # v2 was due one (every 2): the anchor stood in for it
    restored = restore(Store.open(store.root))
    assert restored is not None and bit_equal(restored.weights, tiny_versions[2])
    with open(store.pack_path(anchor.digest), "r+b") as f:  # the anchor rots on disk
        f.seek(anchor.payload_size // 2)
        f.write(b"rot")
    reopened = Store.open(store.root)  # its self-check drops the torn slot: back to v0 + log
    assert reopened.replay_chain() == (heads[0][0], [heads[1][0], heads[2][0]])
    restored = restore(reopened)
    assert restored is not None and bit_equal(restored.weights, tiny_versions[2])


def test_an_anchor_beside_the_log_that_fails_on_load_is_dropped_and_the_log_kept(
    tmp_path: Path, tiny_versions: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2p_sync.errors import TargetMismatchError
    from p2p_sync.store import restore as restore_mod

    _, _, store = asyncio.run(_anchor_behind(tmp_path, tiny_versions))
    anchor = store.replay_chain()[0]

    real_load = restore_mod.load_snapshot

    def wrong_state(store, m, *args):  # v2's chunks verify, its weights do not hash right
        if m == anchor:
            raise TargetMismatchError("snapshot weights hash to something else")
        return real_load(store, m, *args)

    monkeypatch.setattr(restore_mod, "load_snapshot", wrong_state)
    reopened = Store.open(store.root)
    restored = restore(reopened)
    assert restored is not None and bit_equal(restored.weights, tiny_versions[2])
    assert not reopened.has_manifest(anchor.digest)  # dropped, never applied
    assert [r.version for r in reopened.log] == [0, 1, 2]  # whole: v0 and its patches lead there


def test_a_format2_step_is_coded_for_the_history_after_its_announcement(
    tmp_path: Path, tiny_versions: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The format-1 copy that catch-ups merge is not on the head's way to the rollouts: the
    step waits decoded until the announcement, then is coded below the head's priority, to
    the very bytes a direct format-1 encode gives; the v0->v2 catch-up merged from it is
    exact."""
    from p2p_sync.weights.patch import Patch, diff

    real_encode, niced = codec.encode, []

    def spy_encode(patch: Patch, *args, **kwargs) -> bytes:
        if kwargs.get("base") is None:  # a format-1 coding: the history's
            niced.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_encode(patch, *args, **kwargs)

    async def run() -> tuple:
        key = SigningKey.generate()
        cfg = NodeConfig(role="trainer", data_dir=tmp_path / "t", key=tmp_path / "k", p2p=False)
        node = TrainerNode(cfg, SwarmPolicy("hist", (key.public,)), Store.open(cfg.data_dir))
        policy = PublishPolicy(anchor_every=100, catchup_spans=(2,), patch_format=2)
        publisher = Publisher(node, key, policy)
        for weights in tiny_versions[:2]:
            await publisher.publish(weights)
        pending = publisher.history[-1]
        await publisher.spans_done()
        coded = publisher.history[-1]
        await publisher.publish(tiny_versions[2])
        await publisher.spans_done()
        return pending, coded, node.store

    monkeypatch.setattr(codec, "encode", spy_encode)
    pending, coded, store = asyncio.run(run())
    assert isinstance(pending, Patch) and pending.base_hash == state_hash(tiny_versions[0])
    assert coded == real_encode(diff(tiny_versions[0], tiny_versions[1]))
    assert niced and set(niced) == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)}
    span = [m for m in store.manifests() if (m.version, m.base_version) == (2, 0)]
    payload = store.payload(span[0])
    assert payload is not None
    base = {k: v.clone() for k, v in tiny_versions[0].items()}
    apply(base, codec.decode(payload))
    assert bit_equal(base, tiny_versions[2])
