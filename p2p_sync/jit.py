"""Numba on first use, for the host kernels of ``codec`` and ``statehash``.

A kernel is a plain Python function that numba compiles the first time it is needed (importing
numba costs ~0.3 s, which a command that never scans should not pay). The steps a kernel calls
are plain functions too, marked with :func:`step`: :func:`compile_kernels` compiles them first,
to be inlined where they are called, and puts them in their module in place of the Python
function, so the kernels find the compiled step by its name. Without numba nothing is replaced,
and kernels and steps still run (slowly) as Python.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_STEPS: list[Callable] = []
_LOCK = threading.Lock()


def step(f: F) -> F:
    """Mark ``f`` as a step of a kernel, compiled (inlined into its callers) with the kernels."""
    _STEPS.append(f)
    return f


def _bind_steps(njit: Callable) -> None:
    """Put each step's compiled form in its module, where the kernels look their steps up."""
    with _LOCK:
        for f in _STEPS:
            module = sys.modules[f.__module__]
            if getattr(module, f.__name__) is f:
                setattr(module, f.__name__, njit(inline="always", nogil=True)(f))


def compile_kernels(kernels: dict[str, Callable]) -> dict[str, Callable] | None:
    """``kernels`` compiled by numba (lazily, cached on disk where it can be), or None when
    numba is missing."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; this keeps a fallback
        return None
    _bind_steps(numba.njit)
    try:
        return {k: numba.njit(cache=True, nogil=True)(f) for k, f in kernels.items()}
    except RuntimeError:  # no writable cache location: compile in memory each process
        return {k: numba.njit(nogil=True)(f) for k, f in kernels.items()}
