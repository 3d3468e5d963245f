"""Chunking: split, verify by index/length/hash, reassemble only when complete."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p_sync.errors import (
    ChunkHashMismatchError,
    ChunkIndexError,
    ChunkLengthError,
    IncompletePayloadError,
)
from p2p_sync.trust.chunks import (
    AUTO,
    MAX_AUTO_CHUNK,
    MIN_AUTO_CHUNK,
    TARGET_CHUNKS,
    Assembler,
    chunk_size_for,
    file_chunk_hashes,
    manifest_for,
    split,
    verify_chunk,
)
from p2p_sync.trust.manifest import SNAPSHOT


def describe(payload: bytes, chunk_size: int = 16 * 1024):
    return manifest_for(
        payload,
        swarm="00" * 32,
        version=0,
        kind=SNAPSHOT,
        target_state="11" * 16,
        layout="22" * 16,
        now=0,
        chunk_size=chunk_size,
    )


@given(st.binary(min_size=1, max_size=5000), st.integers(1, 700), st.randoms())
def test_chunks_in_any_order_reassemble_exactly(payload: bytes, size: int, rnd) -> None:
    m = describe(payload, size)
    pieces = list(enumerate(split(payload, size)))
    rnd.shuffle(pieces)
    asm = Assembler(m)
    for i, c in pieces:
        assert not asm.complete
        assert asm.add(i, c)
    assert asm.complete and asm.payload() == payload
    assert not asm.add(*pieces[0])  # a duplicate is verified but not new


def test_bad_chunks_are_refused_each_with_its_own_error() -> None:
    payload = bytes(40_000)
    m = describe(payload)
    with pytest.raises(ChunkIndexError):
        verify_chunk(m, 3, b"")
    with pytest.raises(ChunkLengthError, match="expected 16384"):
        verify_chunk(m, 0, bytes(100))
    with pytest.raises(ChunkHashMismatchError, match="chunk 1"):
        verify_chunk(m, 1, b"\1" + bytes(16383))
    asm = Assembler(m)
    asm.add(0, payload[:16384])
    with pytest.raises(IncompletePayloadError, match="2 chunk"):
        asm.payload()
    assert asm.missing == [1, 2]


def test_token_bucket_paces_to_its_rate() -> None:
    from p2p_sync.protocol.ratelimit import TokenBucket

    bucket = TokenBucket(rate=1000.0, burst=500.0)
    assert bucket.reserve(500, now=0.0) == 0.0  # the burst is free
    assert bucket.reserve(1000, now=0.0) == pytest.approx(1.0)  # then one second per 1000 B
    assert bucket.reserve(1000, now=1.0) == pytest.approx(1.0)  # refilled 1000, still 1 s behind
    assert bucket.reserve(10, now=10.0) == 0.0  # idle time refills up to the burst only
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)


@given(st.integers(0, 2**40), st.integers(0, 2**40))
def test_the_chunk_size_follows_the_payload_size(a: int, b: int) -> None:
    small, large = sorted((a, b))
    size = chunk_size_for(small)
    assert MIN_AUTO_CHUNK <= size <= MAX_AUTO_CHUNK and size & (size - 1) == 0  # a power of two
    assert size <= chunk_size_for(large)  # never smaller for a larger payload
    if MIN_AUTO_CHUNK * TARGET_CHUNKS * 2 <= small <= MAX_AUTO_CHUNK * TARGET_CHUNKS // 2:
        assert TARGET_CHUNKS / 1.5 <= -(-small // size) <= TARGET_CHUNKS * 1.5


def test_auto_chunking_agrees_in_memory_and_on_disk(tmp_path) -> None:
    payload = bytes(range(256)) * (100_000_000 // 256 // 40)  # 2.5 MB: the 64 KiB floor
    path = tmp_path / "payload"
    path.write_bytes(payload)
    on_disk = file_chunk_hashes(path, AUTO)
    m = describe(payload, AUTO)
    assert m.chunk_size == chunk_size_for(len(payload)) == MIN_AUTO_CHUNK
    assert (m.chunks, m.payload_size) == on_disk
    assert chunk_size_for(100_000_000) == 64 * 1024  # a 100 MB patch: 1,526 chunks
