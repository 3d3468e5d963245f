"""Worker threads: the background pool runs below the caller's CPU priority."""

from __future__ import annotations

import os
import threading

from p2p_sync.threads import BACKGROUND_NICE, background_pool, map_workers


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
