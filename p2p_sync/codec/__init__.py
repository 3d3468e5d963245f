"""The patch wire format: encode and decode patch files.

The format's specification is docs/format.md; the code follows it. The package splits by
concern: :mod:`limits` (constants and bounds), :mod:`values` and :mod:`positions` (the two
stream codings), :mod:`classes`, :mod:`rice` and :mod:`classed` (coding 3, exponent classes),
:mod:`bitstreams`, :mod:`segment_scans`, :mod:`segment_host` and :mod:`segmented` (coding 4,
exponent classes per segment), :mod:`kernels` and :mod:`rice_kernels` (host loops numba
compiles), :mod:`compression` (zstd frames), :mod:`table` (header and row table),
:mod:`frames` (one tensor) and :mod:`container` (whole patches). The names callers use are
re-exported here: ``from p2p_sync import codec; codec.encode(...)``.
"""

from __future__ import annotations

from p2p_sync import jit
from p2p_sync.codec import device_scans
from p2p_sync.codec.classed import _classed_streams
from p2p_sync.codec.classes import (
    Bits,
    ClassMap,
    class_map,
    class_ranks,
    class_select,
    classed_dtype,
    element_classes,
    scan_ranks,
    scan_select,
    segmented_dtype,
)
from p2p_sync.codec.compression import _compress
from p2p_sync.codec.container import (
    _base_bits,
    assemble,
    check_without_base,
    decode,
    encode,
    scan_view,
)
from p2p_sync.codec.device_scans import Selected
from p2p_sync.codec.frames import Frame, decode_frame, decode_frame_blocks, encode_frame
from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.limits import (
    _CLASSED_HEAD,
    _SPARSE_HEAD,
    _VALUE_HEAD,
    BASED,
    BLOCK,
    CLASSED,
    CLASSED_MIN_SAVING,
    CLASSED_VALUE_BITS,
    CODINGS_BY_VERSION,
    DEFAULT_LEVEL,
    DENSE,
    DENSE_TRY_FRACTION,
    FORMAT_VERSION,
    GROUP1_FRACTION,
    HEADER_SIZE,
    MAGIC,
    MANTISSA_BITS,
    MAX_EXPANSION,
    N_CLASSES,
    PART_CODINGS,
    PARTS,
    SEGMENTED,
    SPARSE,
    SUPPORTED_VERSIONS,
    UNCHANGED,
    VALUE_BITS,
    CodecLimits,
)
from p2p_sync.codec.parts import join_parts, read_parts
from p2p_sync.codec.positions import decode_positions, encode_positions
from p2p_sync.codec.rice import _class_codes, _ClassCodes
from p2p_sync.codec.table import FrameInfo, Frames, PatchInfo, _row_bytes, read_header
from p2p_sync.codec.values import _decode_value_body, _value_head, decode_values, encode_values
from p2p_sync.weights.tensors import TensorSpec

__all__ = [
    "BASED",
    "BLOCK",
    "CLASSED",
    "CLASSED_MIN_SAVING",
    "CLASSED_VALUE_BITS",
    "CODINGS_BY_VERSION",
    "DEFAULT_LEVEL",
    "DENSE",
    "DENSE_TRY_FRACTION",
    "FORMAT_VERSION",
    "GROUP1_FRACTION",
    "HEADER_SIZE",
    "MAGIC",
    "MANTISSA_BITS",
    "MAX_EXPANSION",
    "N_CLASSES",
    "PARTS",
    "PART_CODINGS",
    "SEGMENTED",
    "SPARSE",
    "SUPPORTED_VERSIONS",
    "UNCHANGED",
    "VALUE_BITS",
    "Bits",
    "ClassMap",
    "CodecLimits",
    "Frame",
    "FrameInfo",
    "Frames",
    "PatchInfo",
    "Selected",
    "TensorSpec",
    "assemble",
    "check_without_base",
    "class_map",
    "class_ranks",
    "class_select",
    "classed_dtype",
    "decode",
    "decode_frame",
    "decode_frame_blocks",
    "decode_positions",
    "decode_values",
    "device_scans",
    "element_classes",
    "encode",
    "encode_frame",
    "join_parts",
    "read_parts",
    "encode_positions",
    "encode_values",
    "jit",
    "read_header",
    "scan_ranks",
    "scan_select",
    "scan_view",
    "segmented_dtype",
    # internals the tests reach through the package
    "_CLASSED_HEAD",
    "_SPARSE_HEAD",
    "_VALUE_HEAD",
    "_ClassCodes",
    "_base_bits",
    "_class_codes",
    "_classed_streams",
    "_compress",
    "_decode_value_body",
    "_kernels",
    "_row_bytes",
    "_value_head",
]
