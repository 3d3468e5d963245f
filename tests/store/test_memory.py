"""What a rollout gives back while it applies: a mapped pack's pages, the heap's free pages."""

from __future__ import annotations

import mmap
import platform
import random
from pathlib import Path

import pytest
import torch

from p2p_sync.memory import _malloc_trim, release_pages, trim_heap
from p2p_sync.store import Store
from p2p_sync.store.restore import apply_frames, held_patch
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.weights.statehash import StateDigest
from tests import store_writer
from tests.helpers import bit_equal, clone_set

SMAPS = Path("/proc/self/smaps")
KEY = SigningKey.generate()
SWARM = SwarmPolicy("memory", (KEY.public,)).swarm_id
# what may stay mapped past a release: a read fault maps cached pages around it (fault-around,
# large folios), some of them let go before
LEFT_MAPPED_KB = 2048
linux_only = pytest.mark.skipif(not SMAPS.exists(), reason="reads /proc/self/smaps")


def mapped_rss_kb(path: Path) -> int:
    """This process's resident kB of its maps of ``path`` (every map of it, summed)."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a map's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def mapped(path: Path) -> memoryview:
    with open(path, "rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


@linux_only
def test_released_pages_leave_the_process_and_read_back_the_same(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(1 << 20)
    path = tmp_path / "pack"
    path.write_bytes(data)
    view = mapped(path)
    assert bytes(view) == data and mapped_rss_kb(path) > 0
    release_pages(view, 5000, 300_000)  # widened to whole pages: those in between go
    assert 0 < mapped_rss_kb(path) <= 1024 - 290
    release_pages(view)
    assert mapped_rss_kb(path) == 0
    assert bytes(view) == data  # read again from the page cache


@linux_only
def test_release_leaves_bytes_and_slices_of_a_map_alone(tmp_path: Path) -> None:
    path = tmp_path / "pack"
    path.write_bytes(bytes(1 << 16))
    view = mapped(path)
    assert bytes(view[:4096]) == bytes(4096)
    release_pages(view[:8192])  # a slice's offsets are not the map's: nothing happens
    assert mapped_rss_kb(path) > 0
    release_pages(memoryview(b"not a map"))


def scrambled(weights: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    """``weights`` with about ``share`` of each tensor's elements given other low bits: a
    patch that hardly compresses, some MB from a few tensors."""
    new = clone_set(weights)
    g = torch.Generator().manual_seed(3)
    for t in new.values():
        bits = t.view(torch.int16).reshape(-1)
        moved = torch.rand(bits.numel(), generator=g) < share
        bits[moved] ^= torch.randint(1, 1 << 14, (int(moved.sum()),), generator=g, dtype=bits.dtype)
    return new


@linux_only
def test_a_pack_read_from_its_map_leaves_few_pages_mapped(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    payload = random.Random(4).randbytes(8 << 20)
    m = store_writer.put_version(store, KEY, SWARM, 0, payload)
    reopened = Store.open(tmp_path)  # no own payload in memory: the pack is mapped
    view = reopened.payload(m)
    assert view is not None and isinstance(view.obj, mmap.mmap)
    assert mapped_rss_kb(reopened.pack_path(m.digest)) <= LEFT_MAPPED_KB  # hashed, let go
    assert bytes(view) == payload


@linux_only
def test_a_patch_applies_from_its_mapped_pack_leaving_few_pages_mapped(tmp_path: Path) -> None:
    """The pack is re-hashed, then applied, a slot and a frame at a time: its pages leave the
    process as they are read, and the weights come out bit-exact."""
    g = torch.Generator().manual_seed(2)
    base = {f"w{i}": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(6)}
    new = scrambled(base, 0.5)
    store = Store.open(tmp_path)
    store_writer.publish(store, KEY, SWARM, 0, None, base)
    m = store_writer.publish(store, KEY, SWARM, 1, base, new)
    assert m.payload_size > 3 * LEFT_MAPPED_KB << 10
    reopened = Store.open(tmp_path)
    payload, info = held_patch(reopened, m)
    assert isinstance(payload.obj, mmap.mmap)
    weights = clone_set(base)
    apply_frames(weights, payload, info, StateDigest.of(weights), workers=2)
    assert mapped_rss_kb(reopened.pack_path(m.digest)) <= LEFT_MAPPED_KB
    assert bit_equal(weights, new)


def test_the_heap_is_trimmed_where_glibc_is_the_c_library() -> None:
    if platform.libc_ver()[0] == "glibc":
        assert _malloc_trim() is not None
    trim_heap()
