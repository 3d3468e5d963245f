"""Private swarms from the command line: `p2psync swarm init`, `identity`, `admit`, `revoke`.

The admin (holding the swarm's admin key, a ``p2psync keygen`` key: the trainer's or another)
creates the swarm CA and an empty revocation list once, admits each node by its peer id (which
inlines its identity key, so nothing secret travels), and revokes an admission by adding it to
the list it then hands to the members. Every bad input is one line and exit status 2; no file
is written unless the whole command succeeds, and each is written atomically.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from node.errors import UsageError
from p2p_sync.atomic import atomic_write_bytes
from p2p_sync.errors import P2PSyncError
from p2p_sync.trust import admissions
from p2p_sync.trust.keys import load_public_key, load_signing_key
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.trust.membership import MembershipLimits, key_of_peer_id, peer_id_of


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Any failure of ``run`` as one UsageError (exit 2) naming it."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except UsageError:
            raise
        except (P2PSyncError, OSError, ValueError) as exc:
            raise UsageError(_one_line(exc)) from None

    return wrapped


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None


def _write(path: Path, data: bytes, force: bool) -> None:
    if path.exists() and not force:
        raise UsageError(f"{path} exists (--force to overwrite)")
    atomic_write_bytes(path, data)


@_guarded
def cmd_swarm_init(args: argparse.Namespace) -> int:
    admin = load_signing_key(args.admin_key)
    keys = tuple(load_public_key(k) for k in args.trust) or (admin.public,)
    swarm_id = SwarmPolicy(args.swarm, keys, args.threshold).swarm_id
    now = time.time()
    ca = admissions.create_swarm_ca(admin.private, swarm_id, now)
    crl = admissions.revocations(admin.private, ca, [], 1, now)
    _write(args.ca, ca, args.force)
    _write(args.revocations, crl, args.force)
    print(f"private swarm {swarm_id[:16]}: wrote {args.ca} and {args.revocations}")
    return 0


@_guarded
def cmd_identity(args: argparse.Namespace) -> int:
    from p2p_sync.transport.identity import IDENTITY_FILE
    from p2p_sync.transport.tls import identity_key, raw_public

    print(peer_id_of(raw_public(identity_key(args.data_dir / IDENTITY_FILE))))
    return 0


@_guarded
def cmd_admit(args: argparse.Namespace) -> int:
    admin, ca = load_signing_key(args.admin_key), _read(args.ca)
    node_key = key_of_peer_id(args.peer)
    limits = MembershipLimits()
    pem = admissions.admit(admin.private, ca, node_key, time.time(), args.days, limits)
    _write(args.out, pem, args.force)
    print(f"admitted {args.peer} for {args.days:g} days: wrote {args.out}")
    return 0


@_guarded
def cmd_revoke(args: argparse.Namespace) -> int:
    admin, ca = load_signing_key(args.admin_key), _read(args.ca)
    crl = _read(args.revocations)
    for path in args.admission:
        crl = admissions.revoke(admin.private, ca, crl, _read(path), time.time())
    atomic_write_bytes(args.revocations, crl)
    print(f"revoked {len(args.admission)} admission(s): wrote {args.revocations}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    _add_swarm(sub)
    _add_members(sub)


def _add_swarm(sub: argparse._SubParsersAction) -> None:
    swarm = sub.add_parser("swarm", help="private swarms: create the swarm CA")
    actions = swarm.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = actions.add_parser("init", help="create a private swarm's CA and revocation list")
    init.add_argument("--admin-key", type=Path, required=True, help="admin signing key")
    init.add_argument("--trust", action="append", default=[], help="trainer key(s) of the swarm")
    init.add_argument("--swarm", default="default", help="swarm name (default: %(default)s)")
    init.add_argument("--threshold", type=int, default=1, help="signatures needed (default 1)")
    init.add_argument("--ca", type=Path, default=Path("swarm-ca.pem"), help="CA file to write")
    init.add_argument("--revocations", type=Path, default=Path("revocations.pem"))
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    init.set_defaults(func=cmd_swarm_init)


def _add_members(sub: argparse._SubParsersAction) -> None:

    ident = sub.add_parser("identity", help="print a node's peer id (its identity key)")
    ident.add_argument("--data-dir", type=Path, default=Path("p2psync-data"))
    ident.set_defaults(func=cmd_identity)

    admit = sub.add_parser("admit", help="admit a node to a private swarm")
    admit.add_argument("--admin-key", type=Path, required=True)
    admit.add_argument("--ca", type=Path, default=Path("swarm-ca.pem"))
    admit.add_argument("--peer", required=True, help="the node's peer id (p2psync identity)")
    admit.add_argument("--days", type=float, default=30.0, help="validity (default 30)")
    admit.add_argument("--out", type=Path, required=True, help="admission file to write")
    admit.add_argument("--force", action="store_true", help="overwrite an existing file")
    admit.set_defaults(func=cmd_admit)

    revoke = sub.add_parser("revoke", help="revoke admissions (rewrites the revocation list)")
    revoke.add_argument("admission", type=Path, nargs="+", help="admission file(s)")
    revoke.add_argument("--admin-key", type=Path, required=True)
    revoke.add_argument("--ca", type=Path, default=Path("swarm-ca.pem"))
    revoke.add_argument("--revocations", type=Path, default=Path("revocations.pem"))
    revoke.set_defaults(func=cmd_revoke)
