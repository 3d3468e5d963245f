"""The patch format's constants and the bounds a decoder enforces.

Format versions, codings, header and row layouts, the exponent-class constants of coding 3,
and the encoder's tuning; see docs/format.md for what each means on the wire.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

MAGIC = b"P2PPATCH"
FORMAT_VERSION = 4
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4})
_HEADER = struct.Struct("<8sHHIII16s16s16s")
HEADER_SIZE = _HEADER.size  # 72

UNCHANGED, SPARSE, DENSE, CLASSED, SEGMENTED, PARTS = 0, 1, 2, 3, 4, 5
# The codings each format version may use: a version-1 file never holds a coding-3 frame.
CODINGS_BY_VERSION = {
    1: (UNCHANGED, SPARSE, DENSE),
    2: (UNCHANGED, SPARSE, DENSE, CLASSED),
    3: (UNCHANGED, SPARSE, DENSE, CLASSED, SEGMENTED),
    4: (UNCHANGED, SPARSE, DENSE, CLASSED, SEGMENTED, PARTS),
}
# What a part of a coding-5 frame may be coded with: the base-free codings.
PART_CODINGS = (SPARSE, DENSE)
# Codings that name elements by the base's exponent classes: they decode only against it.
BASED = frozenset({CLASSED, SEGMENTED})
_ROW_HEAD = struct.Struct("<H")
_ROW_TYPE = struct.Struct("<BB")
_ROW_TAIL = struct.Struct("<BQQ")
_VALUE_HEAD = struct.Struct("<BI")
_SPARSE_HEAD = struct.Struct("<I")
VALUE_BITS = (4, 8, 16, 32, 64)
# Coding-3 frames may also store 2-bit values: there most groups are +-1 and little else, and
# four values to a byte let zstd's Huffman stage reach ~1.1 bits per value (nibbles: ~1.35).
CLASSED_VALUE_BITS = (2, *VALUE_BITS)
_GAP_ESCAPE = 0xFFFF

# zstd level: with one block per stream the entropy stage does the work, and level 1 compressed
# these streams as well as levels 3-9 in our measurements, at the highest speed.
DEFAULT_LEVEL = 1

# Try the dense coding too once this fraction of a tensor changes: on the built-in workload
# dense first won at 15% changed, so below 1/8 the second encode would be wasted time.
DENSE_TRY_FRACTION = 1 / 8
# Coding 3 is written only where it saves at least this share of the best version-1 frame: its
# decode costs ~2x coding 1's CPU (a 20 MB patch rewriting every element at random: 0.104 s
# against 0.058 with 2 threads, for 0.24% fewer bytes; real steps save ~28%).
CLASSED_MIN_SAVING = 1 / 32
BLOCK = 1 << 18  # changed elements a block of decode_frame_blocks holds (2 MiB of positions)


@dataclass(frozen=True)
class CodecLimits:
    """Every bound the decoder enforces, so a hostile file cannot exhaust memory or time."""

    max_tensors: int = 1_000_000
    max_table_bytes: int = 256 * 2**20
    max_ndim: int = 32
    max_tensor_elements: int = 2**40
    # bytes the table or a frame may unpack to per byte of it (the spec's "Expansion"): a
    # decoder's memory follows the file's bytes, not what they declare. Encoders keep to 64.
    max_expansion: int = 64
    # parts one coding-5 frame may hold (a sharded trainer writes one per rank holding changes)
    max_parts: int = 1 << 16


# What an encoder keeps every frame and table within (a block ends each 4x this many bytes).
MAX_EXPANSION = CodecLimits.max_expansion


# Exponent classes (coding 3).

# Mantissa width in bits of each float dtype: an element's class is the low 4 bits of the
# exponent field just above it. Other dtypes have no exponent and cannot use coding 3.
MANTISSA_BITS: dict[torch.dtype, int] = {
    torch.bfloat16: 7,
    torch.float16: 10,
    torch.float32: 23,
    torch.float64: 52,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
}
N_CLASSES = 16
_CLASS_ROW = struct.Struct("<QBB")
_CLASS_TAIL = struct.Struct("<Q")
_CLASSED_HEAD = _CLASS_ROW.size * N_CLASSES + _CLASS_TAIL.size + 2 * _VALUE_HEAD.size
_COMPLEMENT, _GROUP = 1, 2
# Capped Rice codes (coding 4): a quotient of QCAP or more is written as QCAP zeros and a one,
# its value raw in RAW bits, so a far outlier (a sign flip near zero, an empty stretch of a
# class) costs 81 bits, not millions; parameters go up to MAX_K.
QCAP = 32
RAW = 48
MAX_K = 40
_MAX_RICE = 63
# A class whose changed fraction is at least this sends its values in group 1: there the step is
# large against the ulp and deltas span several ulps; elsewhere 99% are +-1. Measured on the
# built-in workload (1/64 .. 1): 1/2 gave the smallest patches at 1 and 8 steps.
GROUP1_FRACTION = 1 / 2
