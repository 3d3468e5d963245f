"""`p2psync node` (run a trainer or rollout) and `p2psync status URL`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import aiohttp

from node.config import ConfigError, NodeConfig, load
from node.patch_cmd import pick_device
from node.rollout import Follower
from node.runtime import Node
from node.trainer import Publisher, TrainerNode, watch
from p2p_sync.errors import P2PSyncError
from p2p_sync.keys import load_public_key, load_signing_key
from p2p_sync.manifest import SwarmPolicy
from p2p_sync.store import Store


def policy_for(cfg: NodeConfig) -> tuple[SwarmPolicy, object | None]:
    key = load_signing_key(cfg.key) if cfg.key else None
    keys = tuple(load_public_key(t) for t in cfg.trust)
    if key is not None and key.public not in keys:
        keys = (key.public, *keys)
    try:
        return SwarmPolicy(cfg.swarm, keys, cfg.threshold), key
    except ValueError as exc:
        raise ConfigError(f"config: threshold: {exc}") from None


async def run_node(cfg: NodeConfig, stop: asyncio.Event) -> None:
    policy, key = policy_for(cfg)
    store = await asyncio.to_thread(Store.open, cfg.data_dir, cfg.store)
    node_cls = TrainerNode if cfg.role == "trainer" else Node
    node = node_cls(cfg, policy, store)
    node.signer = key  # the trainer signs its gossip announcements with its manifest key
    url = await node.start()
    print(
        f"p2psync {cfg.role} listening on {url} (swarm {policy.swarm_id[:16]}, "
        f"version {store.state.version if store.state else 'none'})",
        flush=True,
    )
    print(f"p2psync libp2p {node.multiaddr or 'off (HTTP peers only)'}", flush=True)
    print(f"p2psync reachability: {node.reach.describe()}", flush=True)
    try:
        await _run_role(node, key, cfg, stop)
    finally:
        await node.stop()


async def _run_role(node: Node, key: object | None, cfg: NodeConfig, stop: asyncio.Event) -> None:
    """The role's own loop until ``stop``: relay only, publish, or follow."""
    if cfg.role == "bootstrap":
        await stop.wait()
    elif cfg.role == "trainer":
        publisher = await asyncio.to_thread(Publisher, node, key)
        refresher = asyncio.create_task(publisher.refresh_loop(stop))
        if cfg.watch is not None:
            cfg.watch.mkdir(parents=True, exist_ok=True)
            await watch(publisher, cfg.watch, stop, cfg.publish.watch_interval_s)
        else:
            await stop.wait()
        await refresher
        await publisher.aclose()
    else:
        device = pick_device(cfg.device)
        follower = await asyncio.to_thread(Follower, node, device, cfg.export, cfg.on_update)
        await follower.run(stop)


# flag (argparse dest) -> config setting it overrides
_FLAGS = {
    "role": "role",
    "data_dir": "data_dir",
    "listen": "listen",
    "key": "key",
    "trust": "trust",
    "peers": "peers",
    "watch": "watch",
    "export": "export",
    "on_update": "on_update",
    "swarm": "swarm",
    "device": "device",
    "workers": "workers",
    "chunk_size": "publish.chunk_size",
    "max_upload_mbps": "http.max_upload_mbps",
    "tcp_congestion": "http.tcp_congestion",
    "patch_format": "publish.patch_format",
    "checkpoint_every": "store.checkpoint_every",
    "p2p_listen": "p2p_listen",
    "bootstrap": "bootstrap",
    "reachability": "reachability.mode",
}


def cmd_node(args: argparse.Namespace) -> int:
    overrides = {setting: getattr(args, dest) for dest, setting in _FLAGS.items()}
    overrides["p2p"] = False if args.no_p2p else None
    cfg = load(args.config, overrides)
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


def cmd_status(args: argparse.Namespace) -> int:
    async def fetch() -> dict:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{args.url.rstrip('/')}/status") as resp:
                resp.raise_for_status()
                return await resp.json()

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
    return 0


def _add_node_files(node: argparse.ArgumentParser) -> None:
    node.add_argument("--role", choices=["trainer", "rollout", "bootstrap"])
    node.add_argument("--config", type=Path, help="TOML file; flags override it")
    node.add_argument("--data-dir", type=Path)
    node.add_argument("--key", type=Path, help="trainer: signing key file (p2psync keygen)")
    node.add_argument("--trust", action="append", help="trusted public key or .pub (repeatable)")
    node.add_argument("--watch", type=Path, help="trainer: publish *.safetensors appearing here")
    node.add_argument("--export", type=Path, help="rollout: write model.safetensors here")
    node.add_argument("--on-update", help="rollout: shell command run after each new version")
    node.add_argument("--swarm", help="swarm name (default: default)")
    node.add_argument("--device", help="cpu, cuda or auto")
    node.add_argument(
        "--workers", type=int, help="threads for per-tensor work (default 0: one per usable core)"
    )
    node.add_argument("--chunk-size", type=int, help="trainer: bytes per chunk")
    node.add_argument(
        "--patch-format",
        type=int,
        choices=[1, 2],
        help="trainer: 2 (default) codes positions by the base's exponents, "
        "smaller; 1 is faster to code on a CPU",
    )
    node.add_argument(
        "--checkpoint-every",
        type=int,
        help="write full weights every N versions (default 10; else a log line)",
    )


def _add_node_network(node: argparse.ArgumentParser) -> None:
    node.add_argument(
        "--listen",
        help="HOST:PORT for HTTP: the data plane (bootstrap: status and "
        "metrics only); port 0: any free",
    )
    node.add_argument("--peers", help="comma-separated http://host:port of known peers")
    node.add_argument("--max-upload-mbps", type=float, help="cap on chunk upload (Mbit/s)")
    node.add_argument(
        "--tcp-congestion",
        help='TCP congestion control of the data plane\'s sockets, e.g. "bbr" on fast, long '
        "links (default: the host's)",
    )
    node.add_argument(
        "--bootstrap",
        action="append",
        help="libp2p multiaddr .../p2p/<peer-id> of a bootstrap node (repeatable)",
    )
    node.add_argument("--p2p-listen", help="libp2p multiaddr (default: free port, --listen host)")
    node.add_argument("--no-p2p", action="store_true", help="no libp2p: HTTP peers from --peers")
    node.add_argument(
        "--reachability",
        choices=["auto", "public", "private"],
        help="auto (default): peers dial back to tell; public: this address is reachable "
        "(a server, a forwarded port); private: behind NAT, serve over libp2p only",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="run a trainer, rollout or bootstrap node")
    _add_node_files(node)
    _add_node_network(node)
    node.set_defaults(func=cmd_node)

    status = sub.add_parser("status", help="print a node's status")
    status.add_argument("url", help="http://host:port of the node")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
