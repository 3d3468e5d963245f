"""Starting and running a node for ``p2psync node``: the runtime's imports (torch among them)
are made here, when a node starts, so that the other commands and ``--help`` do without them."""

from __future__ import annotations

import asyncio

from node.errors import StartupError
from node.patching import pick_device
from p2p_sync.errors import P2PSyncError
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.identity import policy_for
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.runtime.watchdir import watch
from p2p_sync.store import Store


def check_files(cfg: NodeConfig) -> None:
    """Refuse paths that cannot work before anything starts (a mistyped ``--watch`` would
    otherwise be created empty, and the trainer would wait on it for ever)."""
    if cfg.role == "trainer" and cfg.watch is not None and not cfg.watch.is_dir():
        what = "is not a directory" if cfg.watch.exists() else "does not exist"
        raise StartupError(f"--watch {cfg.watch} {what} (create it, or fix the path)")


async def start_node(cfg: NodeConfig) -> tuple[Node, object | None]:
    """Open the store and start the node's servers; any failure is one :class:`StartupError`
    naming it (the OS's reason for a bind or a file, the library's for a key or a store)."""
    try:
        check_files(cfg)
        policy, key = policy_for(cfg)
        # locked while the node runs: a second node on this data dir is refused, naming it
        store = await asyncio.to_thread(Store.open, cfg.data_dir, cfg.store, True)
        try:
            node_cls = TrainerNode if cfg.role == "trainer" else Node
            node = node_cls(cfg, policy, store)
            node.signer = key  # the trainer signs its announcements with its manifest key
            await node.start()
        except BaseException:
            store.close()
            raise
    except StartupError:
        raise
    except P2PSyncError as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"cannot start the {cfg.role}: {_os_reason(exc)}") from None
    return node, key


def _os_reason(exc: OSError) -> str:
    """One line: asyncio's bind error already names the address; others name their file."""
    text = str(exc) if exc.filename is None else f"{exc.filename}: {exc.strerror}"
    return " ".join(text.split())


async def run_node(cfg: NodeConfig, stop: asyncio.Event) -> None:
    node, key = await start_node(cfg)
    state = node.store.state
    print(
        f"p2psync {cfg.role} listening on {node.url} (swarm {node.policy.swarm_id[:16]}, "
        f"version {state.version if state else 'none'})",
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
            await watch(publisher, cfg.watch, stop, cfg.publish.watch_interval_s)
        else:
            await stop.wait()
        await refresher
        await publisher.aclose()
    else:
        device = pick_device(cfg.device)
        follower = await asyncio.to_thread(Follower, node, device, cfg.export, cfg.on_update)
        await follower.run(stop)
