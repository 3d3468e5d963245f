"""A process's memory as the kernel counts it, for the benchmarks' peak-RSS figures."""

from __future__ import annotations

from pathlib import Path


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS`` now, ``VmHWM`` the peak since the last
    reset: write "5" to ``/proc/self/clear_refs``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)
