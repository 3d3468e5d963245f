"""Per-tensor work spread over a few threads.

The heavy per-tensor steps (numpy compares, numba kernels, zstd) release the GIL, so a small
thread pool uses the cores without copying tensors to other processes.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
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


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """The CPUs a cgroup v2 quota allows (``cpu.max``: "QUOTA PERIOD", rounded up), or None
    where there is no quota ("max") or no such file."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Threads worth running for per-tensor work: the cores this process may run on (its
    affinity mask), capped by a container's CPU quota. ``os.cpu_count()`` counts the host's
    cores: in a container limited to 4 CPUs of a 128-core host it would start 128 threads,
    each holding per-thread buffers (memory) and contending for 4 CPUs (time)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpus(cpu_max)
    return max(1, min(cores or 1, quota or cores or 1))


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
