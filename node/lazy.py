"""Commands imported when they run: a handler named by its module, so that building the parser
(and ``p2psync --help``, and every light command) imports none of the heavy ones' modules.

The imports run with the cyclic collector off, and what they made is frozen out of every later
collection (``gc.freeze``): a node's imports (torch alone takes ~2 s) allocate millions of
objects and free almost none, and the collector, run every 700 allocations, spent 0.6-0.9 s of
each 4.3-4.7 s start on them. Module objects are never garbage, so a full collection need not
walk them; the collector is on again for the command's own work.
"""

from __future__ import annotations

import argparse
import gc
import importlib
from collections.abc import Callable
from types import ModuleType


def imported(module: str) -> ModuleType:
    """``module``, imported with the collector off and what it made frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(module)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The handler ``module.name``, imported (:func:`imported`) on its first call."""

    def run(args: argparse.Namespace) -> int:
        handler: Callable[[argparse.Namespace], int] = getattr(imported(module), name)
        return handler(args)

    run.__qualname__ = run.__name__ = name
    return run
