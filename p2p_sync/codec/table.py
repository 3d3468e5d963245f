"""A patch file's header and row table: writing them, and parsing them with every check.

:func:`read_header` reads what a patch says about itself (layout, hashes, codings, counts,
frame offsets) without decoding any frame; :func:`_join` lays header, table and frames out.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from p2p_sync.codec.classes import classed_dtype, segmented_dtype
from p2p_sync.codec.compression import _compress, _decompress
from p2p_sync.codec.limits import (
    _HEADER,
    _ROW_HEAD,
    _ROW_TAIL,
    _ROW_TYPE,
    CLASSED,
    CODINGS_BY_VERSION,
    DENSE,
    HEADER_SIZE,
    MAGIC,
    SEGMENTED,
    SPARSE,
    SUPPORTED_VERSIONS,
    UNCHANGED,
    CodecLimits,
)
from p2p_sync.errors import (
    BadMagicError,
    CountMismatchError,
    MalformedPatchError,
    TrailingDataError,
    TruncatedPatchError,
    UnsupportedFormatError,
)
from p2p_sync.weights.tensors import (
    DTYPE_CODES,
    DTYPES_BY_CODE,
    Layout,
    TensorSpec,
    layout_fingerprint,
)

Frames = Mapping[str, tuple[int, int, bytes]]  # tensor name -> (coding, count, frame)


@dataclass(frozen=True)
class FrameInfo:
    """One table row: a tensor, how it is coded, how many elements change, where its frame is."""

    spec: TensorSpec
    coding: int
    count: int
    offset: int
    size: int


@dataclass(frozen=True)
class PatchInfo:
    """Everything the header and table say, without decoding any frame (for ``inspect``)."""

    version: int
    fingerprint: bytes
    base_hash: bytes
    target_hash: bytes
    rows: tuple[FrameInfo, ...]
    total_size: int

    @property
    def layout(self) -> tuple[TensorSpec, ...]:
        return tuple(r.spec for r in self.rows)

    @property
    def dense_bytes(self) -> int:
        return sum(r.spec.nbytes for r in self.rows)

    @property
    def changed(self) -> int:
        return sum(r.count for r in self.rows)

    @property
    def numel(self) -> int:
        return sum(r.spec.numel for r in self.rows)

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def bits_per_changed(self) -> float:
        return 8 * self.total_size / self.changed if self.changed else float("inf")

    @property
    def ratio(self) -> float:
        """Dense size over patch size: how many times smaller than a full push."""
        return self.dense_bytes / self.total_size


def _row_bytes(spec: TensorSpec, coding: int, count: int, size: int) -> bytes:
    name = spec.name.encode("utf-8")
    return b"".join(
        (
            _ROW_HEAD.pack(len(name)),
            name,
            _ROW_TYPE.pack(DTYPE_CODES[spec.dtype], len(spec.shape)),
            struct.pack(f"<{len(spec.shape)}Q", *spec.shape),
            _ROW_TAIL.pack(coding, count, size),
        )
    )


def _table(layout: Layout, frames: Frames, level: int) -> tuple[bytes, int]:
    """The file's row table: compressed, and its raw length."""
    rows = []
    for spec in layout:
        coding, count, frame = frames.get(spec.name, (UNCHANGED, 0, b""))
        rows.append(_row_bytes(spec, coding, count, len(frame)))
    table_raw = b"".join(rows)
    return _compress([table_raw], level), len(table_raw)


def _file_size(frames: Frames, table: tuple[bytes, int]) -> int:
    """The length of :func:`_join`'s file, without joining it."""
    return HEADER_SIZE + len(table[0]) + sum(len(f[2]) for f in frames.values())


def _join(
    layout: Layout, base_hash: bytes, target_hash: bytes, frames: Frames, table: tuple[bytes, int]
) -> bytes:
    codings = {f[0] for f in frames.values()}
    version = _version(codings)
    header = _HEADER.pack(
        MAGIC,
        version,
        0,
        len(layout),
        len(table[0]),
        table[1],
        layout_fingerprint(layout),
        base_hash,
        target_hash,
    )
    return b"".join([header, table[0], *(frames[s.name][2] for s in layout if s.name in frames)])


def _version(codings: set[int]) -> int:
    """The lowest format version whose codings include ``codings``."""
    return min(v for v, allowed in CODINGS_BY_VERSION.items() if codings <= set(allowed))


class _Reader:
    """Bounds-checked cursor over the decompressed table."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.off = buf, 0

    def take(self, fmt: struct.Struct) -> tuple:
        if self.off + fmt.size > len(self.buf):
            raise MalformedPatchError("tensor table ends in the middle of a row")
        out = fmt.unpack_from(self.buf, self.off)
        self.off += fmt.size
        return out

    def take_bytes(self, n: int) -> bytes:
        if self.off + n > len(self.buf):
            raise MalformedPatchError("tensor table ends in the middle of a row")
        out = self.buf[self.off : self.off + n]
        self.off += n
        return out


def _parse_row(reader: _Reader, limits: CodecLimits) -> tuple[TensorSpec, int, int, int]:
    (name_len,) = reader.take(_ROW_HEAD)
    try:
        name = reader.take_bytes(name_len).decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPatchError("tensor name is not valid UTF-8") from None
    code, ndim = reader.take(_ROW_TYPE)
    if code not in DTYPES_BY_CODE:
        raise UnsupportedFormatError(f"{name}: unknown dtype code {code}")
    if ndim > limits.max_ndim:
        raise MalformedPatchError(f"{name}: {ndim} dimensions, limit is {limits.max_ndim}")
    shape = reader.take(struct.Struct(f"<{ndim}Q"))
    coding, count, size = reader.take(_ROW_TAIL)
    return TensorSpec(name, tuple(shape), DTYPES_BY_CODE[code]), coding, count, size


def _check_row(
    spec: TensorSpec, coding: int, count: int, size: int, limits: CodecLimits, version: int
) -> None:
    if spec.numel > limits.max_tensor_elements:
        raise MalformedPatchError(f"{spec.name}: {spec.numel} elements exceed the limit")
    if coding not in CODINGS_BY_VERSION[version]:
        raise UnsupportedFormatError(f"{spec.name}: unknown coding {coding} in format {version}")
    if coding == CLASSED and not classed_dtype(spec.dtype):
        raise MalformedPatchError(f"{spec.name}: coding 3 needs a float dtype, not {spec.dtype}")
    if coding == SEGMENTED and not segmented_dtype(spec.dtype):
        raise MalformedPatchError(f"{spec.name}: coding 4 needs a float dtype of <= 4 bytes")
    if count > spec.numel:
        raise CountMismatchError(f"{spec.name}: {count} changes in {spec.numel} elements")
    if (coding == UNCHANGED) != (count == 0) or (coding == UNCHANGED) != (size == 0):
        raise CountMismatchError(f"{spec.name}: coding {coding} with count {count}, size {size}")
    if _least_content(spec, coding, count) > limits.max_expansion * size:
        raise MalformedPatchError(
            f"{spec.name}: {count} changes in {spec.numel} elements cannot be coded in "
            f"{size} bytes (a frame unpacks to at most {limits.max_expansion}x its size)"
        )


def _least_content(spec: TensorSpec, coding: int, count: int) -> int:
    """The fewest bytes a frame of this row unpacks to: 2 per change (the gap planes) for a
    sparse frame, half a byte per element for a dense one, a sign bit per change for coding 4
    (coding 3 needs the base, whose size bounds it: 0 here)."""
    if coding == SEGMENTED:
        return (count + 7) // 8
    if coding == SPARSE:
        return 2 * count
    if coding == DENSE:
        return spec.numel // 2
    return 0


def _read_table(data: memoryview, n: int, zsize: int, rawsize: int, limits: CodecLimits) -> bytes:
    if n > limits.max_tensors or rawsize > limits.max_table_bytes:
        raise MalformedPatchError(f"table of {n} tensors / {rawsize} bytes exceeds the limits")
    if len(data) < HEADER_SIZE + zsize:
        raise TruncatedPatchError(
            f"patch is {len(data)} bytes, its table ends at {HEADER_SIZE + zsize}"
        )
    table = _decompress(data[HEADER_SIZE : HEADER_SIZE + zsize], rawsize, "tensor table", limits)
    if len(table) != rawsize:
        raise MalformedPatchError(f"table is {len(table)} bytes, header says {rawsize}")
    return bytes(table)


def _parse_rows(
    table: bytes, n: int, first_offset: int, limits: CodecLimits, version: int
) -> list[FrameInfo]:
    reader, rows, offset, prev = _Reader(table), [], first_offset, None
    for _ in range(n):
        spec, coding, count, size = _parse_row(reader, limits)
        _check_row(spec, coding, count, size, limits, version)
        key = spec.name.encode("utf-8")
        if prev is not None and key <= prev:
            raise MalformedPatchError(f"table rows not in strict name order at {spec.name!r}")
        rows.append(FrameInfo(spec, coding, count, offset, size))
        offset, prev = offset + size, key
    if reader.off != len(table):
        raise MalformedPatchError(f"{len(table) - reader.off} stray bytes after the table rows")
    return rows


def read_header(data: bytes | memoryview, limits: CodecLimits = CodecLimits()) -> PatchInfo:
    """Parse and check the header and table (not the frames)."""
    data = memoryview(data)
    if len(data) < len(MAGIC) or bytes(data[: len(MAGIC)]) != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(bytes(data)):
            raise TruncatedPatchError(f"patch is only {len(data)} bytes")
        raise BadMagicError("not a p2psync patch (bad magic bytes)")
    if len(data) < HEADER_SIZE:
        raise TruncatedPatchError(f"patch is {len(data)} bytes, the header alone is {HEADER_SIZE}")
    _, version, flags, n, zsize, rawsize, fp, base, target = _HEADER.unpack_from(data)
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedFormatError(
            f"patch format version {version}; this build reads {sorted(SUPPORTED_VERSIONS)}"
        )
    if flags:
        raise UnsupportedFormatError(f"unknown header flags 0x{flags:04x}")
    table = _read_table(data, n, zsize, rawsize, limits)
    rows = _parse_rows(table, n, HEADER_SIZE + zsize, limits, version)
    if layout_fingerprint(tuple(r.spec for r in rows)) != fp:
        raise MalformedPatchError("table layout does not match the header's fingerprint")
    end = rows[-1].offset + rows[-1].size if rows else HEADER_SIZE + zsize
    if len(data) < end:
        raise TruncatedPatchError(f"patch is {len(data)} bytes, its frames end at {end}")
    if len(data) > end:
        raise TrailingDataError(f"{len(data) - end} unexpected bytes after the last frame")
    return PatchInfo(version, fp, base, target, tuple(rows), len(data))
