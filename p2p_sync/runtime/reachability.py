"""The node's side of the reachability check (``p2p_sync.protocol.reachability``): it asks peers to
dial
its HTTP URL back, answers their questions, and names itself to peers by the verdict.

A node's name among peers (``Node.peer_url``): its HTTP URL once a peer could dial it,
``p2p://<peer id>`` when none could (it then serves over the libp2p connections it opened,
``transport.streams``), nothing while nobody has answered yet: a node never advertises a URL
that nobody can reach.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from typing import Any

from p2p_sync.errors import PeerError
from p2p_sync.protocol.peers import Source
from p2p_sync.protocol.reachability import Reachability, Verdict
from p2p_sync.runtime.peering import described
from p2p_sync.runtime.ports import ReachHost
from p2p_sync.transport.frames import peer_url
from p2p_sync.transport.messages import same_host

log = logging.getLogger("p2psync.node")
NONCES = 64  # dial-back questions remembered (a bounded memory)


class ReachabilityCheck:
    """Asks, answers and keeps the verdict."""

    def __init__(self, node: ReachHost) -> None:
        self.node, self.limits = node, node.cfg.reachability
        self.state = Reachability(self.limits)
        self._nonces: collections.deque[str] = collections.deque(maxlen=NONCES)
        self._dialing = 0
        self._task: asyncio.Task[None] | None = None
        self._news = asyncio.Event()  # a peer appeared while the verdict is unknown

    # ------------------------------------------------------------ answering peers

    def issued(self, nonce: str) -> bool:
        return nonce in self._nonces

    async def dial_back(
        self, url: str, nonce: str, remote: str | None, outbound: bool = False
    ) -> dict[str, Any]:
        """Dial ``url`` for a peer whose request came from ``remote``: only its own address,
        at most ``max_concurrent`` at once (beyond: "busy", ask again later). A node behind
        NAT answers only over a connection it opened itself (``outbound``): whoever reached
        it otherwise is on its own LAN, where a "yes" says nothing about the outside."""
        assert self.node.client is not None
        answer: dict[str, Any] = {"reachable": False, "observed": remote}
        if self.state.verdict is Verdict.BEHIND_NAT and not outbound:
            return answer | {"why": "behind NAT myself: ask a public peer", "busy": True}
        if not same_host(url, remote):
            return answer | {"why": f"{url} is not the address this question came from"}
        if self._dialing >= self.limits.max_concurrent:
            return answer | {"why": "busy: ask again later", "busy": True}
        self._dialing += 1
        try:
            async with asyncio.timeout(self.limits.dial_timeout_s):
                back = await self.node.client.get_json(f"{url}/dialback/{nonce}")
        except (PeerError, TimeoutError) as exc:
            return answer | {"why": f"no answer: {exc}"}
        finally:
            self._dialing -= 1
        reachable = back == {"nonce": nonce}
        if reachable:  # it answers at its own address: proof enough to be known (peers.py)
            self.node.add_peer(url, Source.DIALED, remote)
        return answer | {"reachable": reachable}

    # ------------------------------------------------------------ asking peers

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def first_round(self) -> None:
        """One round before the node starts its work, so it names itself rightly from its
        first request (bounded: peers that do not answer in time are asked again later)."""
        try:
            async with asyncio.timeout(self.limits.dial_timeout_s * 2):
                await self.round()
        except TimeoutError:
            pass

    def peers_changed(self) -> None:
        """A peer was named: with no verdict yet, ask it now rather than at the next retry."""
        if self.state.verdict is Verdict.UNKNOWN:
            self._news.set()

    async def _run(self) -> None:
        """Rounds until the node stops; whatever a peer answers, the next round comes."""
        while True:
            try:
                await self.round()
            except Exception as exc:  # a bug's or a peer's: one line (rate-limited), go on
                self.node.peering.complain(None, f"reachability round: {described(exc)}")
            unknown = self.state.verdict is Verdict.UNKNOWN
            self._news.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(
                    self.limits.retry_s if unknown else self.limits.recheck_s / 4
                ):
                    await self._news.wait()

    async def round(self) -> None:
        """Ask the peers the state picks; take their answers; rename the node if it changed."""
        candidates = self._candidates()
        asks = self.state.to_ask(candidates, time.monotonic())
        answers = await asyncio.gather(*(self._ask(peer) for peer in asks))
        changed = False
        for peer, (reachable, observed) in zip(asks, answers, strict=True):
            changed |= self.state.answered(peer, reachable, observed)
        if self.state.exhausted(candidates) or changed:
            self.node.renamed()

    def _candidates(self) -> list[str]:
        """Known peers, and libp2p peers connected now: asked over streams, even if nobody
        names them yet (in a swarm that joined by one bootstrap address, nobody is named by
        a URL until someone has a verdict)."""
        known = self.node.peering.usable()
        if not self.node.streams:
            return known
        linked = [peer_url(p) for p in self.node.p2p.connected_ids]
        return known + [p for p in linked if p not in known]

    async def _ask(self, peer: str) -> tuple[bool | None, str | None]:
        assert self.node.client is not None
        nonce = secrets.token_hex(16)
        self._nonces.append(nonce)
        try:
            doc = await self.node.client.post_json(
                f"{peer}/dialback", {"url": self.node.url, "nonce": nonce}
            )
        except PeerError:
            return None, None
        except Exception as exc:  # an answer its parser cannot take: no answer
            self.node.peering.complain(peer, f"unreadable dial-back answer: {described(exc)}")
            return None, None
        if not isinstance(doc, dict) or doc.get("busy") or "reachable" not in doc:
            return None, None
        observed = doc.get("observed")
        return doc["reachable"] is True, observed if isinstance(observed, str) else None

    def describe(self) -> str:
        """One line for the log and the start-up banner."""
        verdict, name, seen = self.state.verdict, self.node.peer_url, self.state.observed
        if verdict is Verdict.REACHABLE:
            return f"reachable at {self.node.url}"
        if verdict is Verdict.UNKNOWN:
            return "unknown (asking peers to dial back)"
        how = f"serving over libp2p as {name}" if name else "serving nobody (libp2p is off)"
        return f"behind NAT{f' (peers see {seen})' if seen else ''}: {how}"

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.state.mode,
            "verdict": self.state.verdict.value,
            "observed": self.state.observed,
            "name": self.node.peer_url,
        }
