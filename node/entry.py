"""The ``p2psync`` command (and ``python -m node``): the CLI, its imports made with the
garbage collector off.

Why: a node's imports (torch alone takes ~2 s) allocate millions of objects and free almost
none, and Python's collector, run every 700 allocations, spent 0.6-0.9 s of each 4.3-4.7 s
start on them (3.4-4.1 s with it off). So they run with it off; what they made is frozen out
of every later collection (``gc.freeze``: module objects are never garbage, and a full
collection no longer walks them), and the collector is on again for the node's own work.
"""

from __future__ import annotations

import gc


def main(argv: list[str] | None = None) -> int:
    enabled = gc.isenabled()
    gc.disable()
    try:
        from node.cli import main as cli
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    return cli(argv)
