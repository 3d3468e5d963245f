"""The simulator's heap on huge pages (simulations/hugepages.py): which ranges a sweep asks
the kernel to collapse, that it does collapse them where the kernel can, and that its thread
lives only inside."""

from __future__ import annotations

import ctypes
import threading

import pytest

from simulations.hugepages import HUGE, HugePages, anonymous_ranges

MAPS = """\
55d0c0000000-55d0c0a00000 r-xp 00000000 08:01 131 /usr/bin/python3.11
55d0c0a00000-55d0c0c00000 rw-p 00a00000 08:01 131 /usr/bin/python3.11
55d0c0c00000-55d0c1100000 rw-p 00000000 00:00 0 [heap]
7f0000100000-7f0000700000 rw-p 00000000 00:00 0
7f0000700000-7f0000800000 rw-p 00000000 00:00 0
7f0000800000-7f0000c00000 rw-s 00000000 00:01 7 /dev/zero (deleted)
7f0000c00000-7f0001000000 r--p 00000000 00:00 0
7ffc00000000-7ffc00400000 rw-p 00000000 00:00 0 [stack]
"""


def test_a_sweep_asks_for_the_aligned_spans_of_private_anonymous_memory_only() -> None:
    """File-backed, shared, read-only and stack mappings are left alone; a mapping is cut to
    the whole huge pages inside it (one smaller than that gives none)."""
    spans = list(anonymous_ranges(MAPS))
    heap = (0x55D0C0C00000, 0x55D0C1000000)  # its last 1 MiB is not a whole huge page
    anon = (0x7F0000200000, 0x7F0000600000)  # starts 1 MiB into one, ends 1 MiB into another
    assert spans == [heap, anon]
    assert all(lo % HUGE == 0 and hi % HUGE == 0 for lo, hi in spans)


def _huge_kb(buffer: bytearray) -> int:
    """AnonHugePages of the mapping that holds ``buffer``'s data (/proc/self/smaps)."""
    at = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                inside = lo <= at < hi
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1])
    return 0


def test_a_sweep_collapses_touched_memory_into_huge_pages_where_the_kernel_can() -> None:
    pages = HugePages()
    if not pages.supported:
        pytest.skip("no madvise to ask with: not Linux, or no /proc")
    buffer = bytearray(32 << 20)  # its own anonymous mapping
    buffer[::4096] = b"\x01" * len(buffer[::4096])  # every page touched
    going = pages.sweep()
    if not going:
        pytest.skip("this kernel has no MADV_COLLAPSE, or huge pages are off")
    for _ in range(3):  # a range the kernel had no huge page for just then: asked again
        if pages.collapsed >= 15:
            break
        pages.sweep()
    assert pages.collapsed >= 15  # the buffer alone spans at least 15 whole huge pages
    assert _huge_kb(buffer) >= 15 * 2048
    again = pages.collapsed
    assert pages.sweep() and pages.collapsed - again < again  # each range once, not anew


def test_the_sweeping_thread_runs_only_inside() -> None:
    def running() -> bool:
        return any(t.name == "huge-pages" for t in threading.enumerate())

    assert not running()
    with HugePages(period_s=0.001) as pages:
        assert running() == pages.supported
        assert not pages.supported or pages.swept.wait(timeout=30)
    assert not running()
