"""Load and save weight files (safetensors), streaming, with errors that name the problem.

Why not ``safetensors.torch.load_file`` / ``save_file``: at real model sizes they cost a second
copy of the model. ``save_file`` turns every tensor into a ``bytes`` object before writing (the
whole model twice in memory), and ``load_file`` maps the file, so every page it touches counts
in the process's resident set until the map closes (twice the model again, at peak). A 7B model
would need 28 GB of RAM to be loaded or saved once. Here both go one tensor at a time: the writer
writes each tensor's own buffer (a host copy of one tensor at most, for GPU tensors), and the
reader ``readinto``s each tensor's own storage (or a one-tensor staging buffer for the GPU).
The page cache holds the file, not the process.

The files are plain safetensors (https://huggingface.co/docs/safetensors): an 8-byte
little-endian header size N, N bytes of JSON (``{name: {"dtype", "shape", "data_offsets"}}``
and an optional ``__metadata__`` of strings), padded with spaces to a multiple of 8, then the
tensors' bytes. Files from either side load with the other.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from typing import BinaryIO

import torch

from p2p_sync import jsonbounds
from p2p_sync.atomic import atomic_write_with
from p2p_sync.errors import LayoutMismatchError, WeightsFileError
from p2p_sync.weights.tensors import flat_bits

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
ALIGN = 8

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
DTYPES_BY_NAME = {name: dt for dt, name in DTYPE_NAMES.items()}


Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, start, end


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    specs = [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in sorted(tensors)]
    return header_of(specs, metadata)


def header_of(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The safetensors header of tensors ``(name, dtype, shape)`` laid out in name order, as
    :func:`write_to` writes them (for writers that produce the tensors one at a time)."""
    doc: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in sorted(specs, key=lambda s: s[0]):
        if dtype not in DTYPE_NAMES:
            raise WeightsFileError(f"{name}: dtype {dtype} cannot be saved")
        size = math.prod(shape) * dtype.itemsize
        doc[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def host_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` on the host: a view for contiguous CPU tensors, else one copy of
    this tensor only."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(flat_bits(t).numpy()).cast("B")


def write_to(
    f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` as safetensors to an open file, one tensor at a time; returns bytes."""
    head = _header(tensors, metadata)
    f.write(head)
    total = len(head)
    for name in sorted(tensors):
        view = host_view(tensors[name])
        f.write(view)
        total += len(view)
    return total


def save_weights(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    durable: bool = True,
    mode: int | None = None,
) -> None:
    """Write ``tensors`` to ``path`` atomically (old file or new, never a mix), streaming;
    ``mode`` as :func:`p2p_sync.atomic.atomic_write_with` takes it (None: private)."""
    atomic_write_with(path, lambda f: write_to(f, tensors, metadata), durable, mode)


def _parse_entry(name: str, info: object, data_size: int) -> Entry:
    if not isinstance(info, dict):
        raise ValueError(f"{name}: entry is not an object")
    dtype = DTYPES_BY_NAME.get(info.get("dtype"))  # type: ignore[arg-type]
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise ValueError(f"{name}: unknown dtype {info.get('dtype')!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"{name}: bad shape")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    ):
        raise ValueError(f"{name}: bad data_offsets")
    start, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= start <= end <= data_size or end - start != numel * dtype.itemsize:
        raise ValueError(f"{name}: data_offsets {offsets} do not fit its shape or the file")
    return name, dtype, tuple(shape), start, end


def read_index(f: BinaryIO, path: object) -> tuple[list[Entry], int]:
    """The tensors a safetensors file holds (sorted by name) and where its data starts."""
    try:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header of {n} bytes does not fit")
        doc = jsonbounds.loads(f.read(n))
        if not isinstance(doc, dict):
            raise ValueError("header is not an object")
        doc.pop("__metadata__", None)
        entries = [_parse_entry(k, v, size - 8 - n) for k, v in doc.items()]
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise WeightsFileError(f"{path}: not a readable safetensors file ({exc})") from None
    return sorted(entries), 8 + n


def pread_into(fd: int, t: torch.Tensor, offset: int, path: object, name: str) -> None:
    """Fill ``t`` (contiguous, on the CPU) from ``fd`` at ``offset``: positional reads, so
    several threads can read one file at once."""
    view = memoryview(flat_bits(t).numpy()).cast("B") if t.numel() else memoryview(b"")
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            why = exc.strerror
            raise WeightsFileError(f"{path}: cannot read tensor {name!r} ({why})") from None
        if got <= 0:
            raise WeightsFileError(f"{path}: truncated in tensor {name!r}")
        done += got


def open_weights(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading if it is a regular file, else a :class:`WeightsFileError`
    saying why not: gone, unreadable, or a directory, pipe or device. Opened non-blocking,
    then checked, so a named pipe in a watched dir cannot hang the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise WeightsFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise WeightsFileError(f"{path}: cannot open ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise WeightsFileError(f"{path}: {what}, not a weights file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def load_weights(path: str | os.PathLike[str], device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on ``device``, read straight into its storage."""
    with open_weights(path) as f:
        entries, base = read_index(f, path)
        out = {
            name: torch.empty(shape, dtype=dtype, device=device)
            for name, dtype, shape, _, _ in entries
        }
        _fill(f.fileno(), entries, base, out, path)
    return out


def load_into(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place with a file's contents (an engine's live model).

    Every name, shape and dtype is checked before the first byte is written: a file that does
    not match is refused with the tensor it differs in, and ``tensors`` are left untouched.
    """
    with open_weights(path) as f:
        entries, base = read_index(f, path)
        _check_entries(entries, tensors, path)
        _fill(f.fileno(), entries, base, tensors, path)


def _fill(
    fd: int, entries: list[Entry], base: int, tensors: Mapping[str, torch.Tensor], path: object
) -> None:
    """Read each entry into its tensor: straight into contiguous CPU storage, else through one
    reused host buffer the size of the largest such tensor (GPU tensors, strided views)."""
    staging: torch.Tensor | None = None
    with torch.no_grad():
        for name, dtype, shape, start, _end in entries:
            dst = tensors[name]
            if dst.device.type == "cpu" and dst.is_contiguous():
                pread_into(fd, dst, base + start, path, name)
                continue
            nbytes = dst.numel() * dst.element_size()
            if staging is None or staging.numel() < nbytes:
                staging = torch.empty(nbytes, dtype=torch.uint8)
            host = staging[:nbytes].view(dtype).view(shape)
            pread_into(fd, host, base + start, path, name)
            dst.copy_(host)


def _check_entries(entries: list[Entry], tensors: Mapping[str, torch.Tensor], path: object) -> None:
    have = {name: (dtype, shape) for name, dtype, shape, _, _ in entries}
    for name in sorted(set(have) | set(tensors)):
        if name not in tensors:
            raise LayoutMismatchError(f"{path}: tensor {name!r} has no counterpart in the model")
        if name not in have:
            raise LayoutMismatchError(f"{path}: holds no tensor {name!r}")
        t = tensors[name]
        if have[name] != (t.dtype, tuple(t.shape)):
            raise LayoutMismatchError(
                f"tensor {name!r}: model has {t.dtype} {tuple(t.shape)}, "
                f"{path} has {have[name][0]} {have[name][1]}"
            )
