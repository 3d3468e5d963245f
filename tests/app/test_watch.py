"""``--watch``: a file that cannot be published costs one log line and is moved aside; the
trainer keeps serving, publishes the next good file, and a restart does not trip on it."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import torch

from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.runtime.watchdir import REJECTED, Listed, aside, to_try, watch
from p2p_sync.store import Store
from p2p_sync.trust.keys import SigningKey, write_keypair
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.weights.weights_io import WeightsFileError, load_weights, save_weights
from tests.helpers import bit_equal, rollout_config, trainer_config

DEADLINE_S = 30.0


def test_files_are_tried_oldest_first_skipping_published_and_refused_ones() -> None:
    w = Path("/w")
    listed = [
        Listed(w / "b.safetensors", 10, 300),
        Listed(w / "a.safetensors", 10, 300),
        Listed(w / "old.safetensors", 10, 100),
        Listed(w / "done.safetensors", 10, 50),
        Listed(w / "bad.safetensors", 7, 200),
        Listed(w / "gone.safetensors", -1, -1),
    ]
    refused = {Listed(w / "bad.safetensors", 7, 200)}
    got = to_try(listed, {"done.safetensors"}, refused)
    assert [p.name for p in got] == [
        "gone.safetensors",  # could not be stat'ed: tried first, and opening it says why
        "old.safetensors",
        "a.safetensors",
        "b.safetensors",
    ]
    # a refused file left in place is tried again once it changes (rewritten, renamed over)
    changed = [Listed(w / "bad.safetensors", 9, 400)]
    assert [p.name for p in to_try(changed, set(), refused)] == ["bad.safetensors"]


def test_a_refused_file_never_takes_the_place_of_an_earlier_one() -> None:
    w = Path("/w")
    taken = {w / REJECTED / "x.safetensors", w / REJECTED / "x.safetensors.1"}
    assert aside(w, "y.safetensors", taken.__contains__) == w / REJECTED / "y.safetensors"
    assert aside(w, "x.safetensors", taken.__contains__) == w / REJECTED / "x.safetensors.2"
    assert aside(w, "x.safetensors", lambda _: True, tries=3).name == "x.safetensors.2"


def _bounded(call: Callable[[], object], timeout: float) -> object:
    """``call()`` in a thread, failing the test if it has not returned after ``timeout``."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return out[0] if out else TimeoutError(f"still blocked after {timeout}s")


def test_what_is_not_a_weights_file_is_refused_by_name_without_blocking(tmp_path: Path) -> None:
    folder, pipe, loop = (tmp_path / f"{n}.safetensors" for n in ("dir", "pipe", "loop"))
    folder.mkdir()
    os.mkfifo(pipe)
    loop.symlink_to(loop)
    got = _bounded(lambda: load_weights(pipe), 5.0)  # a plain open() waits for a writer
    if not isinstance(got, WeightsFileError):  # let a stuck reader go: a writer comes and goes
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert isinstance(got, WeightsFileError) and "not a regular file" in str(got), got
    for path, problem in [
        (folder, "a directory"),
        (loop, "cannot open"),
        (tmp_path / "missing.safetensors", "no such file"),
    ]:
        with pytest.raises(WeightsFileError, match=problem):
            load_weights(path)


def _watch_log(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "p2psync.trainer" and name in r.message
    ]


class _Trainer:
    """A trainer node on loopback, its publisher and its ``watch`` loop, as ``p2psync node
    --role trainer --watch`` runs them; ``stop`` ends all three, as a shutdown does."""

    def __init__(self, tmp_path: Path, key: SigningKey, policy: SwarmPolicy) -> None:
        cfg = trainer_config(tmp_path, listen="127.0.0.1:0", p2p=False)
        self.node = TrainerNode(cfg, policy, Store.open(cfg.data_dir))
        self.key, self.watch_dir = key, tmp_path / "watch"
        self.stop_event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        url = await self.node.start()
        policy = PublishPolicy(anchor_every=100, catchup_spans=(), chunk_size=16 * 1024)
        self.publisher = Publisher(self.node, self.key, policy)
        self.task = asyncio.create_task(
            watch(self.publisher, self.watch_dir, self.stop_event, 0.01)
        )
        return url

    async def status(self) -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{self.node.url}/status") as resp:
                return await resp.json()

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """Wait for ``condition``; fail at once if the watch loop ended (the trainer died)."""
        assert self.task is not None
        async with asyncio.timeout(DEADLINE_S):
            while not condition():
                if self.task.done():
                    self.task.result()  # raises what killed it
                    raise AssertionError(f"the watch loop ended before {what}")
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.stop_event.set()
        assert self.task is not None
        await self.task
        await self.publisher.aclose()
        await self.node.stop()


def _drop(watch_dir: Path, name: str, data: bytes) -> Path:
    """A file renamed into the watch dir, as a trainer job does."""
    tmp = watch_dir.parent / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, watch_dir / name)
    return watch_dir / name


def _version(node: Node) -> int | None:
    return node.store.state.version if node.store.state is not None else None


def _file_bytes(tmp_path: Path, weights: dict[str, torch.Tensor]) -> bytes:
    path = tmp_path / ".weights"
    save_weights(path, weights, durable=False)
    return path.read_bytes()


async def _bad_files_then_good(tmp_path: Path, versions: list, caplog) -> dict:
    key = SigningKey.generate()
    write_keypair(key, tmp_path / "k")
    policy = SwarmPolicy("watch", (key.public,))
    (tmp_path / "watch").mkdir()
    trainer = _Trainer(tmp_path, key, policy)
    url = await trainer.start()
    rollout = Node(
        rollout_config(tmp_path, key, url, p2p=False), policy, Store.open(tmp_path / "r")
    )
    await rollout.start()
    follower, stop = Follower(rollout), asyncio.Event()
    following = asyncio.create_task(follower.run(stop))
    out: dict = {}
    try:
        watch_dir, rejected = trainer.watch_dir, trainer.watch_dir / REJECTED
        _drop(watch_dir, "v0.safetensors", _file_bytes(tmp_path, versions[0]))
        await trainer.until(lambda: follower.state.version == 0, "v0 at the rollout")
        v1 = _file_bytes(tmp_path, versions[1])
        other = {**versions[1], "extra.weight": torch.zeros(3, dtype=torch.bfloat16)}
        _drop(watch_dir, "cut.safetensors", v1[:-1000])  # truncated mid-tensor
        _drop(watch_dir, "other.safetensors", _file_bytes(tmp_path, other))
        gone = {"cut.safetensors", "other.safetensors"}
        await trainer.until(lambda: {p.name for p in rejected.glob("*")} == gone, "refusals")
        out["serving"] = (await trainer.status())["version"]
        out["logged"] = {n: _watch_log(caplog, n) for n in gone}
        _drop(watch_dir, "v1.safetensors", v1)
        await trainer.until(lambda: follower.state.version == 1, "v1 at the rollout")
        out["rollout_v1"] = bit_equal(follower.weights or {}, versions[1])
    finally:
        stop.set()
        await following
        await rollout.stop()
        await trainer.stop()
    # a restart with a bad file in the dir (another dtype than v0): refused, then v2 published
    first = sorted(versions[2])[0]
    wrong = {k: v.float() if k == first else v for k, v in versions[2].items()}
    _drop(trainer.watch_dir, "wrong.safetensors", _file_bytes(tmp_path, wrong))
    again = _Trainer(tmp_path, key, policy)
    await again.start()
    try:
        await again.until(lambda: (rejected / "wrong.safetensors").exists(), "the refusal")
        out["restarted"] = (await again.status())["version"]
        out["logged"]["wrong.safetensors"] = _watch_log(caplog, "wrong.safetensors")
        _drop(again.watch_dir, "v2.safetensors", _file_bytes(tmp_path, versions[2]))
        await again.until(lambda: _version(again.node) == 2, "v2 published")
        out["published"] = (await again.status())["version"]
    finally:
        await again.stop()
    return out


def test_bad_files_in_the_watch_dir_are_moved_aside_and_the_trainer_goes_on(
    tmp_path: Path, tiny_versions: list, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated file and one with an extra tensor: one line each, moved aside, /status
    answers at v0, and the next good file reaches a rollout as v1. Restarted with a file of
    another dtype in the dir: refused the same way, then v2 is published."""
    caplog.set_level(logging.WARNING, logger="p2psync.trainer")
    out = asyncio.run(_bad_files_then_good(tmp_path, tiny_versions, caplog))
    assert out["serving"] == 0 and out["rollout_v1"]
    problems = {
        "cut.safetensors": "do not fit",
        "other.safetensors": "tensor 'extra.weight'",
        "wrong.safetensors": "float32, expected",
    }
    for name, problem in problems.items():
        (line,) = out["logged"][name]  # one line per file, naming it, the problem and the move
        assert problem in line and f"moved to {tmp_path / 'watch' / REJECTED / name}" in line
    assert out["restarted"] == 1 and out["published"] == 2


def test_a_full_disk_while_noting_a_published_file_is_one_line_and_noted_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``watched.txt`` lives in the data dir: a full disk there is the store's one line, the
    name stays remembered in memory, and the next write once there is room holds both."""
    import errno

    import p2p_sync.runtime.watchdir as trainer_mod
    from p2p_sync.runtime.watchdir import Spool

    store = Store.open(tmp_path / "data")
    spool = Spool(tmp_path, store)
    real = trainer_mod.atomic_write_bytes

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer_mod, "atomic_write_bytes", full)
    with caplog.at_level(logging.ERROR):
        spool.done(tmp_path / "v0.safetensors")
    assert "v0.safetensors" in spool.published and not spool.seen_path.exists()
    assert caplog.text.count("is full") == 1 and "Traceback" not in caplog.text
    monkeypatch.setattr(trainer_mod, "atomic_write_bytes", real)
    spool.done(tmp_path / "v1.safetensors")
    assert spool.seen_path.read_text().split("\n") == ["v0.safetensors", "v1.safetensors"]
    store.close()
