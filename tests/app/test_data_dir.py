"""A node's data dir: a full disk pauses a rollout and it resumes by itself; one node per dir.

The full disk is real where the test may mount one (a small tmpfs, as root, unmounted in a
finally) and injected everywhere: the store's raw writes (``Packs._pwrite``,
``AcceptedLog._append``, its atomic writes) raise OSError(ENOSPC) as the OS does once the room
left is used up. The nodes are real, on loopback.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from node import cli
from p2p_sync.api import Rollout
from p2p_sync.errors import DataDirInUseError, StoreFullError
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.store import LOCK_NAME, Store, StoreLimits
from p2p_sync.store import datadir as datadir_module
from p2p_sync.store import facade as facade_module
from p2p_sync.store import log as log_module
from p2p_sync.store.log import AcceptedLog
from p2p_sync.store.packs import Packs
from p2p_sync.store.restore import restore
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import PATCH, SwarmPolicy
from p2p_sync.weights.statehash import state_hash
from tests.helpers import rollout_config, stop_follower_pair, trainer_config

ROOT = Path(__file__).resolve().parents[2]


def _tmpfs_mountable() -> bool:
    """Whether this process may mount a tmpfs (root, with the capability to)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory() as where:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where], capture_output=True
        )
        if mounted.returncode != 0:
            return False
        subprocess.run(["umount", where], check=True)
    return True


class TmpfsDisk:
    """A real filesystem that fills up: a 4 MiB tmpfs, filled with a ballast file."""

    def __init__(self, where: Path) -> None:
        self.root = where
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], check=True)
        self.ballast = where / "ballast"

    def fill(self, room: int) -> None:
        """Write the ballast until the disk is full, then give ``room`` bytes back."""
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for _ in range(4 * 16 + 1):  # 4 MiB in 64 KiB blocks: bounded
                try:
                    os.write(fd, b"\0" * 65536)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
            os.ftruncate(fd, os.fstat(fd).st_size - room)
        finally:
            os.close(fd)

    def free(self) -> None:
        self.ballast.unlink()

    def close(self) -> None:
        subprocess.run(["umount", str(self.root)], check=True)


class InjectedDisk:
    """The store's raw writes under ``root`` raise OSError(ENOSPC), as the OS does, once the
    room ``fill`` left is used up (writes elsewhere, the trainer's, are left alone)."""

    def __init__(self, where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = where
        where.mkdir()
        self.room: int | None = None  # None: room enough
        pwrite, append = Packs._pwrite, AcceptedLog._append
        write_bytes, write_with = log_module.atomic_write_bytes, log_module.atomic_write_with

        def with_(path: Any, write: Callable[[Any], None], durable: bool = True) -> None:
            buf = io.BytesIO()
            write(buf)
            self.take(path, len(buf.getvalue()))
            write_with(path, lambda f: f.write(buf.getvalue()), durable)

        def bytes_(path: Any, data: bytes, durable: bool = True) -> None:
            self.take(path, len(data))
            write_bytes(path, data, durable)

        def log(accepted: AcceptedLog, line: bytes) -> None:
            self.take(accepted.path, len(line))
            append(accepted, line)

        def slot(path: Path, offset: int, data: Any) -> None:
            self.take(path, len(data))
            pwrite(path, offset, data)

        monkeypatch.setattr(Packs, "_pwrite", staticmethod(slot))
        monkeypatch.setattr(AcceptedLog, "_append", log)
        for module in (datadir_module, facade_module, log_module):  # every atomic write
            monkeypatch.setattr(module, "atomic_write_bytes", bytes_)
        monkeypatch.setattr(log_module, "atomic_write_with", with_)

    def take(self, path: Any, size: int) -> None:
        if self.room is None or not Path(path).is_relative_to(self.root):
            return
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.room -= size

    def fill(self, room: int) -> None:
        self.room = room

    def free(self) -> None:
        self.room = None

    def close(self) -> None:
        pass


Disk = TmpfsDisk | InjectedDisk
DISKS = ["injected", *(["tmpfs"] if _tmpfs_mountable() else [])]


@pytest.fixture(params=DISKS)
def disk(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made: Disk
    if request.param == "tmpfs":
        made = TmpfsDisk(tmp_path / "disk")
    else:
        made = InjectedDisk(tmp_path / "disk", monkeypatch)
    try:
        yield made
    finally:
        made.close()


async def _until(ready: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait (bounded) until ``ready()``, looking every 20 ms."""
    async with asyncio.timeout(timeout):
        while not ready():
            await asyncio.sleep(0.02)


async def _fill_and_free(tmp_path: Path, disk: Disk, versions: list) -> dict[str, Any]:
    """A trainer and a rollout on loopback. The rollout's disk fills up twice: with no room
    at all while v1 is published (its manifest cannot be kept), then with room for a manifest
    but not for a 16 KiB chunk while v2 is; each time it then has room again, and v3 follows.
    Returns what the rollout went through."""
    key = SigningKey.generate()
    policy = SwarmPolicy("full", (key.public,))
    tcfg = trainer_config(tmp_path, p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    trainer.signer = key
    url = await trainer.start()
    limits = StoreLimits(full_retry_s=0.1)
    rcfg = rollout_config(tmp_path, key, url, p2p=False, data_dir=disk.root / "r", store=limits)
    rollout = Node(rcfg, policy, Store.open(rcfg.data_dir, rcfg.store))
    await rollout.start()
    failures: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: failures.append(ctx))
    follower = Follower(rollout)
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    publisher = Publisher(trainer, key, PublishPolicy(chunk_size=16 * 1024), 10)
    out: dict[str, Any] = {}
    try:
        await publisher.publish(versions[0])
        await _until(lambda: follower.state.version == 0)
        disk.fill(room=0)
        m1 = next(m for m in await publisher.publish(versions[1]) if m.kind == PATCH)
        await _until(lambda: rollout.store.refused_writes > 0)  # v1's manifest: refused
        out["v1 heard"] = (rollout.store.has_manifest(m1.digest), follower.state.version)
        disk.free()
        await _until(lambda: follower.state.version == 1)  # learned by the next poll
        disk.fill(room=8192)
        m2 = next(m for m in await publisher.publish(versions[2]) if m.kind == PATCH)
        await _until(lambda: follower.full)  # a chunk of v2 found the disk full: paused
        out["v2 heard"] = (rollout.store.has_manifest(m2.digest), follower.state.version)
        got = rollout.metrics.bytes_downloaded
        disk.free()
        await _until(lambda: follower.state.version == 2)
        out["fetched after"] = rollout.metrics.bytes_downloaded - got
        await publisher.publish(versions[3])
        await _until(lambda: follower.state.version == 3)
        out["alive"] = not task.done()
    finally:
        await stop_follower_pair(stop, task, publisher, rollout, trainer)
        gc.collect()  # a task whose exception nobody retrieved says so when collected
        await asyncio.sleep(0)
    out["failures"] = failures
    return out


def test_a_full_disk_pauses_a_rollout_and_it_resumes_by_itself(
    tmp_path: Path, tiny_versions: list, disk: Disk, caplog: pytest.LogCaptureFixture
) -> None:
    """On a full disk a manifest write's OSError killed the poll loop, so the rollout stayed
    at its version after space returned, through newer versions, until restarted; and a chunk
    write's died inside a task ("Task exception was never retrieved"). Now: one line; what
    could not be kept is learned or fetched again once there is room, and the rollout follows
    on to v3 in the same process."""
    caplog.set_level(logging.INFO)
    out = asyncio.run(_fill_and_free(tmp_path, disk, tiny_versions[:4]))
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1 and full[0].levelno == logging.ERROR, [r.getMessage() for r in full]
    assert str(disk.root / "r") in full[0].getMessage()
    assert out["v1 heard"] == (False, 0)  # no room for its manifest
    assert out["v2 heard"] == (True, 1)  # its manifest fit, its chunks did not
    assert out["fetched after"] > 0 and out["alive"]  # re-fetched, no restart
    assert any("room again" in r.getMessage() for r in caplog.records)
    assert out["failures"] == []  # no "Task exception was never retrieved"
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


async def _publish_on_a_full_disk(tmp_path: Path, disk: Disk, versions: list) -> dict[str, Any]:
    """A trainer publishes v0 (its anchor) and v1 (a patch), each first on a full disk, then
    again once there is room, and stops on a full disk; what its data dir held each time."""
    key = SigningKey.generate()
    cfg = trainer_config(tmp_path, p2p=False, data_dir=disk.root / "t")
    trainer = TrainerNode(cfg, SwarmPolicy("full", (key.public,)), Store.open(cfg.data_dir))
    publisher = Publisher(trainer, key, PublishPolicy(chunk_size=16 * 1024), 10)

    def files() -> list[str]:
        return sorted(
            str(p.relative_to(cfg.data_dir)) for p in cfg.data_dir.rglob("*") if p.is_file()
        )

    out: dict[str, Any] = {"empty": files()}
    try:
        for version, tensors in enumerate(versions):
            disk.fill(room=0)
            with pytest.raises(StoreFullError):
                await publisher.publish(tensors)
            out[f"refused v{version}"] = files()
            disk.free()
            await publisher.publish(tensors)
            out[f"published v{version}"] = files()
    finally:
        disk.fill(room=0)  # a clean stop on a full disk: its checkpoint is refused, not fatal
        await publisher.aclose()
        disk.free()
    out["stopped"] = files()
    restored = restore(Store.open(cfg.data_dir))
    assert restored is not None
    out["restored"] = (restored.state.version, state_hash(restored.weights).hex())
    return out


def test_a_full_disk_refuses_a_publish_whole_and_the_next_try_publishes(
    tmp_path: Path, tiny_versions: list, disk: Disk, caplog: pytest.LogCaptureFixture
) -> None:
    """A publish that finds the disk full raises StoreFullError (one log line) and leaves
    nothing behind, not the anchor's file of a model's size nor a pack without its manifest
    (the disk stayed full until a restart dropped them), and the trainer's weights stay at the
    published version: the same call once there is room publishes it."""
    caplog.set_level(logging.INFO)
    out = asyncio.run(_publish_on_a_full_disk(tmp_path, disk, tiny_versions[:2]))
    assert out["refused v0"] == out["empty"] == ["format.json"]
    assert out["refused v1"] == out["published v0"]
    assert out["stopped"] == out["published v1"]  # no checkpoint: the log rebuilds v1
    assert out["restored"] == (1, state_hash(tiny_versions[1]).hex())
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1, [r.getMessage() for r in full]  # at most once a minute


async def _log_record_on_a_full_disk(tmp_path: Path, versions: list, disk: InjectedDisk):
    """A rollout (not started: no network) holding v0 applies v1 while the disk has room for
    the patch but not for its log record, then again with room."""
    key = SigningKey.generate()
    policy = SwarmPolicy("full", (key.public,))
    tcfg = trainer_config(tmp_path, p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    publisher = Publisher(trainer, key, PublishPolicy(chunk_size=16 * 1024), 10)
    m0, m1 = [(await publisher.publish(t))[0] for t in versions]
    await publisher.aclose()
    rcfg = rollout_config(tmp_path, key, "http://127.0.0.1:9", p2p=False, data_dir=disk.root)
    rollout = Node(rcfg, policy, Store.open(rcfg.data_dir))
    for m in (m0, m1):  # as fetched
        rollout.store.put_payload(m, bytes(trainer.store.payload(m) or b""))
        rollout.store.put_manifest(m, trainer.store.manifest_bytes(m.digest) or b"")
    rollout.store.record(0, m0.target_state, m0.digest)
    follower = Follower(rollout)
    disk.fill(room=64)  # a log line is ~150 bytes
    with pytest.raises(StoreFullError):
        await follower._advance(m1, 0.0)
    refused = (rollout.store.state, state_hash(follower.weights).hex())
    disk.free()
    await follower._advance(m1, 0.0)
    return m0, m1, refused, (rollout.store.state, state_hash(follower.weights).hex())


def test_a_version_applied_but_not_logged_goes_back_to_the_logged_state(
    tmp_path: Path, tiny_versions: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights are changed in place before the version is logged: when the log record
    finds the disk full, the weights are rebuilt to the logged version (what a restart would
    hold), never left a version ahead of the log; once there is room the same version lands."""
    disk = InjectedDisk(tmp_path / "disk", monkeypatch)
    m0, m1, refused, landed = asyncio.run(
        _log_record_on_a_full_disk(tmp_path, tiny_versions[:2], disk)
    )
    (state, weights), (state_after, weights_after) = refused, landed
    assert state.version == 0 and weights == m0.target_state
    assert state_after.version == 1 and weights_after == m1.target_state


# ---------------------------------------------------------------- one node per data dir


def _holder(data_dir: Path) -> subprocess.Popen[str]:
    """Another process holding ``data_dir`` as a node does (its store opened exclusive)."""
    code = (
        "import sys; from p2p_sync.store import Store; "
        "s = Store.open(sys.argv[1], exclusive=True); print('locked', flush=True); "
        "sys.stdin.read()"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(data_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def test_a_second_node_on_a_held_data_dir_exits_2_naming_the_dir_and_the_holders_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer and a rollout started in one directory both used ./p2psync-data: the same
    libp2p peer id, one log written by two. Now the dir is locked while a node runs: a second
    `p2psync node` exits 2 with one line naming the dir and the pid holding it, and the lock
    goes with the holder, however it ends (here SIGKILL)."""
    data_dir = tmp_path / "data"
    holder = _holder(data_dir)
    try:
        rc = cli.main(
            ["node", "--role", "rollout", "--data-dir", str(data_dir), "--no-p2p",
             "--trust", SigningKey.generate().public.text()]
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait(timeout=30)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert str(data_dir) in err and f"pid {holder.pid}" in err and err.startswith("p2psync: error")
    mine = Store.open(data_dir, exclusive=True)  # the OS dropped the dead holder's lock
    assert (data_dir / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    mine.close()
    Store.open(data_dir, exclusive=True).close()  # and close() drops ours


def test_the_python_api_locks_its_data_dir_too(tmp_path: Path) -> None:
    """``p2p_sync.Rollout`` (and ``Trainer``: the same start) holds its data dir while open and
    gives it back when closed; a second node there is refused before it starts."""
    trust = [SigningKey.generate().public.text()]
    held = Store.open(tmp_path, exclusive=True)
    try:
        with pytest.raises(DataDirInUseError, match=f"pid {os.getpid()}"):
            Rollout(trust=trust, data_dir=tmp_path, report=False).open()
    finally:
        held.close()
    with Rollout(trust=trust, data_dir=tmp_path, report=False):
        with pytest.raises(DataDirInUseError, match=str(tmp_path)):
            Store.open(tmp_path, exclusive=True)
    Store.open(tmp_path, exclusive=True).close()  # closed: free again
