"""Rarest first (``protocol.rarity``): the order of (holders, seeded hash), taken as ints."""

import hashlib
import random

from p2p_sync.protocol.rarity import ChunkOrder


def _digest(i: int, seed: int) -> bytes:
    salt = seed.to_bytes(8, "little", signed=True)
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8, salt=salt).digest()


def test_the_order_is_fewest_holders_then_the_seeded_hash() -> None:
    rng = random.Random(7)
    for seed in (0, 1, -3, 2**40):
        chunks = set(rng.sample(range(5000), 1500))
        order = ChunkOrder(chunks, seed)
        for _ in range(20):
            cands = set(rng.sample(sorted(chunks), rng.randint(0, 60)))
            holders = {i: set(range(rng.randint(0, 40))) for i in cands}
            expected = sorted(cands, key=lambda i: (len(holders[i]), _digest(i, seed)))
            assert order.rarest(cands, holders, 256) == expected
            assert order.rarest(cands, holders, 1) == expected[:1]


def test_no_chunks_and_chunk_zero() -> None:
    assert ChunkOrder([], 0).rarest(set(), {}, 5) == []
    order = ChunkOrder([0], 3)
    assert order.rarest({0}, {0: {"a"}}, 5) == [0]
