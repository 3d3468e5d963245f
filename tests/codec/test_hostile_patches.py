"""Patches whose declared sizes go far beyond their bytes: refused with a PatchError, and
whatever decoding them allocates follows the file's size, not what its table or frames claim
(a 124-byte file declaring a terabyte, a 64 KiB one of zstd run-length blocks declaring 2 GiB).
Legit patches, degenerate ones included, still decode."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.cli import main
from p2p_sync import codec
from p2p_sync.errors import MalformedPatchError, PatchError
from p2p_sync.weights.patch import apply, diff
from p2p_sync.weights.tensors import TensorSpec
from tests.helpers import bit_equal, clone_set

RLE_BLOCK = 1 << 17  # the most one zstd block holds
EXPANSION = 64  # the most a frame unpacks to per byte of it (the spec, CodecLimits)


def rle_frame(
    declared: int, content: int | None = None, byte: int = 0, run: int = RLE_BLOCK, head=b""
) -> bytes:
    """A zstd frame declaring ``declared`` bytes and holding ``head`` (a raw block) then
    ``content`` bytes (all of ``declared`` when None) of ``byte`` as run-length blocks of
    ``run`` bytes: 4 bytes of frame per block."""
    content = declared - len(head) if content is None else content
    out = [struct.pack("<IBQ", 0xFD2FB528, 0xE0, declared)]  # 8-byte size, single segment
    if head:
        out.append(((len(head) << 3) | (not content)).to_bytes(3, "little") + head)
    left = content
    while left or not head:
        n = min(left, run)
        left -= n
        last = left == 0
        out.append(((n << 3) | (1 << 1) | last).to_bytes(3, "little") + bytes([byte]))
        if last:
            break
    return b"".join(out)


def hostile_patch(
    shape: tuple[int, ...], dtype: torch.dtype, coding: int, count: int, frame: bytes
) -> bytes:
    """A well-formed header and table for one tensor, then ``frame``."""
    spec = TensorSpec("t", shape, dtype)
    return codec.assemble((spec,), b"\1" * 16, b"\2" * 16, {"t": (coding, count, frame)})


def tiny_bomb() -> bytes:
    """A float64 tensor of 2^37 elements, coded dense, its frame declaring a TiB."""
    return hostile_patch((2**37,), torch.float64, codec.DENSE, 1, rle_frame(2**40, 0))


def rle_bomb() -> bytes:
    """A bf16 tensor of 2^31 elements, coded dense: 64 KiB of run-length blocks unpacking to
    2 GiB of zeros (a value width of 0: refused once unpacked)."""
    return hostile_patch((2**31,), torch.bfloat16, codec.DENSE, 1, rle_frame(2**31))


@pytest.fixture(scope="module", autouse=True)
def warm_decoder() -> None:
    """Decode legit patches first: numba compiles (or loads) the scans on first use, which
    allocates what no patch caused."""
    base = {"t": torch.zeros(4096, dtype=torch.bfloat16)}
    for step in (7, 1):  # sparse, then every element: dense
        new = clone_set(base)
        new["t"].view(-1)[::step] += 1
        codec.decode(codec.encode(diff(base, new)))


def traced_peak(call) -> tuple[int, BaseException | None]:
    """The peak of Python and numpy allocations while ``call`` runs, and what it raised."""
    tracemalloc.start()
    try:
        call()
        raised = None
    except BaseException as exc:  # MemoryError included: what the decoder did is the result
        raised = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak, raised


def test_the_attack_shapes_are_refused_from_their_header() -> None:
    tiny, rle = tiny_bomb(), rle_bomb()
    assert len(tiny) < 140 and 64 * 1024 < len(rle) < 66 * 1024
    for data in (tiny, rle):
        with pytest.raises(MalformedPatchError, match="cannot be coded in"):
            codec.read_header(data)
        peak, raised = traced_peak(lambda d=data: codec.decode(d))
        assert isinstance(raised, MalformedPatchError), repr(raised)
        assert peak < 64 * len(data) + 2**20


def test_a_frame_declaring_more_than_its_bytes_can_hold_is_not_unpacked() -> None:
    """Its row allows it (a dense tensor of that size), its bytes do not."""
    frame = rle_frame(2**23, 0) + b"\0" * 2**13  # 8 MiB declared by 8 KiB
    data = hostile_patch((2**20,), torch.float64, codec.DENSE, 1, frame)
    codec.read_header(data)  # 8 KiB of frame could hold 2^20 half-byte values
    peak, raised = traced_peak(lambda: codec.decode(data))
    assert isinstance(raised, PatchError) and "more than 64x its size" in str(raised), raised
    assert peak < 2**20


BIG_SHAPES = st.tuples(st.integers(1, 2**20), st.integers(1, 2**20)) | st.tuples(
    st.integers(1, 2**40)
)
HEADS = st.sampled_from([b"\4\0\0\0\0", b"\x08\0\0\0\0", b"\0\0\0\0\4\0\0\0\0"]) | st.binary(
    max_size=16
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=BIG_SHAPES,
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64, torch.int8]),
    coding=st.sampled_from([codec.SPARSE, codec.DENSE]),
    count=st.integers(1, 2**40),
    head=HEADS,
    blocks=st.integers(0, 16),
    run=st.integers(1, RLE_BLOCK),
    byte=st.integers(0, 255),
    declared=st.none() | st.integers(0, 2**44),
)
def test_declared_sizes_far_beyond_the_bytes_cost_memory_in_proportion_to_the_bytes(
    shape, dtype, coding, count, head, blocks, run, byte, declared
) -> None:
    """Whatever a one-tensor patch declares (shape, changes, frame content; the content
    honest or not), decoding it fails only with a PatchError and allocates in proportion to
    its bytes: it unpacks to at most 64x them, and decoding widens an unpacked byte to at
    most 19 (two half-byte values to 8 bytes each, and the temporaries)."""
    numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
    content = blocks * run
    frame = rle_frame(
        len(head) + content if declared is None else declared, content, byte, run, head
    )
    data = hostile_patch(shape, dtype, coding, min(count, numel), frame)
    peak, raised = traced_peak(lambda: codec.decode(data))
    assert raised is None or isinstance(raised, PatchError), repr(raised)
    assert peak < 20 * EXPANSION * len(data) + 2**20


def test_a_patch_changing_every_element_alike_still_round_trips() -> None:
    """zstd codes a constant stream in 4 bytes per 128 KiB; the encoder ends blocks sooner so
    the frame stays within the expansion every decoder allows."""
    base = {"w": torch.zeros(2**18, dtype=torch.bfloat16), "b": torch.ones(5)}
    new = clone_set(base)
    new["w"].view(torch.int16).add_(1)  # every element one ulp up: constant deltas
    data = codec.encode(diff(base, new))
    info = codec.read_header(data)
    for row in info.rows:
        frame = data[row.offset : row.offset + row.size]
        if row.size:
            declared = zstandard.get_frame_parameters(frame).content_size
            assert declared <= EXPANSION * row.size, (row.spec.name, declared)
    weights = clone_set(base)
    apply(weights, codec.decode(data))
    assert bit_equal(weights, new)
    assert len(data) < 2**18 * 2 / 32  # still a small patch


def test_inspect_verify_refuses_an_oversized_declaration_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "bomb.patch"
    path.write_bytes(tiny_bomb())
    code = main(["patch", "inspect", str(path), "--verify"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("p2psync: error: t: 1 changes in 137438953472 elements cannot be coded")
