"""Settings tables: a frozen dataclass of limits filled from a TOML table, and checked.

A node's config (``p2p_sync.runtime.config``) and a simulation scenario (``simulations.scenario``)
are both trees of the limit dataclasses the code takes (``SwarmConfig``, ``HttpLimits``...).
This module is what they share: filling one from a table of its field names, with the
default's type, and the rule that a numeric limit is positive (a count at least 1) unless 0
means "none". Errors are ``ValueError("<table>.<field>: why")``; the caller adds its own prefix
and exception type.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

T = TypeVar("T")


def typed(name: str, value: Any, default: Any) -> Any:
    """``value`` if it has the default's type (an int where a float is expected is fine; a
    bool is neither). A default of None says nothing of the type: anything goes."""
    if default is None:
        return value
    if isinstance(value, bool) != isinstance(default, bool):
        raise ValueError(f"{name}: expected {type(default).__name__}, got {value!r}")
    if isinstance(value, type(default)):
        return value
    if isinstance(default, float) and isinstance(value, int):
        return float(value)
    raise ValueError(f"{name}: expected {type(default).__name__}, got {value!r}")


def from_table(name: str, base: T, table: Any, coerce: Any = None) -> T:
    """``base`` with the fields ``table`` names replaced (``table`` may also be a ``base``
    instance). ``coerce(path, value)`` may convert values first (lists to tuples...)."""
    if isinstance(table, type(base)):
        return table
    if not isinstance(table, dict):
        raise ValueError(f"{name}: expected a table of settings")
    known = {f.name: getattr(base, f.name) for f in fields(base)}  # type: ignore[arg-type]
    changes = {}
    for key, value in table.items():
        path = f"{name}.{key}"
        if key not in known:
            raise ValueError(f"{path}: unknown setting")
        value = coerce(path, value) if coerce is not None else value
        changes[key] = typed(path, value, known[key])
    try:
        return replace(base, **changes)  # type: ignore[type-var]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {exc}") from None


def check_numbers(name: str, limits: Any, zero_ok: frozenset[str] = frozenset()) -> None:
    """Every numeric field of ``limits`` is positive, counts at least 1; the fields named in
    ``zero_ok`` may be 0 (it means "none" there) but not negative."""
    for f in fields(limits):
        path, x = f"{name}.{f.name}", getattr(limits, f.name)
        if isinstance(x, bool) or not isinstance(x, int | float):
            continue
        if f.name in zero_ok:
            if x < 0:
                raise ValueError(f"{path}: must be >= 0 (0 means none)")
        elif isinstance(x, int) and x < 1:
            raise ValueError(f"{path}: must be >= 1")
        elif not x > 0:
            raise ValueError(f"{path}: must be positive")
