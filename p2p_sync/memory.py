"""Giving memory back to the OS between and during applies: freed heap, mapped file pages.

A rollout holds the model (1.0x) and little else, so what it briefly holds beside it sets its
peak RSS. Two things count there that the code no longer uses (1B model, 2 rollouts,
``benchmarks/scale.py``, 2026-11-29):

* **Freed heap.** glibc keeps what a download's or a decode's buffers freed in its arenas
  (72 MiB after a 1.9 GB snapshot's download, ~50 MiB after a patch's decode on two threads),
  counted in the RSS until ``malloc_trim`` hands it back; the next apply's temporaries came on
  top of it.
* **Mapped pack pages.** A patch is read from its mapped pack (no copy); every page read
  stays mapped, and counted, until the map goes: the whole patch (52 MiB) through the apply.
  ``MADV_DONTNEED`` drops them from the process once read; the page cache keeps them, so a
  later read is a minor fault, not a disk read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from functools import cache


@cache
def _malloc_trim() -> object | None:
    """glibc's ``malloc_trim``, or None (another C library: nothing to trim this way)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (every arena: each worker thread has one).
    A few milliseconds; call it where a large batch of temporaries has just been freed."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]


def release_pages(view: memoryview, start: int = 0, stop: int | None = None) -> None:
    """Unmap from this process the pages of ``view[start:stop]`` (widened to whole pages)
    when ``view`` is a whole read-only file map (``mmap``); otherwise nothing. The bytes stay
    readable: a later read maps them again from the page cache. A read fault maps the cached
    pages around it too (fault-around, large folios): up to ~1.5 MiB of a 52 MB pack stayed
    mapped past its release, read in order (against all of it)."""
    mapped = view.obj
    if not isinstance(mapped, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if mapped.closed or view.nbytes != len(mapped):  # a slice: its offsets are not the map's
        return
    stop = len(view) if stop is None else min(stop, len(view))
    lo = start - start % mmap.PAGESIZE
    if lo < stop:
        mapped.madvise(mmap.MADV_DONTNEED, lo, stop - lo)
