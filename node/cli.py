"""The `p2psync` command line: one parser, one handler per command, one-line errors.

Every failure a user can cause (a bad file, a patch for another base, a bad flag) ends with
``p2psync: error: <what is wrong>`` on stderr and a non-zero exit: 2 for usage errors (argparse's
convention) and for a node that could not start (a port in use, a bad setting, an unreadable
key, a missing watch dir), 1 for everything else. Tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from node import member_cmd, node_cmd, patch_cmd, sim_cmd, trust_cmd
from node.errors import UsageError
from p2p_sync import __version__
from p2p_sync.errors import P2PSyncError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2psync",
        description="Lossless sparse weight patches, distributed peer to peer.",
    )
    parser.add_argument("--version", action="version", version=f"p2psync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    patch_cmd.add_parser(sub)
    trust_cmd.add_parsers(sub)
    member_cmd.add_parsers(sub)
    node_cmd.add_parsers(sub)
    sim_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (node_cmd.StartupError, UsageError) as exc:
        print(f"p2psync: error: {exc}", file=sys.stderr)
        return 2
    except P2PSyncError as exc:
        print(f"p2psync: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("p2psync: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
