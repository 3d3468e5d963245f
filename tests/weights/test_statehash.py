"""The state hash (format 2): the host kernel, the torch path a GPU takes and the plain-Python
definition agree bit for bit; the O(patch) updates always equal a full re-hash; the sums see
every single-word change; tied weights and unaligned views are covered."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_sync import codec, jit
from p2p_sync.errors import TargetMismatchError
from p2p_sync.store.restore import apply_frames
from p2p_sync.weights import hostsums, statehash
from p2p_sync.weights.patch import Patch, apply, diff
from p2p_sync.weights.statehash import StateDigest, state_hash
from p2p_sync.weights.tensors import flat_bits, layout_of, spec_record
from tests.codec.test_roundtrip_properties import DTYPES, SHAPES, change, version_pairs
from tests.helpers import bit_equal, clone_set, random_bits


def reference_sums(t: torch.Tensor) -> statehash.Sums:
    """The docstring's definition, word by word in plain Python."""
    raw = t.detach().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    raw += b"\0" * (-len(raw) % 8)
    sums: statehash.Sums = (0, 0)
    for j in range(len(raw) // 8):
        word = int.from_bytes(raw[8 * j : 8 * j + 8], "little")
        sums = statehash.add(sums, statehash.term_py(j, word))
    return sums


def torch_sums(t: torch.Tensor) -> statehash.Sums:
    """The GPU path's arithmetic (int64 torch ops), run on the CPU."""
    w = statehash._words(t)
    j = torch.arange(w.body.numel(), dtype=torch.int64)
    sums = statehash._terms_torch(w.body, j)
    if w.tail is not None:
        sums = statehash.add(sums, statehash.term_py(w.body.numel(), w.tail))
    return sums


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype, shape = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))
    return random_bits(shape, dtype, draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=120, deadline=None)
@given(tensors())
def test_host_kernel_torch_path_and_definition_agree(t: torch.Tensor) -> None:
    assert statehash.tensor_sums(t) == reference_sums(t) == torch_sums(t)


@settings(max_examples=120, deadline=None)
@given(tensors(), st.data())
def test_word_sums_are_the_terms_of_those_words(t: torch.Tensor, data: st.DataObject) -> None:
    n = statehash._words(t).count
    picked = sorted(data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=8))) if n else []
    words = torch.tensor(picked, dtype=torch.int64)
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    raw += b"\0" * (-len(raw) % 8)
    want: statehash.Sums = (0, 0)
    for j in picked:
        want = statehash.add(
            want, statehash.term_py(j, int.from_bytes(raw[8 * j : 8 * j + 8], "little"))
        )
    assert statehash.word_sums(t, words) == want
    w = statehash._words(t)
    body = [j for j in picked if j < w.body.numel()]
    if body:  # the GPU path's gather, on the CPU
        idx = torch.tensor(body, dtype=torch.int64)
        assert statehash._terms_torch(w.body[idx], idx) == statehash.word_sums(t, idx)


@st.composite
def whole_word_tensors(draw: st.DrawFn) -> torch.Tensor:
    """Mostly whole 64-bit words (the device path proper); some with a tail (its fallback)."""
    dtype, numel = draw(st.sampled_from(DTYPES)), draw(st.sampled_from([8, 64, 520, 4000, 4001]))
    return random_bits((numel,), dtype, draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=150, deadline=None)
@given(whole_word_tensors(), st.data())
def test_device_tracking_moves_the_sums_exactly_without_reading_back(
    t: torch.Tensor, data: st.DataObject
) -> None:
    """The GPU's way of tracking a patch (``track_on_device``: sums moved on the device, read
    back once at ``settle``; repeated words masked), run on CPU tensors: after any blocks of
    sorted distinct positions, in one tensor or a view of it, the settled sums are a full
    re-hash's; before ``settle`` nothing was read back into ``sums``."""
    if data.draw(st.booleans()):  # a view of whole words, maybe unaligned (the fallback)
        k = data.draw(st.integers(0, 7))
        t = t.reshape(-1)[k : k + (t.numel() - 8) // 8 * 8]
    flat = flat_bits(t)
    n = flat.numel()
    spec = layout_of({"t": t})[0]
    digest = StateDigest.of({"t": t})
    start = digest.sums["t"]
    for _ in range(data.draw(st.integers(1, 3))):
        lo = data.draw(st.integers(0, max(n - 1, 0)))  # crowded: words with several changes
        hi = data.draw(st.sampled_from([min(n - 1, lo + 24), n - 1]))
        picked = sorted(data.draw(st.sets(st.integers(lo, max(hi, lo)), max_size=40))) if n else []
        at = torch.tensor(picked, dtype=torch.int64)
        deltas = torch.tensor(
            data.draw(st.lists(st.integers(-3, 3), min_size=len(picked), max_size=len(picked))),
            dtype=torch.int64,
        ).to(flat.dtype)

        def write(at: torch.Tensor = at, deltas: torch.Tensor = deltas) -> None:
            flat[at] += deltas

        statehash.track_on_device(digest, spec, flat, at, write)
    if digest.moved:
        assert digest.sums["t"] == start  # moved on the device only
    digest.settle()
    assert not digest.moved and digest.sums == StateDigest.of({"t": t}).sums


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_pairs())
def test_incremental_hashes_equal_full_rehash(pair: tuple[dict, dict]) -> None:
    base, new = pair
    digest = StateDigest.of(base)
    patch = diff(base, new, digest=digest)
    assert patch.base_hash == state_hash(base) and patch.target_hash == state_hash(new)
    assert patch.target_digest is not None and patch.target_digest.sums == StateDigest.of(new).sums
    weights = clone_set(base)
    after = apply(weights, patch, digest=digest)
    assert after is digest and digest.hash() == state_hash(weights) == state_hash(new)


@settings(max_examples=200, deadline=None)
@given(tensors(), st.data())
def test_every_single_word_change_changes_both_sums(t: torch.Tensor, data: st.DataObject) -> None:
    if t.numel() == 0:
        return
    bits = flat_bits(t.clone())
    i = data.draw(st.integers(0, bits.numel() - 1))
    width = 8 * bits.element_size()
    flip = data.draw(st.integers(1, 2**width - 1))
    old = int(bits[i]) % 2**width
    bits[i] = (old ^ flip) - (2**width if (old ^ flip) >> (width - 1) else 0)
    a, b = statehash.tensor_sums(t), statehash.tensor_sums(bits)
    assert a[0] != b[0] and a[1] != b[1]


def test_tensors_with_equal_bytes_in_other_names_or_order_hash_apart() -> None:
    x, y = torch.arange(8, dtype=torch.float32), torch.arange(8, dtype=torch.float32).flip(0)
    assert state_hash({"a": x, "b": y}) != state_hash({"a": y, "b": x})
    assert state_hash({"a": x}) != state_hash({"b": x})
    assert state_hash({"a": x}) != state_hash({"a": x.view(2, 4)})  # the layout is covered


def test_unaligned_views_hash_like_their_contiguous_copy() -> None:
    storage = torch.arange(1001, dtype=torch.int16)
    view = storage[3:]  # storage offset of 6 bytes: its words are not 8-byte aligned
    assert statehash.tensor_sums(view) == statehash.tensor_sums(view.clone())
    words = torch.tensor([0, 5, (view.numel() * 2 - 1) // 8], dtype=torch.int64)
    assert statehash.word_sums(view, words) == statehash.word_sums(view.clone(), words)


def test_tied_weights_keep_the_digest_exact() -> None:
    """An LM head sharing the embedding's memory is patched once, and both names' sums move."""
    emb = torch.randn(64, 8).to(torch.bfloat16)
    base = {"embed": emb.clone(), "head": emb.clone(), "norm": torch.ones(8)}
    new = clone_set(base)
    new["embed"][3] += 1
    new["head"] = new["embed"].clone()
    patch = diff(base, new)
    shared = base["embed"].clone()
    weights = {"embed": shared, "head": shared, "norm": base["norm"].clone()}
    digest = apply(weights, patch)
    assert digest.hash() == state_hash(weights) == patch.target_hash
    weights2 = {"embed": base["embed"].clone(), "norm": base["norm"].clone()}
    weights2["head"] = weights2["embed"]
    data = codec.encode(patch, base=base)
    d2 = StateDigest.of(weights2)
    apply_frames(weights2, memoryview(data), codec.read_header(data), d2)
    assert d2.hash() == patch.target_hash and bit_equal(weights2, weights)


def test_a_lying_target_is_undone_and_the_digest_restored() -> None:
    base = {"w": torch.randn(1000).to(torch.bfloat16)}
    new = {"w": change(base["w"], 0.05, "ulp", 3)}
    good = diff(base, new)
    liar = Patch(good.layout, good.base_hash, b"\x01" * 16, good.deltas)
    weights, digest = clone_set(base), StateDigest.of(base)
    before = dict(digest.sums)
    with pytest.raises(TargetMismatchError):
        apply(weights, liar, digest=digest)
    assert bit_equal(weights, base) and digest.sums == before


def test_device_scans_match_the_host_scans_at_every_density() -> None:
    """Coding 3's scans as a GPU runs them (torch ops) give the host scans' ranks, classes,
    sizes and selections; here torch runs on the CPU."""
    rng = np.random.default_rng(5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2):
        base = (torch.randn(20_000) * 0.05).to(dtype)
        bits = flat_bits(base)
        for density in (0.0, 1e-3, 0.03, 0.4, 0.9, 1.0):
            pos = np.flatnonzero(rng.random(bits.numel()) < density).astype(np.int64)
            host = codec.scan_ranks(bits.numpy(), dtype, pos)
            dev = codec.scan_ranks(bits, dtype, pos)
            assert all(np.array_equal(a, b) for a, b in zip(host, dev))
            new = base.clone()
            flat_bits(new)[torch.from_numpy(pos)] += 1
            delta = diff({"t": base}, {"t": new}).deltas.get("t")
            if delta is None:
                continue
            a = codec.encode_frame(delta, 1, bits.numpy())
            b = codec.encode_frame(delta, 1, bits)
            assert a == b
            row = codec.FrameInfo(delta.spec, a[0], a[1], 0, len(a[2]))
            got = [codec.decode_frame(row, memoryview(a[2]), x) for x in (bits.numpy(), bits)]
            assert torch.equal(got[0].to_sparse()[0], got[1].to_sparse()[0])
            assert torch.equal(got[0].to_sparse()[1], got[1].to_sparse()[1])


def test_state_hash_follows_its_spec_and_is_pinned() -> None:
    """The hash rebuilt from the module docstring's definition (reference sums, XXH3-128 over
    the domain tag, layout records and sums), and a known answer: changing the definition
    must be a deliberate format change, not an accident."""
    t = {"b": torch.tensor([1.5, -0.0, 3.25]), "a": torch.arange(10, dtype=torch.bfloat16)}
    h = xxhash.xxh3_128(statehash.DOMAIN)
    for name in sorted(t):
        spec = layout_of({name: t[name]})[0]
        h.update(spec_record(spec) + struct.pack("<QQ", *reference_sums(t[name])))
    assert state_hash(t) == h.digest()
    assert state_hash(t).hex() == "13871271fee689405ad6364a4dad9804"


@contextlib.contextmanager
def plain_python_kernels() -> Iterator[None]:
    """The kernels' steps as plain Python (what runs where numba is missing); numpy's scalar
    arithmetic wraps as numba's does, warning about it."""
    hostsums._kernels()  # compiled first: the compiled steps are what gets swapped out
    steps = [f for f in jit._STEPS if f.__module__ == hostsums.__name__]
    with contextlib.ExitStack() as stack, np.errstate(over="ignore"):
        for f in steps:
            stack.enter_context(mock.patch.object(hostsums, f.__name__, f))
        yield


def run_diff(
    kernel: Callable, old: torch.Tensor, new: torch.Tensor, entries: int, word0: int = 0
) -> tuple:
    """``kernel`` (DIFF) called until it has scanned every whole word of ``old`` (advanced in
    place) with room for ``entries`` entries a call: (positions, deltas, the four sums).
    ``word0``: where word 0 sits in the state hash (a row block of a larger tensor)."""
    size = old.element_size()
    positions, deltas = np.empty(entries, np.int64), np.empty(entries, f"u{size}")
    o, n = (statehash._host(statehash._words(t).body) for t in (old, new))
    start, listed, moved = 0, [(positions[:0], deltas[:0])], (0, 0, 0, 0)
    while start < o.size:
        w, k, *sums = kernel(o, n, start, 8 // size, positions, deltas, True, word0)
        assert w > start  # every call makes progress
        listed.append((positions[:k].copy(), deltas[:k].copy()))
        moved = tuple((x + int(y)) & statehash.MASK for x, y in zip(moved, sums))
        start = int(w)
    return np.concatenate([p for p, _ in listed]), np.concatenate([d for _, d in listed]), moved


def run_apply(kernel: Callable, flat: torch.Tensor, positions: np.ndarray, deltas: np.ndarray):
    size = flat.element_size()
    return kernel(
        statehash._host(statehash._words(flat).body), positions, hostsums.APPLY,
        statehash._SHIFT[size], hostsums._ZERO, flat.numpy().view(f"u{size}"), deltas,
    )  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([torch.bfloat16, torch.float32, torch.float64, torch.int8]),
    st.integers(1, 9000),
    st.sampled_from([0.001, 0.05, 0.5, 1.0]),
    st.integers(0, 2**32 - 1),
    st.sampled_from([8, 100, 1 << 14]),
    st.sampled_from([0, 37]),
)
def test_blocked_host_kernels_equal_plain_python_and_the_definition(
    dtype: torch.dtype, numel: int, density: float, seed: int, entries: int, word0: int
) -> None:
    """The DIFF and APPLY kernels take ``SCAN_BLOCK`` words or positions at a time (a word's
    elements can straddle two APPLY blocks; a DIFF block shrinks to the room left in its
    output). Compiled and as plain Python they list the same entries and move the sums by the
    same amount: the changed words' terms, before and after, as the definition has them (for
    a row block, ``word0``: the terms at the words' places in the whole tensor, here one with
    ``word0`` words in front)."""
    old = flat_bits(random_bits((numel,), dtype, seed))
    new = flat_bits(change(old, density, "random", seed + 1))
    whole = statehash._words(old).body.numel() * 8 // dtype.itemsize  # the tail is the caller's
    changed = np.flatnonzero(old.numpy()[:whole] != new.numpy()[:whole])
    words = torch.from_numpy(np.unique(changed // (8 // dtype.itemsize)))
    front = torch.zeros(word0 * 8 // dtype.itemsize, dtype=old.dtype)
    placed = [torch.cat([front, t[:whole]]) for t in (old, new)]
    want = tuple(x for t in placed for x in statehash.word_sums(t, words + word0))
    compiled = hostsums._kernels()
    runs = {}
    for name in ("numba", "python"):
        advanced, flat = old.clone(), old.clone()
        with plain_python_kernels() if name == "python" else contextlib.nullcontext():
            diff_kernel = hostsums._diff_py if name == "python" else compiled["diff"]
            positions, deltas, moved = run_diff(diff_kernel, advanced, new, entries, word0)
            apply_kernel = hostsums._sums_py if name == "python" else compiled["sums"]
            a, b, c, d, used = run_apply(apply_kernel, flat, positions, deltas)
        assert np.array_equal(positions, changed) and moved == want
        assert torch.equal(advanced[:whole], new[:whole])
        assert used == positions.size and torch.equal(flat[:whole], new[:whole])
        sums = statehash.tensor_sums(old)
        applied = statehash.add(statehash.sub(sums, (int(a), int(b))), (int(c), int(d)))
        assert applied == statehash.tensor_sums(flat)
        runs[name] = deltas
    assert np.array_equal(runs["numba"], runs["python"])


def test_host_weights_keep_every_apply_thread(tiny_versions: list) -> None:
    """The GPU's thread cap (``restore.GPU_APPLY_THREADS``) leaves host weights alone: there
    each thread decodes and adds on its own core."""
    from p2p_sync.store.restore import apply_threads

    a, b = tiny_versions[0], tiny_versions[1]
    for data in (codec.encode(diff(a, b)), codec.encode(diff(a, b), base=a)):
        assert apply_threads(a, codec.read_header(data), 16) == 16
