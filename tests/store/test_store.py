"""The durable store: content addressing, self-check, eviction, and crash safety under SIGKILL."""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.protocol.versions import Artifact, PeerState, PublishPolicy, plan, to_publish
from p2p_sync.store import (
    AcceptedState,
    HaveMark,
    Store,
    StoreError,
    StoreFormatError,
    StoreLimits,
)
from p2p_sync.store.packs import Packs
from p2p_sync.store.restore import restore
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import PATCH, SNAPSHOT, Manifest, SwarmPolicy, parse, sign
from p2p_sync.weights.statehash import state_hash
from tests import store_writer
from tests.helpers import snapshot_manifest

ROOT = Path(__file__).resolve().parents[2]
KEY = SigningKey.generate()
SWARM = SwarmPolicy("store", (KEY.public,)).swarm_id


def put_version(store: Store, version: int, size: int = 40_000):
    payload = random.Random(version).randbytes(size)
    return store_writer.put_version(store, KEY, SWARM, version, payload), payload


def test_checkpoint_and_log_survive_reopen(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    m, payload = put_version(store, 0)
    store.set_checkpoint(0, "11" * 16, lambda f: f.write(b"weights-0"))
    store.record(1, "22" * 16, m.digest)
    again = Store.open(tmp_path)
    assert again.payload(m) == payload and again.manifests() == [m]
    assert again.state == AcceptedState(1, "22" * 16, m.digest)
    assert again.checkpoint is not None and again.checkpoint.weights.read_bytes() == b"weights-0"
    assert len(list(again.weights_dir.iterdir())) == 1 and again.dropped == []
    again.set_checkpoint(1, "22" * 16, lambda f: f.write(b"weights-1"))
    third = Store.open(tmp_path)
    assert third.log == [] and third.state == AcceptedState(1, "22" * 16, None)
    assert [p.read_bytes() for p in third.weights_dir.iterdir()] == [b"weights-1"]


def test_a_torn_log_line_is_dropped_and_the_log_stays_appendable(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    ms = [put_version(store, v)[0] for v in range(3)]
    store.record(0, "00" * 16, ms[0].digest)
    store.record(1, "01" * 16, ms[1].digest)
    with open(store.log_path, "ab") as f:
        f.write(b'{"version": 2, "state_h')  # a crash in the middle of an append
    again = Store.open(tmp_path)
    assert [r.version for r in again.log] == [0, 1]
    again.record(2, "02" * 16, ms[2].digest)
    assert [r.version for r in Store.open(tmp_path).log] == [0, 1, 2]


def rot(store: Store, m, index: int) -> None:
    """Overwrite the start of chunk ``index`` in ``m``'s pack (bit rot, or a torn write)."""
    with open(store.pack_path(m.digest), "r+b") as f:
        f.seek(index * m.chunk_size)
        f.write(b"bit rot")


def test_self_check_drops_partial_and_corrupt_files(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    m, payload = put_version(store, 0)
    rot(store, m, 1)
    (store.pack_dir / ".x.tmp").write_bytes(b"half")
    (store.pack_dir / ("ee" * 32)).write_bytes(b"a pack no manifest names")
    (store.manifest_dir / ("00" * 32 + ".json")).write_bytes(b"{not json")
    again = Store.open(tmp_path)
    assert not (store.pack_dir / ".x.tmp").exists() and not (store.pack_dir / ("ee" * 32)).exists()
    assert len(again.dropped) == 4 and again.manifests() == [m]
    assert not again.has_chunk(m.chunks[1]) and again.has_chunk(m.chunks[0])
    assert again.have_indices(m) == [i for i in range(len(m.chunks)) if i != 1]
    assert again.payload(m) is None  # incomplete now: never served half-verified
    again.put_chunk(payload[m.chunk_size : 2 * m.chunk_size], m.chunks[1])  # fetched again
    assert Store.open(tmp_path).payload(m) == payload


def test_chunks_of_a_download_land_in_a_sparse_pack(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    payload = random.Random(7).randbytes(100_000)
    m = store_writer.manifest(KEY, SWARM, 7, payload)
    store.put_manifest(m, sign(m, [KEY]))
    for i in (5, 0, 3):  # out of order, as a swarm delivers them
        store.put_chunk(payload[i * m.chunk_size : (i + 1) * m.chunk_size])
    again = Store.open(tmp_path)
    assert again.have_indices(m) == [0, 3, 5] and again.dropped == []  # holes are not rot
    for i in range(len(m.chunks)):
        if i not in (0, 3, 5):
            again.put_chunk(payload[i * m.chunk_size : (i + 1) * m.chunk_size], m.chunks[i])
    assert again.payload(m) == payload
    assert store.pack_path(m.digest).read_bytes() == payload  # a complete pack is the payload


def test_a_chunk_repeated_in_a_payload_fills_every_slot(tmp_path: Path) -> None:
    """A payload whose chunks repeat (constant-initialised tensors: norms of ones, padding) is
    complete once each distinct chunk arrived: the pack holds the bytes at every slot, so it
    verifies and maps like any other, and survives a reopen."""
    store = Store.open(tmp_path)
    ones, rnd = b"\x80\x3f" * 8192, random.Random(3)  # bf16 1.0, 16 KiB of it
    payload = rnd.randbytes(16 * 1024) + ones + ones + rnd.randbytes(5000)
    m = store_writer.manifest(KEY, SWARM, 7, payload)
    assert m.chunks[1] == m.chunks[2]
    store.put_manifest(m, sign(m, [KEY]))
    for i in (0, 1, 3):  # index 2 never arrives: its bytes are index 1's
        store.put_chunk(payload[i * m.chunk_size : (i + 1) * m.chunk_size])
    assert store.verify_pack(m) and store.payload(m) == payload
    assert store.pack_path(m.digest).read_bytes() == payload
    again = Store.open(tmp_path)
    assert again.have_indices(m) == [0, 1, 2, 3] and again.verify_pack(m)


def test_a_chunk_no_manifest_names_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no known manifest"):
        Store.open(tmp_path).put_chunk(b"stray" * 100)


def test_a_chunk_corrupted_while_running_is_never_served(tmp_path: Path) -> None:
    cached = Store.open(tmp_path / "a")  # served from the verified in-memory copy
    m, payload = put_version(cached, 0)
    rot(cached, m, 0)
    assert cached.get_chunk(m.chunks[0]) == payload[: m.chunk_size]
    uncached = Store.open(tmp_path / "b", StoreLimits(memory_cache_bytes=0))  # read from disk
    m, payload = relay_version(uncached, 0)
    rot(uncached, m, 0)
    assert uncached.get_chunk(m.chunks[0]) is None and not uncached.has_chunk(m.chunks[0])
    assert uncached.get_chunk(m.chunks[1]) == payload[m.chunk_size : 2 * m.chunk_size]
    assert uncached.payload(m) is None


def relay_version(store: Store, version: int, size: int = 40_000):
    """Store an artifact as a relay does: the manifest, then each chunk as it arrives."""
    payload = random.Random(version).randbytes(size)
    m = store_writer.manifest(KEY, SWARM, version, payload)
    store.put_manifest(m, sign(m, [KEY]))
    for i, c in enumerate(m.chunks):
        store.put_chunk(payload[i * m.chunk_size : (i + 1) * m.chunk_size], c)
    return m, payload


def test_own_payloads_of_the_newest_version_are_served_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's head patch is what every peer fetches first: served from the bytes it
    built even when it is larger than the chunk cache, where an LRU would miss on every chunk
    (each miss evicting a chunk not served yet)."""
    reads: list[int] = []
    read_slot = Packs._read_slot
    monkeypatch.setattr(Packs, "_read_slot", lambda s, *a: reads.append(1) or read_slot(s, *a))
    store = Store.open(tmp_path, StoreLimits(memory_cache_bytes=64 * 1024))
    m0, p0 = put_version(store, 1, size=400_000)  # 25 chunks, four fit the cache
    order = list(range(len(m0.chunks))) * 2
    random.Random(0).shuffle(order)
    for i in order:
        assert store.get_chunk(m0.chunks[i]) == p0[i * m0.chunk_size : (i + 1) * m0.chunk_size]
    assert reads == [] and bytes(store.payload(m0) or b"") == p0
    m1, p1 = put_version(store, 2, size=400_000)  # a newer version: the old one goes to disk
    assert store.get_chunk(m0.chunks[3]) == p0[3 * m0.chunk_size : 4 * m0.chunk_size]
    assert reads == [1]
    assert store.get_chunk(m1.chunks[3]) == p1[3 * m1.chunk_size : 4 * m1.chunk_size]
    assert reads == [1]


def test_store_refuses_to_go_back_a_version(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    m, _ = put_version(store, 0)
    store.record(5, "11" * 16, m.digest)
    with pytest.raises(StoreError, match="older"):
        store.record(4, "22" * 16, m.digest)
    with pytest.raises(StoreError, match="no known manifest"):
        store.record(6, "22" * 16, "ab" * 32)
    assert Store.open(tmp_path).state.version == 5


def test_eviction_keeps_the_newest_anchor_and_its_chain(tmp_path: Path) -> None:
    store = Store.open(tmp_path, StoreLimits(max_gb=200_000 / 1e9))
    manifests = [put_version(store, v)[0] for v in range(7)]
    dropped = store.evict()
    assert store.chunk_bytes() <= 200_000 and dropped
    assert dropped == [m.digest for m in manifests[: len(dropped)]]  # oldest first
    assert not any(store.pack_path(d).exists() for d in dropped)
    for m in manifests[5:]:  # anchor v5 and its chain v6 stay complete
        assert store.has_payload(m)
    assert not store.has_payload(manifests[0])


def test_eviction_forgets_manifests_the_node_is_past_and_holds_nothing_of(
    tmp_path: Path,
) -> None:
    """A rollout hears a few manifests per version it never fetches (catch-ups it did not
    need); once past them, and once their packs are evicted, it forgets them, so its index does
    not grow with the run. What it is not past, what it logged and what it holds stay."""
    store = Store.open(tmp_path, StoreLimits(max_gb=1.0))
    held = [put_version(store, v)[0] for v in range(4)]  # v0-v3 fetched (v0 the anchor)
    heard = {}
    for v in (2, 3, 5):  # announced, never fetched
        m = store_writer.manifest(KEY, SWARM, v, random.Random(-v).randbytes(30_000))
        store.put_manifest(m, sign(m, [KEY]))
        heard[v] = m
    store.record(3, "33" * 16, held[3].digest)
    store.record(4, "44" * 16, held[2].digest)  # the head: v4 (the record names any artifact)
    assert store.evict() == []  # within budget: no pack dropped
    kept = {m.digest for m in store.manifests()}
    assert kept == {m.digest for m in held} | {heard[5].digest}
    assert any(d.endswith("past and not held") for d in store.dropped)
    assert {m.digest for m in Store.open(tmp_path).manifests()} == kept  # gone from disk too


@pytest.mark.slow  # started first by `make test`'s parallel pass
def test_store_reopens_consistent_after_sigkill_at_random_points(tmp_path: Path) -> None:
    rnd = random.Random(1234)
    ctx = multiprocessing.get_context("forkserver")  # a clean process, torch imported once
    ctx.set_forkserver_preload(["tests.store_writer"])
    committed = -1
    for trial in range(25):
        ours, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=store_writer.run_to_pipe, args=(str(tmp_path), trial, theirs))
        proc.start()
        theirs.close()
        for _ in range(rnd.randint(0, 4)):  # let it commit a few versions first
            assert ours.poll(60), "the writer committed nothing in 60 s"
            committed = ours.recv()
        spin = rnd.randint(0, 200_000)  # then kill at a random instant mid-write
        while spin:
            spin -= 1
        proc.kill()  # SIGKILL
        proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGKILL
        ours.close()
        store = Store.open(tmp_path)
        allowed = ("partial write", "not the checkpoint", "no manifest names this pack")
        assert all(d.endswith(allowed) for d in store.dropped), store.dropped
        assert all(store.has_payload(m) for m in store.manifests())  # pack first, then manifest
        assert not [
            p
            for d in (store.root, store.pack_dir, store.manifest_dir)
            for p in d.iterdir()
            if p.name.endswith(".tmp")
        ]
        for p in store.manifest_dir.iterdir():
            assert parse(p.read_bytes())[0].digest + ".json" == p.name
        if committed >= 0:  # nothing already accepted is lost, and it rebuilds verified
            head = store.state
            assert head is not None and head.version >= committed
            restored = restore(store)
            assert restored is not None and restored.state == head
            assert state_hash(restored.weights).hex() == head.state_hash


def test_a_data_dir_from_an_older_state_hash_is_refused_untouched(tmp_path: Path) -> None:
    """Hashes made by another definition cannot be checked: refusing the dir with a clear
    message beats dropping every record as corrupt (a trainer would restart at v0)."""
    fresh = Store.open(tmp_path / "new")
    assert json.loads(fresh.format_path.read_bytes()) == {"state_hash": 2}
    Store.open(tmp_path / "new")  # reopens fine
    old = tmp_path / "old"
    old.mkdir()
    (old / "checkpoint.json").write_text('{"version": 3, "state_hash": "00", "weights": "w"}')
    (old / "log.jsonl").write_text('{"version": 4, "state_hash": "11", "manifest": "m"}\n')
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(StoreFormatError, match="state hash format 1.*empty data dir"):
        Store.open(old)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before  # nothing lost
    (old / "format.json").write_text('{"state_hash": 7}')
    with pytest.raises(StoreFormatError, match="format 7"):
        Store.open(old)
    (old / "format.json").write_text("not json")
    with pytest.raises(StoreError, match="format.json: unreadable"):
        Store.open(old)


def test_the_store_stays_consistent_under_its_threads(tmp_path: Path) -> None:
    """The event loop stores and serves chunks while worker threads re-verify packs and read
    payloads and the libp2p thread asks for manifests: the lock keeps every index whole."""
    import threading

    from p2p_sync.trust.chunks import manifest_for

    store = Store.open(tmp_path, StoreLimits(memory_cache_bytes=64 * 1024))  # LRU churns
    rng = random.Random(3)
    payloads = [rng.randbytes(40 * 4096) for _ in range(6)]
    ms = [
        manifest_for(
            p,
            swarm="t",
            version=v,
            kind="snapshot",
            target_state="aa" * 16,
            layout="bb" * 16,
            now=1,
            chunk_size=4096,
        )
        for v, p in enumerate(payloads)
    ]
    for m in ms:
        store.put_manifest(m, b"{}")
    errors: list[BaseException] = []

    def worker(job) -> None:
        try:
            for n in range(1000):
                job(n)
        except BaseException as exc:  # reported below, with the failing thread's traceback
            errors.append(exc)

    def put(n: int) -> None:
        m, p = ms[n % 6], payloads[n % 6]
        i = (n * 7) % 40
        store.put_chunk(p[i * 4096 : (i + 1) * 4096], m.chunks[i])

    def get(n: int) -> None:
        m, p = ms[n % 6], payloads[n % 6]
        i = (n * 11) % 40
        data = store.get_chunk(m.chunks[i])
        assert data is None or data == p[i * 4096 : (i + 1) * 4096]

    def verify(n: int) -> None:
        store.verify_pack(ms[n % 6])
        store.have_indices(ms[(n + 1) % 6])

    def read(n: int) -> None:
        view = store.payload(ms[n % 6])
        assert view is None or bytes(view) == payloads[n % 6]
        assert store.has_manifest(ms[n % 6].digest) and store.chunk_bytes() >= 0

    threads = [threading.Thread(target=worker, args=(j,)) for j in (put, get, verify, read)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: races show up within a few hundred ops
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for m, p in zip(ms, payloads):  # fill in what the writer skipped, then check it all
        for i in range(40):
            store.put_chunk(p[i * 4096 : (i + 1) * 4096], m.chunks[i])
        assert store.verify_pack(m) and bytes(store.payload(m)) == p


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6), min_size=1, max_size=3),
    st.sets(st.integers(0, 7)),
)
def test_have_indices_lists_every_chunk_held_in_any_pack(
    layouts: list[list[int]], stored: set[int]
) -> None:
    """Manifests that share chunks (``layouts``: which of 8 distinct chunks each one names,
    repeats allowed), some of those chunks stored: each manifest's listing is exactly its
    indices whose chunk the store holds, whichever pack it went to."""
    import tempfile

    from tests.helpers import snapshot_manifest

    blocks = [bytes([b]) * 16 * 1024 for b in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(Path(tmp))
        ms = []
        for n, layout in enumerate(layouts):
            m = replace(snapshot_manifest(b"".join(blocks[b] for b in layout)), version=n)
            store.put_manifest(m, b"{}")
            ms.append((m, layout))
        for b in sorted(stored):
            if any(b in layout for _, layout in ms):
                store.put_chunk(blocks[b])
        for m, layout in ms:
            assert store.have_indices(m) == [i for i, b in enumerate(layout) if b in stored]


def _twins() -> tuple[list[bytes], Manifest, list[bytes], Manifest]:
    """Version 0 of 8 chunks (2 and 5 alike) and version 1 sharing its first four."""
    one = [bytes([i]) * 16 * 1024 for i in (0, 1, 2, 3, 4, 2, 6, 7)]
    two = one[:4] + [bytes([i]) * 16 * 1024 for i in (10, 11, 12, 13)]
    m1 = snapshot_manifest(b"".join(one))
    m2 = manifest_for(
        b"".join(two),
        swarm="t",
        version=1,
        kind=SNAPSHOT,
        target_state="11" * 16,
        layout="00" * 16,
        now=m1.created,
        chunk_size=16 * 1024,
    )
    return one, m1, two, m2


OPS = st.lists(
    st.tuples(st.sampled_from(["put1", "put2", "rot", "twin"]), st.integers(0, 7)), max_size=40
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_a_have_map_grown_by_arrivals_is_the_whole_listing(ops: list[tuple[str, int]]) -> None:
    """``held_since`` against ``have_indices`` under chunks landing (in either of two
    manifests that share chunks, one chunk twice in a manifest), a slot rotting on disk and a
    second manifest arriving: a map kept by adding what ``held_since`` answers always lists
    exactly the held chunks, once each, and after a chunk merely landed the answer is the
    growth, not a whole listing."""
    one, m1, two, m2 = _twins()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(tmp)
        store.put_manifest(m1, sign(m1, [KEY]))
        kept: dict[str, tuple[HaveMark | None, list[int]]] = {}
        for op, i in ops:
            known = [m1] if store.manifest(m2.digest) is None else [m1, m2]
            if op == "put1" or (op == "put2" and m2 in known):
                store.put_chunk((one if op == "put1" else two)[i])
            elif (
                op == "rot" and i in store.have_indices(m1) and store.pack_path(m1.digest).exists()
            ):
                rot(store, m1, i)
                store.verify_pack(m1)
            elif op == "twin":
                store.put_manifest(m2, sign(m2, [KEY]))
            for m in [m1] if store.manifest(m2.digest) is None else [m1, m2]:
                mark, held = kept.get(m.digest, (None, []))
                new, got = store.held_since(m, mark)
                held = got if new.whole else held + got
                assert sorted(held) == store.have_indices(m) and len(set(held)) == len(held)
                if op.startswith("put") and mark is not None and m in known:
                    assert not new.whole, (op, i)
                kept[m.digest] = (new, held)


# ---------------------------------------------------------------- bounded by versions and files
# A store driven through many tiny versions as a trainer and as a rollout drive theirs (no
# network): what it keeps must stop growing with the version count, and what it keeps must
# still serve replay, peers catching up and newcomers.


def _state(version: int) -> str:
    return f"{version:032x}"


def _artifact(version: int, kind: str, base: int | None) -> tuple[Manifest, bytes]:
    """A signed artifact of ``version`` chaining on ``_state`` (anchor 64 KiB, 1-step patch
    4 KiB, catch-up span 8 KiB: a tiny model)."""
    size = 64 * 1024 if kind == SNAPSHOT else 4096 if base == version - 1 else 8192
    payload = random.Random(f"{version}-{kind}-{base}").randbytes(size)
    extra = {} if base is None else {"base_version": base, "base_state": _state(base)}
    m = manifest_for(
        payload,
        swarm=SWARM,
        version=version,
        kind=kind,
        target_state=_state(version),
        layout="cc" * 16,
        now=0,
        chunk_size=16 * 1024,
        **extra,
    )
    return m, payload


def _published(version: int, policy: PublishPolicy) -> list[tuple[Manifest, bytes]]:
    """What the trainer publishes at ``version``, the head's artifact first."""
    arts = [_artifact(version, k, b) for k, b in to_publish(version, policy)]
    return sorted(arts, key=lambda a: not (version == 0 or a[0].base_version == version - 1))


def trainer_versions(store: Store, n: int, policy: PublishPolicy) -> Iterator[int]:
    """As ``p2p_sync.runtime.trainer`` stores versions: the head's artifact, its log record,
    eviction;
    then behind the head its catch-up spans and anchor, or a due checkpoint."""
    for v in range(n):
        (head, payload), *behind = _published(v, policy)
        store.put_payload(head, payload)
        store.put_manifest(head, sign(head, [KEY]))
        store.record(v, _state(v), head.digest)
        store.evict()
        for m, p in behind:
            store.put_payload(m, p)
            store.put_manifest(m, sign(m, [KEY]))
        anchor = any(m.kind == SNAPSHOT for m, _ in behind)
        if not anchor and store.checkpoint_due(10):
            store.set_checkpoint(v, _state(v), lambda f: f.write(b"w" * 1000))
        yield v


def rollout_versions(store: Store, n: int, policy: PublishPolicy) -> Iterator[int]:
    """As ``p2p_sync.runtime.rollout`` follows: it hears every artifact, fetches the head's, logs
    it,
    checkpoints every 10 versions and evicts."""
    for v in range(n):
        (head, payload), *behind = _published(v, policy)
        for m, _ in [(head, payload), *behind]:
            store.put_manifest(m, sign(m, [KEY]))
        for i, c in enumerate(head.chunks):
            store.put_chunk(payload[i * head.chunk_size : (i + 1) * head.chunk_size], c)
        store.record(v, _state(v), head.digest)
        if store.checkpoint_due(10):
            store.set_checkpoint(v, _state(v), lambda f: f.write(b"w" * 1000))
        store.evict()
        yield v


def disk_usage(root: Path) -> tuple[int, int]:
    """Files and bytes under ``root``."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


@pytest.mark.parametrize("drive", [trainer_versions, rollout_versions])
def test_a_store_stops_growing_with_the_version_count(drive, tmp_path: Path) -> None:
    """Below ``max_gb`` nothing was evicted, and a trainer's log (its anchors are its
    checkpoints) named, and so protected, every version it ever published: 200 tiny versions
    grew a trainer's data dir by 2.8 files and 14 kB a version, a rollout's by 2 files and
    5 kB. With the default limits both are now periodic once past ``max_versions`` (32): the
    same files and bytes one period (anchors and spans every 4 and 8 versions) apart."""
    policy = PublishPolicy(anchor_every=4, catchup_spans=(4, 8))
    store = Store.open(tmp_path)
    usage = {v: disk_usage(tmp_path) for v in drive(store, 64, policy) if v in (55, 63)}
    (files_55, bytes_55), (files_63, bytes_63) = usage[55], usage[63]
    assert files_63 == files_55, (files_55, files_63)
    assert abs(bytes_63 - bytes_55) < 2000, (bytes_55, bytes_63)  # a few log lines
    assert len(store.log) <= 11  # from the replay base (an anchor, or the checkpoint) on


def _plan_held(store: Store, start: PeerState) -> list[Manifest]:
    """A catch-up plan from ``start`` to the head over the artifacts ``store`` holds."""
    held = [m for m in store.manifests() if store.has_payload(m)]
    by_digest = {m.digest: m for m in held}
    arts = [Artifact(m.version, m.kind, m.base_version, m.base_state, m.target_state,
                     m.payload_size, m.digest) for m in held]  # fmt: skip
    return [by_digest[a.ident] for a in plan(start, arts)]


@pytest.mark.parametrize("max_files", [1024, 30])
def test_a_store_keeps_within_its_bounds_what_replay_catch_up_and_newcomers_need(
    tmp_path: Path, max_files: int
) -> None:
    """A trainer's store through 60 versions (anchors every 10, spans of 4 and 16) with
    ``max_versions`` 12 (and ``max_files`` 30, which then binds first): after every eviction
    its manifests and packs are within both bounds, or are all what it needs (bounded by the
    anchor interval, not by the run), and what it keeps still rebuilds its head, gives a
    newcomer a path from the newest anchor, and gives a peer up to ``max_versions`` + 1
    versions behind a path of patches (further behind: the anchor)."""
    policy, limits = PublishPolicy(), StoreLimits(max_versions=12, max_files=max_files)
    store = Store.open(tmp_path, limits)
    for v in trainer_versions(store, 60, policy):
        store.evict()  # as the next version's publish does: the bounds hold after each
        needed = len(store.protected())
        files = store.manifest_count() + len(list(store.pack_dir.iterdir()))
        assert files <= max(max_files, 2 * needed) and needed <= 2 * 10, (v, files, needed)
        oldest = min(m.version for m in store.manifests())
        assert v - oldest <= max(limits.max_versions, 10), (v, oldest)  # 10: an anchor's
    base, chain = store.replay_chain()
    assert isinstance(base, Manifest) and base.kind == SNAPSHOT and base.version == 50
    assert [m.version for m in chain] == list(range(51, 60))
    assert all(store.has_payload(m) for m in (base, *chain))
    assert _plan_held(store, PeerState())[0].digest == base.digest  # a newcomer: the anchor
    reach = limits.max_versions + 1 if max_files > 100 else 9  # 30 files: the anchor's chain
    for behind in range(1, reach + 1):
        path = _plan_held(store, PeerState(59 - behind, _state(59 - behind)))
        assert all(m.kind == PATCH for m in path) and path[-1].version == 59, behind
    again = Store.open(tmp_path, limits)  # the cut log and the evicted files reopen clean
    assert again.state == store.state and again.log == store.log
    assert not [d for d in again.dropped if d.startswith("log")]
    assert {m.digest for m in again.manifests()} == {m.digest for m in store.manifests()}


def test_real_weights_replay_after_eviction_and_log_cuts(tmp_path: Path) -> None:
    """Real patches and anchors (every 5th version logged as a snapshot, as a rollout that
    fetched it), evicted at every version with ``max_versions`` 2: the log is cut at each
    anchor that becomes the replay base, and the head still rebuilds bit for bit."""
    store = Store.open(tmp_path, StoreLimits(max_versions=2))
    rnd, prev = random.Random(5), None
    for version in range(23):
        new = store_writer._next(prev, rnd) if prev is not None else store_writer._initial()
        m = store_writer.publish(store, KEY, SWARM, version, prev, new)
        store.record(version, m.target_state, m.digest)
        store.evict()
        prev = new
    assert [r.version for r in store.log] == [20, 21, 22] and store.manifest_count() <= 6
    restored = restore(Store.open(tmp_path, StoreLimits(max_versions=2)))
    assert restored is not None and restored.state == store.state
    assert state_hash(restored.weights).hex() == state_hash(prev).hex()
