"""`p2psync node` (run a trainer or rollout: ``node.running``) and `p2psync status URL`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from node.config import FLAGS, load_args
from node.errors import StartupError
from node.lazy import imported
from p2p_sync import jsonbounds
from p2p_sync.errors import ConfigError, P2PSyncError
from p2p_sync.runtime.config import NodeConfig


def cmd_node(args: argparse.Namespace) -> int:
    try:
        cfg = load_args(args)
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    run_node = imported("node.running").run_node  # the runtime, torch among it: to run a node
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {cfg.role} %(message)s", stream=sys.stderr
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run_node(cfg, stop)

    asyncio.run(main())
    return 0


def _status_tls(args: argparse.Namespace) -> tuple[str, Any]:
    """The URL and TLS context of a private node's ``/status``, asked as the member whose
    data dir and admission are given; an open node's URL as it is."""
    if args.admission is None:
        return args.url, None
    from p2p_sync.transport.identity import IDENTITY_FILE
    from p2p_sync.transport.tls import PrivateSwarmFiles, SwarmTls, identity_key, tls_url

    if args.swarm_ca is None or args.revocations is None:
        raise StartupError("--admission needs --swarm-ca and --revocations too")
    files = PrivateSwarmFiles(args.swarm_ca, args.admission, args.revocations)
    try:
        tls = SwarmTls.load(files, identity_key(args.data_dir / IDENTITY_FILE), time.time())
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    return tls_url(args.url), tls.client


def cmd_status(args: argparse.Namespace) -> int:
    url, context = _status_tls(args)

    async def fetch() -> dict:
        timeout = aiohttp.ClientTimeout(total=5)
        connector = aiohttp.TCPConnector(ssl=context if context is not None else True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            async with session.get(f"{url.rstrip('/')}/status") as resp:
                resp.raise_for_status()
                return jsonbounds.loads(await resp.read())

    try:
        doc = asyncio.run(fetch())
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise P2PSyncError(f"{args.url}: no status ({type(exc).__name__}: {exc})") from None
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    for key in ("role", "url", "version", "state_hash", "bytes_uploaded", "bytes_downloaded"):
        print(f"{key:<17}{doc.get(key)}")
    print(f"{'peers':<17}{len(doc.get('peers', []))}: {' '.join(doc.get('peers', []))}")
    for peer in doc.get("given_peers") or []:  # its state; while down, how long and why
        down = peer.get("state") == "down"
        why = f" ({peer.get('failures')} failures, next try in {peer.get('retry_in_s')} s: "
        why += f"{peer.get('error')})"
        print(f"{'given peer':<17}{peer.get('url')} {peer.get('state')}{why if down else ''}")
    for ban in doc.get("bans") or []:  # who was banned, why, since when
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ban.get("since") or 0))
        print(f"{'banned':<17}{ban.get('peer')} since {since}: {ban.get('reason')}")
    return 0


def _default(setting: str) -> str:
    """A setting's built-in default as ``--help`` shows it, read off :class:`NodeConfig`."""
    value: object = NodeConfig()
    for part in setting.split("."):
        value = getattr(value, part)
    if value in (None, (), ""):
        return "none"
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _flag(parser: argparse.ArgumentParser, flag: str, text: str, **kwargs: object) -> None:
    """A flag whose help ends with its default (the config setting it overrides)."""
    dest = flag.lstrip("-").replace("-", "_")
    setting = FLAGS.get(dest)
    shown = _default(setting) if setting else "none"
    parser.add_argument(flag, help=f"{text} (default: {shown})", **kwargs)  # type: ignore[arg-type]


def _add_node_files(node: argparse.ArgumentParser) -> None:
    _flag(node, "--role", "what this node does", choices=["trainer", "rollout", "bootstrap"])
    node.add_argument(
        "--config", type=Path, help="TOML file of settings; flags override it (default: none)"
    )
    _flag(node, "--data-dir", "the node's store: keys, chunks, weights, log", type=Path)
    _flag(node, "--key", "trainer: signing key file (p2psync keygen)", type=Path)
    _flag(node, "--trust", "trusted public key or .pub file (repeatable)", action="append")
    _flag(node, "--watch", "trainer: publish *.safetensors renamed into this dir", type=Path)
    _flag(node, "--export", "rollout: write model.safetensors and version.json here", type=Path)
    _flag(node, "--on-update", "rollout: shell command run after each new version")
    _flag(node, "--swarm", "swarm name")
    _flag(node, "--device", "cpu, cuda or auto")
    _flag(node, "--workers", "threads for per-tensor work; 0: one per usable core", type=int)
    _flag(node, "--chunk-size", "trainer: bytes per chunk; 0: picked from the payload", type=int)
    _flag(
        node,
        "--patch-format",
        "trainer: 3 codes positions by the base's exponents per segment (smallest; coded and "
        "applied on a GPU where the weights live), 2 the same with zstd, 1 by gaps alone "
        "(no scan of the base)",
        type=int,
        choices=[1, 2, 3],
    )
    _flag(node, "--checkpoint-every", "write full weights every N versions", type=int)


def _add_node_network(node: argparse.ArgumentParser) -> None:
    _flag(
        node,
        "--listen",
        "HOST:PORT for HTTP: the data plane (bootstrap: status and metrics only); port 0: any free",
    )
    _flag(
        node,
        "--advertise-host",
        "the host or address peers should dial, when it differs from --listen's (a public "
        "address in front of a forwarded port)",
    )
    _flag(node, "--peers", "comma-separated http://host:port (or p2p://<peer id>) of known peers")
    _flag(node, "--max-upload-mbps", "cap on chunk upload in Mbit/s; 0: none", type=float)
    _flag(
        node,
        "--tcp-congestion",
        'TCP congestion control of the data plane\'s sockets, e.g. "bbr" on fast, long links; '
        "none: the host's",
    )
    _add_node_libp2p(node)


def _add_node_libp2p(node: argparse.ArgumentParser) -> None:
    _flag(
        node,
        "--bootstrap",
        "libp2p multiaddr .../p2p/<peer-id> of a bootstrap node (repeatable)",
        action="append",
    )
    _flag(node, "--p2p-listen", "libp2p multiaddr; none: a free port on the --listen host")
    node.add_argument(
        "--no-p2p",
        action="store_true",
        help="no libp2p: HTTP peers from --peers only (default: libp2p on)",
    )
    _flag(
        node,
        "--reachability",
        "auto: peers dial back to tell; public: this address is reachable (a server, a "
        "forwarded port); private: behind NAT, serve over libp2p only",
        choices=["auto", "public", "private"],
    )


def _add_node_membership(node: argparse.ArgumentParser) -> None:
    node.add_argument(
        "--private",
        action="store_true",
        help="a private swarm: members only, data plane over TLS (default: open)",
    )
    _flag(node, "--swarm-ca", "private: the swarm CA certificate (p2psync swarm init)", type=Path)
    _flag(node, "--admission", "private: this node's admission (p2psync admit)", type=Path)
    _flag(node, "--revocations", "private: the admin's signed revocation list", type=Path)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="run a trainer, rollout or bootstrap node")
    _add_node_files(node)
    _add_node_network(node)
    _add_node_membership(node)
    node.set_defaults(func=cmd_node)

    status = sub.add_parser("status", help="print a node's status")
    status.add_argument("url", help="http://host:port of the node")
    status.add_argument("--json", action="store_true", help="the whole /status document as JSON")
    status.add_argument("--admission", type=Path, help="private swarm: ask as this member")
    status.add_argument("--swarm-ca", type=Path, help="private swarm: the swarm CA certificate")
    status.add_argument("--revocations", type=Path, help="private swarm: the revocation list")
    status.add_argument(
        "--data-dir", type=Path, default=Path("p2psync-data"), help="the member's data dir"
    )
    status.set_defaults(func=cmd_status)
