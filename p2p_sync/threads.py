"""Per-tensor work spread over a few threads.

The heavy per-tensor steps (numpy compares, numba kernels, zstd) release the GIL, so a small
thread pool uses the cores without copying tensors to other processes.
"""

from __future__ import annotations

import os
import sys
import threading
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


BACKGROUND_NICE = 10  # nice 10 weighs ~1/10 of nice 0 in Linux's scheduler


def lower_priority(by: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux: a thread's nice value is its
    own, and threads it starts inherit it). Elsewhere, or without permission, nothing."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        pass


def background_pool() -> ThreadPoolExecutor:
    """One fresh thread at lower CPU priority, for work that must not slow the latency path
    (merged catch-up patches while rollouts fetch and apply the head). A fresh pool, as a
    thread's nice value cannot be lowered back without privileges: a pooled thread would keep
    it for whatever work it runs next."""
    return ThreadPoolExecutor(
        1, thread_name_prefix="p2psync-background", initializer=lower_priority
    )
