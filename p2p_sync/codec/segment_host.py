"""Coding 4's code streams read on the host: two compiled passes instead of torch ops.

:func:`read_host` gives what :func:`p2p_sync.codec.segmented.read_codes` computes with torch
ops on a device (each change's segment, class, rank and magnitude, in code order), by the
sequential kernels of :mod:`p2p_sync.codec.rice_kernels`: on a CPU a loop over the codes
costs a few nanoseconds each, the torch ops' gathers and repeats ten times that. The same
checks refuse the same frames (tests run both).
"""

from __future__ import annotations

import numpy as np

from p2p_sync.codec.kernels import _kernels
from p2p_sync.codec.rice_kernels import (
    COUNTS_OVER,
    ESCAPES_OVER,
    FIELDS_END,
    INDEX_PAST,
    NOT_CANONICAL,
    PAST_CAP,
    RANK_PAST,
    UNARY_ENDS,
)
from p2p_sync.errors import CountMismatchError, IndexOutOfRangeError, MalformedPatchError

_ERRORS = {
    UNARY_ENDS: (CountMismatchError, "unary stream ends before its last code"),
    PAST_CAP: (MalformedPatchError, "a unary code runs past its cap"),
    FIELDS_END: (CountMismatchError, "remainder stream ends inside its fields"),
    NOT_CANONICAL: (MalformedPatchError, "a raw Rice code holds a value coded in short"),
    COUNTS_OVER: (CountMismatchError, "group counts do not add up within a segment"),
    ESCAPES_OVER: (CountMismatchError, "a group escapes more values than it changes"),
    RANK_PAST: (IndexOutOfRangeError, "a class rank runs past the end of its segment"),
    INDEX_PAST: (IndexOutOfRangeError, "an escape index runs past the end of its group"),
}


def _check(status: int, name: str) -> None:
    if status:
        error, what = _ERRORS[status]
        raise error(f"{name}: {what}")


def _check_tail(unary: np.ndarray, at: int, name: str) -> None:
    """After the last code only fewer than 8 zero bits may follow in the unary stream."""
    if np.unpackbits(unary, bitorder="little")[at:].any():
        raise CountMismatchError(f"{name}: unary stream holds codes past the last")
    if unary.size * 8 - at >= 8:
        raise MalformedPatchError(f"{name}: unary stream runs on past its last code")


def read_host(
    unary: np.ndarray,
    rem: np.ndarray,
    k: np.ndarray,
    wide: np.ndarray,
    sizes: np.ndarray,
    count: int,
    name: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(segment, class, rank, magnitude) of every change in code order, and the remainder
    bits read. ``k``: the (16, 5) parameters, ``wide``: each class's mode, ``sizes``: each
    segment's length."""
    kernels, at = _kernels(), np.zeros(2, np.int64)
    groups = np.zeros(sizes.size * 16, np.int64)
    _check(kernels["segment_counts"](unary, rem, k, sizes, groups, at), name)
    if int(groups.sum()) != count:
        raise CountMismatchError(f"{name}: group counts do not add up to {count} changes")
    rank, mag = np.empty(count, np.int64), np.zeros(count, np.int64)
    _check(kernels["segment_codes"](unary, rem, k, wide, sizes, groups, at, rank, mag), name)
    _check_tail(unary, int(at[0]), name)
    col = np.arange(groups.size, dtype=np.int64)
    return np.repeat(col >> 4, groups), np.repeat(col & 15, groups), rank, mag, int(at[1])
