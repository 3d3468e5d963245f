"""`p2psync keygen` and `p2psync inspect`: keys, and a readable view of manifests and patches."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

from node.errors import read_input
from node.lazy import imported
from p2p_sync.trust import manifest
from p2p_sync.trust.keys import SigningKey, load_public_key, write_keypair
from p2p_sync.trust.trusted import TrustedSet

PATCH_MAGIC = b"P2PPATCH"  # a patch file's first bytes (``codec.MAGIC``: a test keeps them equal)


def cmd_keygen(args: argparse.Namespace) -> int:
    key = SigningKey.generate()
    pub = write_keypair(key, args.out, force=args.force)
    print(f"wrote {args.out} (private, mode 0600) and {pub}")
    print(key.public.text())
    return 0


def policy_from_args(args: argparse.Namespace) -> manifest.SwarmPolicy:
    keys = tuple(load_public_key(k) for k in args.trust)
    try:
        return manifest.SwarmPolicy(args.swarm, keys, args.threshold)
    except ValueError as exc:
        raise manifest.MalformedManifestError(f"--threshold: {exc}") from None


def _when(ts: int) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _print_manifest(path: Path, m: manifest.Manifest, sigs: list[dict], verdict: str) -> None:
    base = f"v{m.base_version} ({m.base_state})" if m.kind == manifest.PATCH else "-"
    print(f"{path}: p2psync manifest, {verdict}")
    for label, value in [
        ("swarm", m.swarm),
        ("version", m.version),
        ("kind", m.kind),
        ("base", base),
        ("target state", m.target_state),
        ("layout", m.layout),
        ("codec", m.codec),
        ("payload", f"{m.payload_size:,} bytes in {len(m.chunks)} chunk(s) of {m.chunk_size:,}"),
        ("created", _when(m.created)),
        ("expires", _when(m.expires)),
        ("digest", m.digest),
    ]:
        print(f"  {label:<13}{value}")
    for s in sigs:
        print(f"  signature    key {s['keyid'][:16]}...")


def cmd_inspect(args: argparse.Namespace) -> int:
    data = read_input(args.file, "manifest or patch")
    if data.startswith(PATCH_MAGIC):  # the codec (torch) only for a patch: a manifest needs none
        args.json, args.verify = False, True
        return int(imported("node.patching").cmd_inspect(args))
    m, sigs = manifest.parse(data)
    verdict = "NOT verified (pass --trust and --swarm to verify)"
    if args.trust:
        policy = policy_from_args(args)
        TrustedSet(policy).authentic(data, time.time())
        verdict = f"verified: signed by the trusted key(s) of swarm {args.swarm!r}"
    if args.json:
        print(json.dumps({"verified": bool(args.trust), "signed": m.signed()}, indent=1))
    else:
        _print_manifest(args.file, m, sigs, verdict)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    keygen = sub.add_parser("keygen", help="create an Ed25519 signing key for a trainer")
    keygen.add_argument("--out", type=Path, required=True, help="private key file (+ .pub)")
    keygen.add_argument("--force", action="store_true", help="overwrite existing files")
    keygen.set_defaults(func=cmd_keygen)

    insp = sub.add_parser("inspect", help="show a manifest or a patch in readable form")
    insp.add_argument("file", type=Path)
    insp.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="KEY_OR_PUBFILE",
        help="trusted public key (repeatable); verifies the manifest",
    )
    insp.add_argument("--swarm", default="default", help="swarm name (default: %(default)s)")
    insp.add_argument("--threshold", type=int, default=1, help="signatures needed (default 1)")
    insp.add_argument("--json", action="store_true", help="print JSON")
    insp.set_defaults(func=cmd_inspect)
