"""p2psync: lossless sparse weight patches and a peer-to-peer swarm that distributes them.

The library: everything a trainer or a rollout engine imports, in layers (docs/architecture.md):
``weights`` (tensors, state hashes, diff/apply/merge), ``codec`` (the wire format), ``trust``
(keys, signed manifests, the one trust gate), ``protocol`` (sans-I/O scheduler, planner,
seeder), ``store`` (checkpoint, log, chunk packs), ``transport`` (sockets) and ``runtime``
(a running node). The entry points for a training loop and an inference engine::

    from p2p_sync import Trainer, Rollout

They live in ``p2p_sync.api`` (they run a node: sockets, an event loop) and are loaded on first
use, so importing the protocol core never pulls in asyncio or a network stack.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["HandOff", "Rollout", "Trainer", "Update"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from p2p_sync import api

        return getattr(api, name)
    raise AttributeError(f"module 'p2p_sync' has no attribute {name!r}")
