"""Bounded JSON: how p2psync parses every JSON document a peer or a file hands it.

``json.loads`` recurses once per nesting level and converts integers of any length (quadratic
time, and a bare ValueError past 4,300 digits); neither failure is a parser error of ours, so a
hostile document escaped the error hierarchy. Here a document is measured before ``json`` sees
it: one past :class:`JsonLimits` raises :class:`HostileJsonError`, one that is not JSON
:class:`MalformedJsonError` (both ValueErrors, as ``json.loads`` raised).

Why a scan and not a lowered recursion limit: that limit is the whole interpreter's (threads
decode patches meanwhile) and fires at a depth that depends on the caller's stack. The scan runs
in C: ``bytes.translate`` keeps the brackets, whose running count is the depth, and maps every
digit to one, so a long number is a substring search. Brackets and digits inside strings count
too, an upper bound; only a document that fails it gets its strings blanked and is measured
again. Numbers are bounded in that pass, not by ``parse_int``: a hook is a Python call per
number, and a have-map lists thousands.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2p_sync.errors import HostileJsonError, MalformedJsonError

__all__ = ["HostileJsonError", "JsonLimits", "MalformedJsonError", "check", "loads"]


@dataclass(frozen=True)
class JsonLimits:
    """The most any p2psync document needs, with room to spare (each parser also bounds the
    bytes it takes, tighter: ``ManifestLimits.max_manifest_bytes``, ``HttpLimits``...)."""

    max_depth: int = 32  # p2psync's documents nest 4 deep at most (a /status answer)
    max_digits: int = 40  # digits in a row in a number: a u64 takes 20, a float's repr 17
    max_bytes: int = 100 * 2**20  # a safetensors header, the largest document read


LIMITS = JsonLimits()

# a JSON string literal: no backtracking (the two alternatives never start alike). UTF-8 never
# puts an ASCII byte inside a multi-byte character, so scanning the bytes is exact.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_STEP = np.full(256, -1, np.int64)  # a bracket's step in nesting depth: +1 opens, -1 closes
_STEP[[ord("["), ord("{")]] = 1


def _depth(data: bytes, limit: int) -> int:
    """The deepest nesting of brackets in ``data`` (0 when it cannot exceed ``limit``): the
    running count of openers less closers. Up to the first bracket ``json`` would refuse
    (a closer of the wrong kind, or one too many) that count is ``json``'s own depth, and
    ``json`` stops there, so the maximum is never below the depth ``json`` would reach."""
    brackets = data.translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= limit:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(brackets, np.uint8)]).max(initial=0))


def _digit_run(data: bytes, limit: int) -> bool:
    """Whether ``data`` holds more than ``limit`` decimal digits in a row."""
    return b"0" * (limit + 1) in data.translate(_DIGITS_AS_ZERO)


def check(data: bytes, limits: JsonLimits = LIMITS) -> None:
    """Raise :class:`HostileJsonError` if the JSON text ``data`` nests deeper than
    ``max_depth`` or holds a number of more than ``max_digits`` digits in a row. Linear time,
    no recursion. Strings are blanked only when the raw text fails (brackets and digits
    inside strings counted too give an upper bound, enough for nearly every document)."""
    deep = _depth(data, limits.max_depth) > limits.max_depth
    long = _digit_run(data, limits.max_digits)
    if not (deep or long):
        return
    skeleton = _STRING.sub(b'""', data)
    if deep and (depth := _depth(skeleton, limits.max_depth)) > limits.max_depth:
        raise HostileJsonError(f"JSON nested {depth} deep, limit {limits.max_depth}")
    if long and _digit_run(skeleton, limits.max_digits):
        raise HostileJsonError(f"a JSON number with more than {limits.max_digits} digits")


def loads(data: bytes | bytearray | memoryview | str, limits: JsonLimits = LIMITS) -> Any:
    """``json.loads`` of UTF-8 ``data`` within ``limits``: HostileJsonError past them,
    MalformedJsonError if not JSON. Nothing else escapes."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > limits.max_bytes:
        raise HostileJsonError(f"{len(raw)} bytes of JSON, limit {limits.max_bytes}")
    check(raw, limits)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise MalformedJsonError(f"not JSON (not UTF-8: {exc.reason} at {exc.start})") from None
    except ValueError as exc:  # JSONDecodeError (a number past the scan cannot get here)
        raise MalformedJsonError(f"not JSON ({exc})") from None
