"""zstd frames as the format writes and reads them: one block per stream, bounded expansion.

An encoder keeps every frame within :data:`MAX_EXPANSION`; a decoder unpacks a frame only
when what it declares fits both its row and that bound, so memory follows the file's bytes.
"""

from __future__ import annotations

import zstandard

from p2p_sync.codec.limits import MAX_EXPANSION, CodecLimits
from p2p_sync.errors import CorruptFrameError, MalformedPatchError


def _compress(streams: list[bytes], level: int) -> bytes:
    """One zstd frame; each stream ends a block, so it gets its own entropy tables. A frame
    unpacking to more than :data:`MAX_EXPANSION` times its size (near-constant streams) is
    made again with a block ended every ``4 * MAX_EXPANSION`` bytes: a block takes at least 4
    bytes (a run-length one), so decoders, which refuse more, take it."""
    frame = _compress_blocks(streams, level, None)
    if sum(len(s) for s in streams) > MAX_EXPANSION * len(frame):
        frame = _compress_blocks(streams, level, 4 * MAX_EXPANSION)
    return frame


def _compress_blocks(streams: list[bytes], level: int, block: int | None) -> bytes:
    """One zstd frame ending a block after each stream and, if ``block``, every ``block``
    bytes of one."""
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    size = sum(len(s) for s in streams)
    obj = cctx.compressobj(size=size)
    out = []
    for stream in streams:
        step = block or max(len(stream), 1)
        for at in range(0, len(stream), step):
            out.append(obj.compress(stream[at : at + step]))
            out.append(obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(obj.flush())
    return b"".join(out)


def _decompress(frame: memoryview, bound: int, name: str, limits: CodecLimits) -> memoryview:
    """The frame's bytes, unpacked only if it declares at most ``bound`` of them (what its row
    allows) and at most ``max_expansion`` times its own size: the output is allocated whole."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CorruptFrameError(f"{name}: not a zstd frame ({exc})") from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) or size > bound:
        raise MalformedPatchError(f"{name}: frame declares {size} bytes, at most {bound} possible")
    if size > limits.max_expansion * len(frame):
        raise MalformedPatchError(
            f"{name}: a {len(frame)}-byte frame declares {size} bytes, more than "
            f"{limits.max_expansion}x its size"
        )
    try:
        return memoryview(zstandard.ZstdDecompressor().decompress(frame, max_output_size=size))
    except zstandard.ZstdError as exc:
        raise CorruptFrameError(f"{name}: frame is corrupt ({exc})") from None
