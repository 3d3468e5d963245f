"""The ``p2psync`` command (and ``python -m node``): the CLI, its imports made with the
garbage collector off and frozen (``node.lazy``), as are those of the command that runs."""

from __future__ import annotations

from node.lazy import imported


def main(argv: list[str] | None = None) -> int:
    cli = imported("node.cli")
    return int(cli.main(argv))
