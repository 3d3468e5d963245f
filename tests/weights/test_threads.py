"""Worker threads: the background pool runs below the caller's CPU priority."""

from __future__ import annotations

import os
import threading

from p2p_sync.weights.threads import BACKGROUND_NICE, background_pool, map_workers


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_background_work_and_its_workers_run_niced_and_the_caller_does_not() -> None:
    """A catch-up merge spreads over worker threads: they inherit the lowered priority, and
    the thread that asked (the event loop's) keeps its own."""
    before = _nice()
    with background_pool() as pool:
        outer, inner = pool.submit(
            lambda: (_nice(), map_workers(lambda _: _nice(), [1, 2], 2))
        ).result()
    assert outer == min(19, before + BACKGROUND_NICE) and inner == [outer, outer]
    assert _nice() == before
    with background_pool() as pool:  # a fresh thread each time: priorities do not add up
        assert pool.submit(_nice).result() == outer


def test_usable_cores_follow_the_affinity_mask_and_a_container_quota(tmp_path) -> None:
    """A container limited to 1.5 CPUs of a bigger host gets 2 threads, not one per host
    core; no quota ("max"), a missing file or a garbled one leave the affinity mask's count."""
    from p2p_sync.weights.threads import cgroup_cpus, usable_cores

    mask = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cgroup_cpus(cpu_max) == 2
    assert usable_cores(cpu_max) == min(mask, 2)
    cpu_max.write_text("1000 100000\n")  # a hundredth of a CPU is still one thread
    assert usable_cores(cpu_max) == 1
    for text in ("max 100000\n", "garbled\n"):
        cpu_max.write_text(text)
        assert cgroup_cpus(cpu_max) is None and usable_cores(cpu_max) == mask
    assert usable_cores(tmp_path / "absent") == mask
