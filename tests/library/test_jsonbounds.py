"""The bounded JSON loader: refuses nesting bombs and numbers of thousands of digits with its
own errors, before ``json`` recurses or converts; takes every document within the bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_sync.errors import HostileJsonError, MalformedJsonError, P2PSyncError
from p2p_sync.jsonbounds import JsonLimits, loads

LIMITS = JsonLimits()
# strings full of what the scan counts (brackets, digits, quotes and backslashes escaped)
TRICKY = st.text(alphabet='[]{}"\\0123456789 é\n', max_size=80)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TRICKY,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(TRICKY, inner, max_size=6),
    max_leaves=40,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def nested(levels: int, leaf: str) -> str:
    """``leaf`` inside ``levels`` brackets, lists and objects taking turns."""
    opens = "".join('{"k":' if i % 2 else "[" for i in range(levels))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(levels)))
    return opens + leaf + closes


@settings(max_examples=60, deadline=None)
@given(JSON_VALUES)
def test_every_document_within_the_bounds_loads_as_json_does(value: Any) -> None:
    text = json.dumps(value)
    if depth(value) <= LIMITS.max_depth:
        assert loads(text.encode()) == json.loads(text) == loads(text)


@settings(max_examples=150, deadline=None)
@given(
    levels=st.integers(0, 3000),
    digits=st.integers(1, 6000),
    padding=st.lists(TRICKY.map(json.dumps), max_size=4),
)
def test_nesting_and_number_length_are_refused_exactly_past_the_limits(
    levels: int, digits: int, padding: list[str]
) -> None:
    """Brackets and digits inside strings do not count; those outside do, one too many is
    refused with HostileJsonError (never RecursionError, or int()'s 4,300-digit ValueError)."""
    leaf = "[" + ",".join([*padding, "1" + "0" * (digits - 1)]) + "]"
    doc = nested(levels, leaf).encode()
    if levels + 1 > LIMITS.max_depth or digits > LIMITS.max_digits:
        with pytest.raises(HostileJsonError):
            loads(doc)
    else:
        assert depth(loads(doc)) == levels + 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(alphabet='[]{}",:-.0123456789eE\\ nulltrue', max_size=300))
def test_any_input_loads_or_raises_only_the_projects_json_errors(data: bytes | str) -> None:
    try:
        loads(data)
    except MalformedJsonError as exc:
        assert isinstance(exc, P2PSyncError) and isinstance(exc, ValueError)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested 100000 deep"),
        (b"]" + b"[" * 5_000, "nested"),  # unbalanced: json would recurse before failing
        (b'{"a": ' + b"9" * 5_000 + b"}", "more than 40 digits"),
        (b"-" + b"9" * 41, "more than 40 digits"),
        (b"1e" + b"9" * 41, "more than 40 digits"),
    ],
)
def test_hostile_documents_are_named_for_what_they_exceed(doc: bytes, message: str) -> None:
    with pytest.raises(HostileJsonError, match=message):
        loads(doc)


def test_not_json_is_malformed_not_hostile() -> None:
    for doc in (b"\xff{", b"[1,2", b'{"a": tru}', b""):
        with pytest.raises(MalformedJsonError, match="not JSON") as exc:
            loads(doc)
        assert not isinstance(exc.value, HostileJsonError)


def test_limits_come_from_the_dataclass() -> None:
    tight = JsonLimits(max_depth=2, max_digits=3, max_bytes=20)
    assert loads(b"[[1]]", tight) == [[1]]
    for doc in (b"[[[1]]]", b"[1000]", b"[" + b" " * 20 + b"]"):
        with pytest.raises(HostileJsonError):
            loads(doc, tight)
