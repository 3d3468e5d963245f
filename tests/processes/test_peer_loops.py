"""Real nodes on loopback against peers that go away, answer garbage, list bad names or flood
the peer header: given peers are never lost, the poll loop survives anything it is sent, peer
lists are normalised, and a flood of names cannot keep a genuine newcomer out.

The hostile and the vanishing peers are small aiohttp servers the test starts (``_Servers``);
the "trainer" is a node holding a signed snapshot. Short back-offs and polls come from the
config (``PeerLimits``)."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.protocol.reachability import ReachabilityLimits
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.fetch import fetch_payload
from p2p_sync.runtime.node import Node
from p2p_sync.store import Store
from p2p_sync.transport.messages import PEER_HEADER
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy
from tests.helpers import publish_snapshot

QUICK = PeerLimits(
    max_peers=16,
    max_unproven=8,
    max_per_address=3,
    max_failures=2,
    retry_min_s=0.05,
    retry_max_s=0.2,
    poll_interval_s=0.05,
)
NO_PEERS = b'{"peers": []}'


def _node(tmp_path: Path, name: str, policy: SwarmPolicy, **kw: Any) -> Node:
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path / name,
        trust=("x",),
        p2p=False,
        **{"directory": QUICK, **kw},
    )
    return Node(cfg, policy, Store.open(cfg.data_dir))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(ready: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Wait for ``ready()`` (checked every 20 ms), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class _Servers:
    """Small aiohttp servers: fixed bytes per path (404 elsewhere), a dial-back nonce echoed,
    every request counted by path."""

    def __init__(self) -> None:
        self.hits: dict[str, collections.Counter[str]] = {}
        self._runners: list[web.AppRunner] = []

    async def serve(self, answers: dict[str, bytes], host: str = "127.0.0.1") -> str:
        hits: collections.Counter[str] = collections.Counter()

        async def handle(request: web.Request) -> web.Response:
            hits[request.path] += 1
            if request.path.startswith("/dialback/"):
                return web.json_response({"nonce": request.path.rpartition("/")[2]})
            if request.path not in answers:
                raise web.HTTPNotFound()
            return web.Response(body=answers[request.path], content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        assert site._server is not None and site._server.sockets
        url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
        self.hits[url] = hits
        self._runners.append(runner)
        return url

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


# ---------------------------------------------------------------- a given peer comes back


def _missed(node: Node, url: str) -> bool:
    """``node`` failed to reach ``url`` more often than a peer not given may (or dropped it)."""
    return url not in node.peers or node.peering.directory.failures(url) > QUICK.max_failures


async def _trainer_away_and_back(tmp_path: Path) -> dict[str, Any]:
    """A rollout starts before its trainer; the trainer comes, goes, and comes back on the
    same port with a new version."""
    key = SigningKey.generate()
    policy = SwarmPolicy("away", (key.public,))
    port = _free_port()
    trainer_url = f"http://127.0.0.1:{port}"
    rollout = _node(tmp_path, "rollout", policy, peers=(trainer_url,))
    await rollout.start()
    out: dict[str, Any] = {"url": trainer_url}
    try:
        await _until(lambda: _missed(rollout, trainer_url), "the rollout to miss its trainer")
        out["while down"] = rollout.status()["given_peers"]
        for name, version in (("first", 1), ("again", 2)):
            trainer = _node(tmp_path, name, policy, listen=f"127.0.0.1:{port}")
            m = publish_snapshot(trainer, key, version, 40_000)[0]
            await trainer.start()
            try:
                await _until(lambda d=m.digest: rollout.store.has_manifest(d), f"v{version}")
            finally:
                await trainer.stop()
            await _until(lambda: _missed(rollout, trainer_url), "the rollout to miss it again")
        out["after"] = rollout.status()["given_peers"]
    finally:
        await rollout.stop()
    return out


def test_a_given_peer_that_was_down_is_retried_until_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2psync.node")
    out = asyncio.run(asyncio.wait_for(_trainer_away_and_back(tmp_path), 60))
    url = out["url"]
    [down] = out["while down"]
    assert down["url"] == url and down["state"] == "down" and down["failures"] > 2
    assert 0 <= down["retry_in_s"] <= QUICK.retry_max_s and "connect" in down["error"].lower()
    [after] = out["after"]
    assert after["state"] == "down" and url == after["url"]  # still there, retried
    lines = [r.getMessage() for r in caplog.records]
    # one line per outage (three: before it started, between, after), not one per failed poll
    assert sum(line.startswith(f"peer {url} down (") for line in lines) == 3
    assert sum(line == f"peer {url} back" for line in lines) == 2


# ---------------------------------------------------------------- hostile answers


DIGEST = "ab" * 32
DEEP = b"[" * 100_000 + b"]" * 100_000  # nested deeper than any parser recurses
HUGE = b'{"signed": {"version": ' + b"9" * 5000 + b'}, "signatures": []}'  # a 5,000-digit int
OFFER = json.dumps([{"digest": DIGEST, "version": 7, "kind": "snapshot"}]).encode()
MANIFEST = f"/manifest/{DIGEST}"


async def _hostile_answers(tmp_path: Path) -> dict[str, Any]:
    servers = _Servers()
    honest = await servers.serve({"/manifests": b"[]", "/peers": NO_PEERS})
    hostile = {  # name -> (its URL, the path its hostile answer is at)
        "list": (await servers.serve({"/manifests": b"[]", "/peers": b"[1, 2]"}), "/peers"),
        "deep index": (await servers.serve({"/manifests": DEEP, "/peers": NO_PEERS}), "/manifests"),
        "deep manifest": (
            await servers.serve({"/manifests": OFFER, MANIFEST: DEEP, "/peers": NO_PEERS}),
            MANIFEST,
        ),
        "huge number": (
            await servers.serve({"/manifests": OFFER, MANIFEST: HUGE, "/peers": NO_PEERS}),
            MANIFEST,
        ),
    }
    policy = SwarmPolicy("hostile", (SigningKey.generate().public,))
    peers = (honest, *(url for url, _ in hostile.values()))
    node = _node(tmp_path, "rollout", policy, peers=peers)
    await node.start()
    try:
        await _until(
            lambda: all(servers.hits[url][path] for url, path in hostile.values()),
            "every hostile answer to be asked for",
        )
        polls = servers.hits[honest]["/manifests"]
        await _until(
            lambda: (
                servers.hits[honest]["/manifests"] >= polls + 5
                and servers.hits[hostile["list"][0]]["/peers"] >= 15
            ),
            "the polls to go on after the hostile answers",
        )
        assert node.learner._poller is not None
        return {
            "hostile": {name: url for name, (url, _) in hostile.items()},
            "polling": not node.learner._poller.done(),
            "banned": set(node.peering.banned),
            "known": set(node.peers),
            "lists asked": servers.hits[hostile["list"][0]]["/peers"],
        }
    finally:
        await node.stop()
        await servers.close()


def test_the_poll_loop_survives_any_answer_and_says_so_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2psync.node")
    out = asyncio.run(asyncio.wait_for(_hostile_answers(tmp_path), 60))
    hostile = out["hostile"]
    assert out["polling"], "the poll loop ended"
    assert out["banned"] == {hostile["deep manifest"], hostile["huge number"]}  # bad manifests
    assert {hostile["list"], hostile["deep index"]} <= out["known"]  # given: kept, retried
    text = caplog.text
    assert "Traceback" not in text
    assert f"peer {hostile['deep index']} down (" in text and "nested 100000 deep" in text
    assert f"banned {hostile['huge number']}: offered a bad manifest (a JSON number" in text
    complaints = text.count(f"peer {hostile['list']}: /peers answer is not")
    assert 1 <= complaints <= 3 < out["lists asked"]  # rate-limited: not a line per answer


# ---------------------------------------------------------------- names in /peers answers


async def _listed(tmp_path: Path) -> dict[str, Any]:
    servers = _Servers()
    evil = await servers.serve({"/manifests": b"[]", "/peers": NO_PEERS})
    good = await servers.serve({"/manifests": b"[]", "/peers": NO_PEERS})
    names = ["file:///etc/passwd", "not-a-url", f"{evil}/evil?x=", f"{good.upper()}/"]
    lister = await servers.serve(
        {"/manifests": b"[]", "/peers": json.dumps({"peers": names}).encode()}
    )
    policy = SwarmPolicy("listed", (SigningKey.generate().public,))
    node = _node(tmp_path, "rollout", policy, peers=(lister,))
    await node.start()
    try:
        await _until(lambda: servers.hits[lister]["/peers"] >= 3, "the list to be taken")
        await _until(lambda: sum(servers.hits[good].values()) >= 2, "the listed peer polled")
        async with aiohttp.ClientSession() as s, s.get(f"{node.url}/peers") as r:
            shared = await r.json()
        return {
            "lister": lister,
            "good": good,
            "known": set(node.peers),
            "shared": shared["peers"],
            "evil asked": dict(servers.hits[evil]),
        }
    finally:
        await node.stop()
        await servers.close()


def test_names_in_a_peer_list_are_normalised_and_bad_ones_never_stored_shared_or_asked(
    tmp_path: Path,
) -> None:
    out = asyncio.run(asyncio.wait_for(_listed(tmp_path), 60))
    assert out["known"] == {out["lister"], out["good"]}
    assert out["shared"] == sorted([out["lister"], out["good"]])
    assert out["evil asked"] == {}, "a listed URL made the node request a path of its choosing"


# ---------------------------------------------------------------- a flood of header names

ATTACKER = "127.0.0.2"  # the flood comes from another loopback address than the honest nodes
ANSWERING = 12  # fake peers that answer (on the attacker's address), more than max_unproven
DEAD = 600  # fake peers that lead nowhere


async def _flood(trainer: str, names: list[str], digest: str) -> None:
    """Name each of ``names`` in the peer header of requests from the attacker's address, on
    every kind of request, and as an announcement's URL."""
    connector = aiohttp.TCPConnector(local_addr=(ATTACKER, 0), limit=32)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def name(i: int, fake: str) -> None:
            headers = {PEER_HEADER: fake}
            path = ["/status", "/manifests", "/peers", f"/have/{digest}", "/chunk/" + "cd" * 32]
            async with s.get(trainer + path[i % len(path)], headers=headers) as r:
                await r.read()
            async with s.post(f"{trainer}/announce", json={"url": fake, "digests": []}) as r:
                await r.read()

        for at in range(0, len(names), 64):
            await asyncio.gather(*(name(at + i, f) for i, f in enumerate(names[at : at + 64])))


async def _dial_backs(trainer: str, fakes: list[str]) -> None:
    """The attacker has the trainer dial back each answering fake: proof that it answers
    there, from the address that asked (what the per-address bound is for)."""
    connector = aiohttp.TCPConnector(local_addr=(ATTACKER, 0))
    async with aiohttp.ClientSession(connector=connector) as s:
        for fake in fakes:
            doc = {"url": fake, "nonce": secrets.token_hex(16)}
            async with s.post(f"{trainer}/dialback", json=doc) as r:
                assert (await r.json())["reachable"] is True


async def _eclipse(tmp_path: Path) -> dict[str, Any]:
    key = SigningKey.generate()
    policy = SwarmPolicy("eclipse", (key.public,))
    public = ReachabilityLimits(mode="public")  # asks nobody to dial it back
    trainer = _node(tmp_path, "trainer", policy, reachability=public)
    m = publish_snapshot(trainer, key, 1, 40_000)[0]
    dead = [f"http://{ATTACKER}:{1 + i}" for i in range(DEAD)]
    servers = _Servers()
    fake = {"/manifests": b"[]", "/peers": json.dumps({"peers": dead[:32]}).encode()}
    answering = [await servers.serve(fake, ATTACKER) for _ in range(ANSWERING)]
    trainer_url = await trainer.start()
    rollout = _node(tmp_path, "rollout", policy, peers=(trainer_url,), reachability=public)
    try:
        await _flood(trainer_url, answering + dead, m.digest)
        await _dial_backs(trainer_url, answering)
        flood = asyncio.create_task(_flood(trainer_url, dead, m.digest))  # and it goes on
        await rollout.start()  # a genuine newcomer: it fetches chunks from the trainer
        await _until(lambda: rollout.store.has_manifest(m.digest), "the newcomer to learn v1")
        await asyncio.wait_for(fetch_payload(rollout, m), 30)
        await _until(lambda: rollout.url in trainer.peers, "the newcomer in the trainer's table")
        await flood
        return {
            "at trainer": [u for u in trainer.peers if ATTACKER in u],
            "at rollout": [u for u in rollout.peers if ATTACKER in u],
            "asked": {
                u: sum(n for path, n in servers.hits[u].items() if path.startswith("/dialback/"))
                for u in answering
            },
            "requests": {
                u: sum(
                    n for path, n in servers.hits[u].items() if not path.startswith("/dialback/")
                )
                for u in answering
            },
        }
    finally:
        await rollout.stop()
        await trainer.stop()
        await servers.close()


def test_a_flood_of_peer_names_neither_keeps_a_newcomer_out_nor_draws_requests(
    tmp_path: Path,
) -> None:
    out = asyncio.run(asyncio.wait_for(_eclipse(tmp_path), 90))
    # the newcomer got in (``_eclipse`` waits for it); the attacker's address holds no more
    # than its share of slots, at the trainer and at the newcomer (via peer exchange) alike
    assert set(out["asked"].values()) == {1}  # every fake answering was dialed back once
    assert 1 <= len(out["at trainer"]) <= QUICK.max_per_address
    assert len(out["at rollout"]) <= QUICK.max_per_address
    # names that proved nothing: no slot, and not one request (polls, pushes, questions)
    unproven = set(out["requests"]) - set(out["at trainer"]) - set(out["at rollout"])
    assert len(unproven) >= ANSWERING - 2 * QUICK.max_per_address
    assert {u: out["requests"][u] for u in unproven} == dict.fromkeys(unproven, 0)
