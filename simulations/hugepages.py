"""Huge pages for a large simulation's heap (Linux, kernel 6.1 and later).

A run touches its peers' scheduler tables at random, hundreds of MB of small Python objects,
and with 4 KiB pages most of those touches miss the TLB as well as the caches. Python's
allocator maps its arenas without asking for huge pages, and where the kernel hands them out
only on request (``transparent_hugepage=madvise``, the usual setting) none ever comes. So while
a run goes, a thread asks the kernel to collapse each 2 MiB range of the process's private
anonymous memory into a huge page (``madvise(MADV_COLLAPSE)``), each range once. The collapse
runs in that thread's system call, on the other core, and changes nothing the simulation
computes. Where the kernel cannot (no ``MADV_COLLAPSE``, or huge pages set to ``never``), it
refuses every range, and the thread stops. Figures and what else was tried:
docs/decisions/2026-11-29-the-simulators-heap-on-huge-pages.md.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import TracebackType

MADV_COLLAPSE = 25  # linux/mman.h
HUGE = 2 << 20  # one huge page (x86-64, arm64 with 4 KiB pages)
PERIOD_S = 1.0  # between sweeps: a run's heap grows for seconds, not microseconds
MAPS = "/proc/self/maps"


def anonymous_ranges(maps: str) -> Iterator[tuple[int, int]]:
    """The 2 MiB-aligned spans inside the private, writable, anonymous mappings (and the
    ``[heap]``) that ``maps`` (``/proc/self/maps``' text) lists."""
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[1] != "rw-p" or fields[5:] not in ([], ["[heap]"]):
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo = (lo + HUGE - 1) // HUGE * HUGE
        hi = hi // HUGE * HUGE
        if hi > lo:
            yield lo, hi


class HugePages:
    """While inside, a thread collapses the heap into huge pages every ``period_s``.
    ``collapsed``: the 2 MiB ranges it collapsed; ``swept``: set after each of its sweeps;
    ``supported``: False once the kernel refused every range as invalid, collapsing none
    (then the thread has stopped)."""

    def __init__(self, period_s: float = PERIOD_S) -> None:
        self.period_s = period_s
        self.collapsed = 0
        self._done: set[int] = set()  # ranges collapsed (or refused for good), still mapped
        self._stop = threading.Event()
        self.swept = threading.Event()
        self._thread: threading.Thread | None = None
        self._madvise = _madvise() if sys.platform == "linux" else None
        self.supported = self._madvise is not None

    def __enter__(self) -> HugePages:
        if self._madvise is not None:
            self._thread = threading.Thread(target=self._sweeps, name="huge-pages", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _sweeps(self) -> None:
        while not self._stop.wait(self.period_s):
            going = self.sweep()
            self.swept.set()
            if not going:
                return

    def sweep(self) -> bool:
        """Collapse the ranges not collapsed yet; False if the kernel cannot at all."""
        try:
            with open(MAPS) as f:
                maps = f.read()
        except OSError:
            self.supported = False
            return False
        live, tried, invalid = set(), 0, 0
        for lo, hi in anonymous_ranges(maps):
            for at in range(lo, hi, HUGE):
                live.add(at)
                if at in self._done or self._stop.is_set():
                    continue
                tried += 1
                failed = self._collapse(at)
                if failed == errno.EINVAL:  # a range the kernel will never collapse
                    invalid += 1
                    self._done.add(at)
                elif not failed:
                    self._done.add(at)
                    self.collapsed += 1
        self._done &= live  # unmapped since: a new mapping there is tried anew
        if tried and invalid == tried and not self.collapsed:
            self.supported = False
        return self.supported

    def _collapse(self, at: int) -> int:
        """0, or the errno of a refusal (EAGAIN and ENOMEM: tried again next sweep)."""
        assert self._madvise is not None
        if self._madvise(at, HUGE, MADV_COLLAPSE) == 0:
            return 0
        return ctypes.get_errno() or errno.EINVAL


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, or None where it cannot be found."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn if os.path.exists(MAPS) else None
