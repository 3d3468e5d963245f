"""Per-tensor work spread over a few threads.

The heavy per-tensor steps (numpy compares, numba kernels, zstd) release the GIL, so a small
thread pool uses the cores without copying tensors to other processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_workers(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]``, ``workers`` at a time when there is more than one."""
    items = list(items)
    if workers > 1 and len(items) > 1:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]
