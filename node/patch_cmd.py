"""`p2psync patch create|apply|inspect`: their flags. The commands themselves
(``node.patching``) are imported when one runs: ``--help`` and the other commands do without
torch and the codec."""

from __future__ import annotations

import argparse
from pathlib import Path

from node.lazy import command

DEFAULT_LEVEL = 1  # the codec's (``p2p_sync.codec.DEFAULT_LEVEL``: a test holds them equal)


def add_parser(sub: argparse._SubParsersAction) -> None:
    patch = sub.add_parser("patch", help="create, apply or inspect a patch between weight files")
    psub = patch.add_subparsers(dest="patch_command", required=True, metavar="COMMAND")
    _add_create(psub)
    _add_apply(psub)
    _add_inspect(psub)


def _add_create(psub: argparse._SubParsersAction) -> None:
    """`patch create`: the base and new weights in, a patch out."""
    create = psub.add_parser("create", help="write the patch that turns --base into --new")
    create.add_argument("--base", type=Path, required=True, help="base weights (.safetensors)")
    create.add_argument("--new", type=Path, required=True, help="new weights (.safetensors)")
    create.add_argument("--out", type=Path, required=True, help="patch file to write")
    create.add_argument(
        "--level",
        type=int,
        default=DEFAULT_LEVEL,
        choices=range(1, 23),
        metavar="1-22",
        help="zstd level (default %(default)s)",
    )
    create.add_argument(
        "--format",
        type=int,
        default=2,
        choices=[1, 2, 3],
        help="1: positions by gaps; 2: by the base's exponent classes; 3: by exponent class per "
        "segment, no zstd (the GPU's format); default %(default)s",
    )
    _add_run_options(create)
    create.set_defaults(func=command("node.patching", "cmd_create"))


def _add_apply(psub: argparse._SubParsersAction) -> None:
    """`patch apply`: base weights and a patch in, the patched weights out."""
    app = psub.add_parser("apply", help="apply a patch to --base and write --out")
    app.add_argument("--base", type=Path, required=True, help="base weights (.safetensors)")
    app.add_argument("--patch", type=Path, required=True, help="patch file")
    app.add_argument("--out", type=Path, required=True, help="patched weights to write")
    _add_run_options(app)
    app.set_defaults(func=command("node.patching", "cmd_apply"))


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """Where create and apply load the weights, and how many threads code the frames."""
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    p.add_argument("--workers", type=int, default=1, help="threads for frames (default 1)")


def _add_inspect(psub: argparse._SubParsersAction) -> None:
    """`patch inspect`: what a patch holds, checked in full with --verify."""
    insp = psub.add_parser("inspect", help="show what a patch contains")
    insp.add_argument("file", type=Path, help="patch file")
    insp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    insp.add_argument("--verify", action="store_true", help="also decode and check every frame")
    insp.add_argument(
        "--base",
        type=Path,
        help="with --verify: the base weights (exponent-class frames decode against them; "
        "without it, everything else is checked)",
    )
    insp.set_defaults(func=command("node.patching", "cmd_inspect"))
