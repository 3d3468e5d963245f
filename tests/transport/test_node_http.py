"""A real node's HTTP data plane on loopback: status and metrics, hostile requests, long polls
and have feeds, the seed's offers, framed announcements, chunks behind them, forwarding."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from p2p_sync.errors import PeerError
from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.early import _round_trip
from p2p_sync.runtime.node import Node
from p2p_sync.store import HaveMark, Store
from p2p_sync.transport.http import DataClient
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import PEER_HEADER as PEER
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, SwarmPolicy, sign
from tests.helpers import (
    bit_equal,
    make_node,
    rollout_config,
    snapshot_manifest,
    stop_follower_pair,
    trainer_config,
)

HEX = "ab" * 32


def _store_snapshot(node: Node, key: SigningKey) -> Manifest:
    """A signed 100-byte snapshot and its payload, in ``node``'s store."""
    m = snapshot_manifest(b"z" * 100)
    node.store.put_payload(m, b"z" * 100)
    node.store.put_manifest(m, sign(m, [key]))
    return m


async def _hostile_requests(node: Node) -> dict[str, int]:
    url = await node.start()
    key = SigningKey.generate()
    m = _store_snapshot(node, key)
    digest = m.chunks[0]
    out = {}
    try:
        async with aiohttp.ClientSession() as s:
            calls = {
                "chunk ok": s.get(f"{url}/chunk/{digest}"),
                "chunk not hex": s.get(f"{url}/chunk/../../etc/passwd"),
                "chunk short hex": s.get(f"{url}/chunk/abc"),
                "chunk unknown": s.get(f"{url}/chunk/{HEX}"),
                "manifest unknown": s.get(f"{url}/manifest/{HEX}"),
                "have unknown": s.get(f"{url}/have/{HEX}"),
                "have bad log": s.get(f"{url}/have/{m.digest}?known=1&log=../x"),
                "have log without known": s.get(f"{url}/have/{m.digest}?log={'a' * 16}"),
                "have bad known": s.get(f"{url}/have/{m.digest}?known=-1"),
                "announce not json": s.post(f"{url}/announce", data=b"\xff\x00"),
                "announce wrong shape": s.post(f"{url}/announce", json=[1, 2]),
                "announce bad digest": s.post(
                    f"{url}/announce", json={"url": None, "digests": ["x"]}
                ),
                "announce bad url": s.post(
                    f"{url}/announce", json={"url": "file:///x", "digests": []}
                ),
                "announce bad revocations": s.post(
                    f"{url}/announce", json={"url": None, "digests": [], "revocations": 7}
                ),
                "announce huge": s.post(
                    f"{url}/announce", data=b"{" + b" " * HttpLimits().max_request_bytes
                ),
                "no such route": s.get(f"{url}/admin"),
                "manifests bad version": s.get(f"{url}/manifests?version=x"),
                "status after": s.get(f"{url}/status"),
            }
            for name, call in calls.items():
                async with call as resp:
                    await resp.read()
                    out[name] = resp.status
            async with s.get(f"{url}/metrics") as resp:
                out["metrics"] = (await resp.text()).count("p2psync_bytes_uploaded_total 100.0")
    finally:
        await node.stop()
    return out


def test_hostile_requests_get_4xx_and_the_node_keeps_serving(tmp_path: Path) -> None:
    codes = asyncio.run(_hostile_requests(make_node(tmp_path)))
    assert codes.pop("chunk ok") == 200 and codes.pop("status after") == 200
    assert codes.pop("metrics") == 1  # the 100 served bytes are counted
    assert codes.pop("announce huge") == 413
    assert codes.pop("no such route") == 404
    assert codes.pop("chunk not hex") == 404  # the router refuses the path outright
    for name in (
        "have bad log",
        "have log without known",
        "have bad known",
        "announce bad revocations",
    ):
        assert codes.pop(name) == 400, name
    for name, code in codes.items():
        assert code in (400, 404), (name, code)


async def _long_poll_across_stop(node: Node) -> tuple[int, dict, bool]:
    """A peer long-polls a have-map that will not change; the node stops meanwhile."""
    url = await node.start()
    m = _store_snapshot(node, SigningKey.generate())
    async with aiohttp.ClientSession() as s:
        poll = asyncio.create_task(s.get(f"{url}/have/{m.digest}?known=1"))  # holds 1 of 1
        router = node.transport.server.router
        for _ in range(500):  # bounded: until the server holds the poll
            if router.polls_held:
                break
            await asyncio.sleep(0.01)
        held = router.polls_held == 1
        await node.stop()
        async with await poll as resp:
            return resp.status, await resp.json(), held


def test_stopping_a_node_answers_held_long_polls_at_once(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    node.cfg = replace(node.cfg, http=replace(node.cfg.http, have_wait_s=600.0))

    async def bounded() -> tuple[int, dict, bool]:
        async with asyncio.timeout(30):  # without close() the poll would hold for 600 s
            return await _long_poll_across_stop(node)

    status, body, held = asyncio.run(bounded())
    assert held and status == 200 and body["have"] == [0] and body["from"] == 0


async def _seed_poll_across_stop(trainer: Node, m: Manifest) -> tuple[int, dict, bool]:
    """A rollout long-polls its offer from the seed (2 chunks, already known to it); the
    trainer stops meanwhile."""
    url = await trainer.start()
    async with aiohttp.ClientSession() as s:
        get = f"{url}/have/{m.digest}?known=2"
        poll = asyncio.create_task(s.get(get, headers={PEER: "http://127.0.0.1:1"}))
        held = await _held(trainer.transport.server.router, 1)
        await trainer.stop()
        async with await poll as resp:
            return resp.status, await resp.json(), held


def test_stopping_a_trainer_answers_a_rollouts_held_offer_poll_at_once(tmp_path: Path) -> None:
    """A seed's polls wait on their requester's own news; stopping wakes those too (a
    server waits for its handlers before it closes: 600 s here, without the wake)."""
    from p2p_sync.protocol.versions import PublishPolicy
    from p2p_sync.runtime.trainer import TrainerNode

    key = SigningKey.generate()
    payload = b"".join(bytes([i]) * 16 * 1024 for i in range(8))
    m = snapshot_manifest(payload)
    tcfg = trainer_config(tmp_path, p2p=False, publish=PublishPolicy(seed_outstanding=2))
    trainer = TrainerNode(tcfg, SwarmPolicy("t", (key.public,)), Store.open(tcfg.data_dir))
    trainer.cfg = replace(trainer.cfg, http=replace(trainer.cfg.http, have_wait_s=600.0))
    trainer.store.put_payload(m, payload)
    trainer.store.put_manifest(m, sign(m, [key]))

    async def bounded() -> tuple[int, dict, bool]:
        async with asyncio.timeout(30):
            return await _seed_poll_across_stop(trainer, m)

    status, body, held = asyncio.run(bounded())
    assert held and status == 200 and len(body["have"]) == 2


async def _poll_woken_before_it_waits(node: Node) -> dict:
    """A 2-chunk manifest of which the node holds chunk 0; a peer long-polls with known=1,
    and chunk 1 lands (and the node says so) in the instant between the router's check and
    its wait: the answer must come at once, not after ``have_wait_s``."""
    url = await node.start()
    payload = b"a" * 16 * 1024 + b"b" * 16 * 1024  # two distinct 16 KiB chunks
    m = snapshot_manifest(payload)
    node.store.put_manifest(m, sign(m, [SigningKey.generate()]))
    node.store.put_chunk(payload[: 16 * 1024])
    view, have, loop = node.view, node.view.have, asyncio.get_running_loop()

    def land() -> None:
        node.store.put_chunk(payload[16 * 1024 :])
        view.notify_have()

    def have_then_land(digest: str, requester: str | None) -> list[int] | None:
        out = have(digest, requester)
        if out == [0]:  # the poll's check: chunk 1 lands before the poll waits
            loop.call_soon(land)
        return out

    view.have = have_then_land  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(10), aiohttp.ClientSession() as s:  # have_wait_s: 600
            async with s.get(f"{url}/have/{m.digest}?known=1") as resp:
                return await resp.json()
    finally:
        await node.stop()


def test_a_have_map_growing_just_before_the_poll_waits_wakes_it(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    node.cfg = replace(node.cfg, http=replace(node.cfg.http, have_wait_s=600.0))
    answer = asyncio.run(_poll_woken_before_it_waits(node))
    assert answer["have"] == [0, 1] and answer["from"] == 0  # no log named: the whole map


async def _status_and_metrics(node: Node) -> tuple[dict, str]:
    url = await node.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/status") as r:
                status = await r.json()
            async with s.get(f"{url}/metrics") as r:
                metrics = await r.text()
    finally:
        await node.stop()
    return status, metrics


def test_status_and_metrics_report_the_documented_fields(tmp_path: Path) -> None:
    status, metrics = asyncio.run(_status_and_metrics(make_node(tmp_path)))
    for key in ("version", "state_hash", "peers", "bytes_uploaded", "bytes_downloaded"):
        assert key in status
    assert "p2psync_bytes_uploaded_total" in metrics and "p2psync_version" in metrics


async def _manifests_by_version(node: Node) -> tuple[list, list, list]:
    from p2p_sync.trust.chunks import manifest_for
    from p2p_sync.trust.manifest import SNAPSHOT, sign

    key = SigningKey.generate()
    m = manifest_for(
        b"p" * 20_000,
        swarm=node.policy.swarm_id,
        version=0,
        kind=SNAPSHOT,
        target_state="aa" * 16,
        layout="bb" * 16,
        now=0,
    )
    node.store.put_manifest(m, sign(m, [key]))
    url = await node.start()
    try:
        async with aiohttp.ClientSession() as s:
            out = []
            for q in ("", "?version=0", "?version=1"):
                async with s.get(f"{url}/manifests{q}") as r:
                    out.append(await r.json())
    finally:
        await node.stop()
    return out[0], out[1], out[2]


def test_manifests_can_be_listed_by_version(tmp_path: Path) -> None:
    everything, v0, v1 = asyncio.run(_manifests_by_version(make_node(tmp_path)))
    assert len(everything) == 1 and v0 == everything and v1 == []
    assert v0[0]["kind"] == "snapshot" and v0[0]["version"] == 0


async def _fetch_from_a_rotting_disk(tmp_path: Path) -> tuple[str, int]:
    from p2p_sync.protocol.swarmconfig import SwarmConfig
    from p2p_sync.runtime.fetch import fetch_payload
    from p2p_sync.runtime.trainer import TrainerNode
    from p2p_sync.store import StoreError

    key = SigningKey.generate()
    policy = SwarmPolicy("rot", (key.public,))
    payload = b"q" * 100_000
    m = manifest_for(
        payload,
        swarm=policy.swarm_id,
        version=0,
        kind=SNAPSHOT,
        target_state="aa" * 16,
        layout="bb" * 16,
        now=int(time.time()),
        chunk_size=16 * 1024,
    )
    tcfg = trainer_config(tmp_path, p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    trainer.store.put_payload(m, payload)
    trainer.store.put_manifest(m, sign(m, [key]))
    url = await trainer.start()
    rcfg = rollout_config(tmp_path, key, url, p2p=False)
    rollout = Node(rcfg, policy, Store.open(rcfg.data_dir))
    rollout.store.put_manifest(m, sign(m, [key]))
    calls = []
    rollout.store.verify_pack = lambda _m: calls.append(_m) and False  # type: ignore[method-assign]
    await rollout.start()
    try:
        with pytest.raises(StoreError) as err:
            await asyncio.wait_for(fetch_payload(rollout, m), 60)
    finally:
        await rollout.stop()
        await trainer.stop()
    assert len(calls) == SwarmConfig().max_attempts
    return str(err.value), trainer.metrics.bytes_uploaded


def test_a_disk_that_keeps_losing_chunks_stops_the_download_with_a_clear_error(
    tmp_path: Path,
) -> None:
    message, uploaded = asyncio.run(_fetch_from_a_rotting_disk(tmp_path))
    assert "keep failing their hash on disk (3 downloads)" in message
    assert uploaded == 100_000  # chunks already held are not fetched again


def test_poll_rounds_ask_the_given_peers_and_a_few_others(tmp_path: Path) -> None:
    given = "http://127.0.0.1:7000"
    cfg = NodeConfig(
        role="rollout",
        data_dir=tmp_path,
        trust=("x",),
        peers=(given,),
        directory=PeerLimits(poll_fanout=4),
    )
    node = Node(cfg, SwarmPolicy("t", (SigningKey.generate().public,)), Store.open(tmp_path))
    others = [f"http://127.0.0.1:{7001 + i}" for i in range(20)]
    for url in [given, *others]:
        node.add_peer(url)
    node.ban(others[0], "test")
    seen: set[str] = set()
    for _ in range(40):
        targets = node.peering.directory.poll_targets(random.Random(), 0.0)
        assert targets[0] == given and len(targets) == len(set(targets)) == 4
        assert others[0] not in targets
        seen.update(targets[1:])
    assert len(seen) > 10  # rounds sample different peers


async def _held(router, n: int) -> bool:
    """Bounded wait until the server holds ``n`` have-map long polls."""
    for _ in range(500):
        if router.polls_held == n:
            return True
        await asyncio.sleep(0.01)
    return False


async def _polls_woken_by_one_chunk(node: Node, k: int) -> tuple[list[dict], tuple[int, int], bool]:
    """``k`` peers long-poll a 2-chunk have-map of which the node holds chunk 0; chunk 1
    lands. Returns their answers and how many times the store was asked for the have-map's
    growth for them, and listed it whole."""
    url = await node.start()
    payload = b"a" * 16 * 1024 + b"b" * 16 * 1024
    m = snapshot_manifest(payload)
    node.store.put_manifest(m, sign(m, [SigningKey.generate()]))
    node.store.put_chunk(payload[: 16 * 1024])
    listed, have_indices, held_since = [0, 0], node.store.have_indices, node.store.held_since

    def counted(manifest: Manifest) -> list[int]:
        listed[1] += 1
        return have_indices(manifest)

    def asked(manifest: Manifest, mark: HaveMark | None) -> tuple[HaveMark, list[int]]:
        listed[0] += 1
        return held_since(manifest, mark)

    node.store.have_indices = counted  # type: ignore[method-assign]
    node.store.held_since = asked  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as s:
            async with s.get(f"{url}/have/{m.digest}") as first:  # the whole map, and its log
                log = (await first.json())["log"]
            get = f"{url}/have/{m.digest}?known=1&log={log}"
            polls = [
                asyncio.create_task(s.get(get, headers={PEER: f"http://127.0.0.1:{i + 1}"}))
                for i in range(k)
            ]
            held = await _held(node.transport.server.router, k)
            listed[:] = [0, 0]
            node.store.put_chunk(payload[16 * 1024 :])
            node.view.notify_have()
            answers = []
            for poll in polls:
                async with await poll as resp:
                    answers.append(await resp.json())
    finally:
        await node.stop()
    return answers, (listed[0], listed[1]), held


def test_one_chunk_landing_lists_the_have_map_once_for_every_poll(tmp_path: Path) -> None:
    """Every chunk that lands wakes every long poll held (a peer following this node each):
    the have-map is updated once for all of them, not once per poll (O(followers x chunks)
    per chunk), by the chunk that arrived, not by a whole listing (O(chunks) per chunk), and
    each poll gets the news, only the news (its log past what it knew)."""
    node = make_node(tmp_path)
    node.cfg = replace(node.cfg, http=replace(node.cfg.http, have_wait_s=600.0))
    answers, (asked, whole), held = asyncio.run(_polls_woken_by_one_chunk(node, 6))
    log = answers[0]["log"]
    assert held and answers == [{"have": [1], "from": 1, "log": log}] * 6
    assert (asked, whole) == (1, 0)


async def _have_log_polls(tmp_path: Path) -> dict[str, Any]:
    node = make_node(tmp_path)
    url = await node.start()
    payload = b"a" * 16 * 1024 + b"b" * 16 * 1024
    m = snapshot_manifest(payload)
    node.store.put_manifest(m, sign(m, [SigningKey.generate()]))
    node.store.put_chunk(payload[: 16 * 1024])
    out: dict[str, Any] = {}
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as s:
            async with s.get(f"{url}/have/{m.digest}") as r:
                out["first"] = await r.json()
            stale = "0" * 16  # a log this node does not keep: the whole map, at once
            async with s.get(f"{url}/have/{m.digest}?known=1&log={stale}") as r:
                out["stale"] = await r.json()
            log = out["first"]["log"]
            node.store.put_chunk(payload[16 * 1024 :])
            node.view.notify_have()
            async with s.get(f"{url}/have/{m.digest}?known=1&log={log}") as r:
                out["news"] = await r.json()  # (a poll held for the news: see above)
    finally:
        await node.stop()
    return out


def test_a_rollout_answers_a_long_poll_with_its_news_and_a_stale_log_with_the_map(
    tmp_path: Path,
) -> None:
    out = asyncio.run(_have_log_polls(tmp_path))
    log = out["first"]["log"]
    assert out["first"] == {"have": [0], "from": 0, "log": log} and len(log) == 16
    assert out["stale"] == {"have": [0], "from": 0, "log": log}
    assert out["news"] == {"have": [1], "from": 1, "log": log}


async def _seed_polls(trainer, m: Manifest, payload: bytes) -> tuple[list, dict, list, bool]:
    """Peers a and b each take the seed's first offer and long-poll it; a fetches one of its
    chunks. Returns a's answer, the seeder's offer counts by requester while a was served,
    b's answer once b fetched one of its own, and whether both polls were held. Then b
    fetches a chunk handed to a, and a's next answer's length ends a's list."""
    url = await trainer.start()
    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    offers: dict[str, int] = {a: 0, b: 0}
    offer = trainer.view.seeder.offer

    def counted(keys, requester, now):  # type: ignore[no-untyped-def]
        offers[requester] += 1
        return offer(keys, requester, now)

    trainer.view.seeder.offer = counted  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as s:

            async def ask(peer: str, known: str = "") -> list[int]:
                async with s.get(f"{url}/have/{m.digest}{known}", headers={PEER: peer}) as r:
                    return (await r.json())["have"]

            async def fetch(peer: str, i: int) -> None:
                async with s.get(f"{url}/chunk/{m.chunks[i]}", headers={PEER: peer}) as r:
                    assert await r.read() == payload[i * 16 * 1024 : (i + 1) * 16 * 1024]

            mine = {a: await ask(a), b: await ask(b)}
            polls = {p: asyncio.create_task(ask(p, f"?known={len(mine[p])}")) for p in (a, b)}
            held = await _held(trainer.transport.server.router, 2)
            before = dict(offers)
            await fetch(a, mine[a][0])
            answer_a = await polls[a]
            during = {p: offers[p] - before[p] for p in offers}
            await fetch(b, mine[b][0])
            answer_b = await polls[b]
            again = asyncio.create_task(ask(a, f"?known={len(answer_a)}"))
            held &= await _held(trainer.transport.server.router, 1)
            handed_to_a = max(set(answer_a) - {mine[a][0]})  # and not fetched yet
            await fetch(b, handed_to_a)  # b takes it: a's budget grows, a's poll wakes
            answer_a.append(len(await again))
    finally:
        await trainer.stop()
    return [mine[a], answer_a], during, [mine[b], answer_b], held


def test_a_chunk_served_by_the_seed_wakes_only_its_requesters_poll(tmp_path: Path) -> None:
    """Serving a chunk changes the offer of the peer it was handed to, no one else's: only
    that peer's long poll is woken and re-offered (waking every follower's cost a pass over
    the manifest each, per chunk served). The other poll answers once its own turn comes."""
    from p2p_sync.protocol.versions import PublishPolicy
    from p2p_sync.runtime.trainer import TrainerNode

    key = SigningKey.generate()
    policy = SwarmPolicy("t", (key.public,))
    payload = b"".join(  # 8 distinct 16 KiB chunks
        bytes([i]) * 16 * 1024 for i in range(8)
    )
    m = snapshot_manifest(payload)
    tcfg = trainer_config(tmp_path, p2p=False, publish=PublishPolicy(seed_outstanding=2))
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    trainer.cfg = replace(trainer.cfg, http=replace(trainer.cfg.http, have_wait_s=600.0))
    trainer.store.put_payload(m, payload)
    trainer.store.put_manifest(m, sign(m, [key]))
    (a_first, a_next), during, (b_first, b_next), held = asyncio.run(
        _seed_polls(trainer, m, payload)
    )
    assert held and len(a_first) == 2 and len(b_first) == 2 and not set(a_first) & set(b_first)
    *a_next, a_after = a_next
    assert len(a_next) == 3 and set(a_first) < set(a_next)  # a's budget grew by the one served
    assert a_after == 4  # a chunk handed to a, served to b, wakes a's poll as well
    assert during == {"http://127.0.0.1:1": 1, "http://127.0.0.1:2": 0}  # b's poll slept on
    assert len(b_next) == 3 and set(b_first) < set(b_next)


async def _fetch_statuses(trainer, m: Manifest) -> tuple[list[int], list[int]]:
    """a and b take the seed's first offers; b fetches a chunk handed to a, then c asks for
    it, then a. Then a fetches one of its own and b asks for that. Returns the statuses
    of those fetches and the indices a was handed."""
    url = await trainer.start()
    a, b, c = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
    statuses = []
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as s:

            async def ask(peer: str) -> list[int]:
                async with s.get(f"{url}/have/{m.digest}", headers={PEER: peer}) as r:
                    return (await r.json())["have"]

            async def fetch(peer: str, i: int) -> None:
                async with s.get(f"{url}/chunk/{m.chunks[i]}", headers={PEER: peer}) as r:
                    statuses.append(r.status)

            mine, _ = await ask(a), await ask(b)
            for peer in (b, c, a):
                await fetch(peer, mine[0])
            await fetch(a, mine[1])
            await fetch(b, mine[1])
    finally:
        await trainer.stop()
    return statuses, mine


def test_the_seed_serves_a_chunk_out_in_the_swarm_only_to_its_owner(tmp_path: Path) -> None:
    """Once a chunk the seed handed out was fetched, the seed's uplink goes to chunks the swarm
    lacks: anyone else asking for it gets a 404 (its scheduler drops the seed's claim and
    takes the chunk from a peer), its owner still gets it. Another peer fetching it first
    does not take it from the peer it was handed to (any peer may ask for any chunk)."""
    from p2p_sync.protocol.versions import PublishPolicy
    from p2p_sync.runtime.trainer import TrainerNode

    key = SigningKey.generate()
    policy = SwarmPolicy("t", (key.public,))
    payload = b"".join(bytes([i]) * 16 * 1024 for i in range(8))
    m = snapshot_manifest(payload)
    tcfg = trainer_config(tmp_path, p2p=False, publish=PublishPolicy(seed_outstanding=2))
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    trainer.store.put_payload(m, payload)
    trainer.store.put_manifest(m, sign(m, [key]))
    statuses, mine = asyncio.run(_fetch_statuses(trainer, m))
    assert len(mine) == 2
    # b first (fresh: served), c refused, a (its owner) served; a's own, then b refused
    assert statuses == [200, 404, 200, 200, 404]


def test_a_trainer_serves_as_many_uploads_at_once_as_a_download_follows_sources(
    tmp_path: Path,
) -> None:
    """Its requesters share their downlinks among ``download.max_sources`` sources each: a
    seed serving fewer at once leaves its uplink partly idle once they trade."""
    from p2p_sync.protocol.versions import PublishPolicy
    from p2p_sync.runtime.trainer import TrainerNode

    policy = SwarmPolicy("t", (SigningKey.generate().public,))
    tcfg = trainer_config(tmp_path / "a", p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    assert tcfg.http.max_concurrent_uploads == 16  # a rollout's
    assert trainer.cfg.http.max_concurrent_uploads == tcfg.download.max_sources == 32
    tcfg = trainer_config(tmp_path / "b", p2p=False, publish=PublishPolicy(seed_uploads=5))
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    assert trainer.cfg.http.max_concurrent_uploads == 5


def test_a_have_map_keeps_its_log_across_news_even_while_empty(tmp_path: Path) -> None:
    """News of any payload recomputes every have-map; one that holds nothing yet must keep
    its log (an empty log is falsy), else its followers, naming the old log, are answered at
    once with an empty map and ask again at every piece of news."""
    node = make_node(tmp_path)
    payload = b"a" * 16 * 1024 + b"b" * 16 * 1024
    m = snapshot_manifest(payload)
    node.store.put_manifest(m, sign(m, [SigningKey.generate()]))
    view = node.view
    assert view.have(m.digest, None) == []
    empty = view.have_log(m.digest)
    view.notify_have()  # news of another payload
    assert view.have(m.digest, None) == [] and view.have_log(m.digest) is empty
    node.store.put_chunk(payload[16 * 1024 :])
    view.notify_have()
    assert view.have(m.digest, None) == [1]
    grown = view.have_log(m.digest)
    assert grown is not None and empty is not None and grown.ident == empty.ident


async def _framed_announcements(node: Node) -> dict[str, Any]:
    """Framed ``POST /announce`` bodies (JSON, then chunks) sent to a real node over HTTP."""
    from p2p_sync.transport.announcement import ANNOUNCE_MAGIC, ANNOUNCE_TYPE, frame_announce
    from p2p_sync.transport.dataplane import DataRouter

    url = await node.start()
    m = _store_snapshot(node, SigningKey.generate())
    sender = "http://127.0.0.1:9"  # the host the requests come from: pushed chunks are kept
    taken = asyncio.Event()
    take = DataRouter._take_pushed

    async def spy(self: DataRouter, *args: Any) -> None:
        await take(self, *args)
        taken.set()

    DataRouter._take_pushed = spy  # type: ignore[method-assign]
    out: dict[str, Any] = {}

    def doc(pushing: Any) -> dict[str, Any]:
        return {"url": sender, "digests": [m.digest], "pushing": pushing}

    limits, big = HttpLimits(), HttpLimits().max_push_bytes
    too_long = (limits.max_request_bytes + 1).to_bytes(4, "big")
    head = frame_announce(doc([]), [])[:-4]  # up to the manifests' length
    bodies = {
        "bad magic": b"p2pX" + frame_announce(doc([]), [])[4:],
        "the old form": b"p2pA" + frame_announce(doc([]), [])[4:],  # manifests in its JSON
        "head too long": ANNOUNCE_MAGIC + too_long,
        "head cut short": frame_announce(doc([]), [])[:20],
        "manifests too long": head + too_long,
        "manifests cut short": frame_announce(doc([]), [], b"x" * 50)[:-10],
        "manifests not zstd": frame_announce(doc([]), [], b"x" * 50),
        "pushing not announced": frame_announce(doc([[HEX, 0, 3]]), [b"abc"]),
        "pushing twice": frame_announce(doc([[m.digest, 0, 1], [m.digest, 0, 1]]), [b"a", b"a"]),
        "pushing bad length": frame_announce(doc([[m.digest, 0, 0]]), []),
        "pushing too much": frame_announce(doc([[m.digest, 0, big + 1]]), []),
    }
    try:
        async with aiohttp.ClientSession() as s:
            headers = {"Content-Type": ANNOUNCE_TYPE}
            for name, body in bodies.items():
                async with s.post(f"{url}/announce", data=body, headers=headers) as resp:
                    out[name] = resp.status
            out["kept after refusals"] = node.learner.pushed.take(m.digest)
            # well formed, and the connection drops within the second chunk
            body = frame_announce(doc([[m.digest, 0, 100], [m.digest, 1, 100]]), [b"z" * 100])
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                f"POST /announce HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ANNOUNCE_TYPE}\r\n"
                f"Content-Length: {len(body) + 100}\r\n\r\n".encode()
                + body
                + b"y" * 40
            )
            await writer.drain()
            writer.close()
            await asyncio.wait_for(taken.wait(), 10)
            out["kept"] = node.learner.pushed.take(m.digest)
            async with s.get(f"{url}/status") as resp:
                out["status after"] = resp.status
    finally:
        DataRouter._take_pushed = take  # type: ignore[method-assign]
        await node.stop()
    return out


def test_framed_announcements_keep_whole_chunks_and_refuse_bad_framing(tmp_path: Path) -> None:
    out = asyncio.run(_framed_announcements(make_node(tmp_path)))
    assert out.pop("status after") == 200
    assert out.pop("kept after refusals") == []  # nothing refused was kept
    # the first chunk came whole and is kept (unverified: the download checks it), the
    # second was cut by the dropped connection
    assert out.pop("kept") == [("http://127.0.0.1:9", 0, b"z" * 100)]
    for name in ("head too long", "manifests too long", "pushing too much"):
        assert out.pop(name) == 413, name
    for name, code in out.items():
        assert code == 400, (name, code)


async def _behind_over_http(tmp_path: Path, versions: list) -> dict[str, Any]:
    """A trainer and a rollout on loopback: version 1's announcement carries chunks."""
    from p2p_sync.protocol.versions import PublishPolicy
    from p2p_sync.runtime.rollout import Follower
    from p2p_sync.runtime.trainer import Publisher, TrainerNode

    key = SigningKey.generate()
    policy = SwarmPolicy("behind", (key.public,))
    tcfg = trainer_config(tmp_path, p2p=False)
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    trainer.signer = key  # as `p2psync node --role trainer` sets it: its own news
    url = await trainer.start()
    rcfg = rollout_config(tmp_path, key, url, p2p=False)
    rollout = Node(rcfg, policy, Store.open(rcfg.data_dir))
    await rollout.start()
    pushed: list = []
    put = rollout.learner.pushed.put
    rollout.learner.pushed.put = lambda *a: (pushed.append(a[:3]), put(*a))  # type: ignore
    follower = Follower(rollout)
    stop = asyncio.Event()
    task = asyncio.create_task(follower.run(stop))
    publisher = Publisher(trainer, key, PublishPolicy(chunk_size=16 * 1024), 10)
    try:
        for v, tensors in enumerate(versions):
            manifests = await publisher.publish(tensors)
            async with asyncio.timeout(60):
                while follower.state.version != v:
                    await follower.advanced.wait()
    finally:
        await stop_follower_pair(stop, task, publisher, rollout, trainer)
    patch = next(m for m in manifests if m.kind == "patch")
    return {"pushed": pushed, "patch": patch, "url": url, "weights": follower.weights}


def test_a_trainer_sends_chunks_behind_its_announcement_over_http(
    tmp_path: Path, tiny_versions: list, monkeypatch
) -> None:
    from p2p_sync.runtime.dataview import SeedingView

    # as measured in a running swarm: a round trip's worth of uplink (tests/protocol/test_behind.py)
    monkeypatch.setattr(SeedingView, "behind_budget", lambda self: 1e9)
    out = asyncio.run(_behind_over_http(tmp_path, tiny_versions[:2]))

    assert bit_equal(out["weights"], tiny_versions[1])
    behind = [(peer, i) for peer, digest, i in out["pushed"] if digest == out["patch"].digest]
    assert behind and {peer for peer, _ in behind} == {out["url"]}, out["pushed"]


def test_chunks_pushed_to_a_node_are_stored_and_served_even_with_no_download(
    tmp_path: Path,
) -> None:
    """The trainer counts a chunk it sent behind its announcement fetched by the follower, so
    the swarm asks the follower for it: a follower that will not download that payload now
    (still catching up) must hold it all the same, or it waits for the seed to let it starve."""
    node = make_node(tmp_path)
    payload = random.Random(1).randbytes(40 * 1024)
    m = snapshot_manifest(payload)  # 3 chunks of 16 KiB
    node.store.put_manifest(m, sign(m, [SigningKey.generate()]))
    early = snapshot_manifest(payload[:20000])  # pushed before its manifest came
    trainer, forger = "http://127.0.0.1:9", "http://127.0.0.1:10"
    node.learner.on_pushed(trainer, m.digest, 0, payload[: 16 * 1024])
    node.learner.on_pushed(forger, m.digest, 1, b"x" * 16 * 1024)
    node.learner.on_pushed(trainer, early.digest, 1, payload[16 * 1024 : 20000])
    assert node.store.has_chunk(m.chunks[0]) and node.view.have(m.digest, None) == [0]
    assert not node.store.has_chunk(m.chunks[1]) and forger in node.peering.banned
    assert trainer not in node.peering.banned
    node.store.put_manifest(early, sign(early, [SigningKey.generate()]))
    node.learner._adopt(early.digest)  # what learning the manifest does
    assert node.store.has_chunk(early.chunks[1])


async def _have_feed(tmp_path: Path) -> dict[str, Any]:
    """A follower opens one have feed on a rollout holding chunk 0 of 3; chunks 1 and 2 land
    one after the other; the feed then goes quiet (``have_wait_s``) and ends."""
    node = make_node(tmp_path)
    node.cfg = replace(node.cfg, http=replace(node.cfg.http, have_wait_s=0.5))
    url = await node.start()
    size = 16 * 1024
    payload = b"a" * size + b"b" * size + b"c" * size
    m = snapshot_manifest(payload)
    node.store.put_manifest(m, sign(m, [SigningKey.generate()]))
    node.store.put_chunk(payload[:size])
    client = DataClient(None)
    out: dict[str, Any] = {"lines": []}
    try:
        async with asyncio.timeout(30):
            async for doc in client.get_feed(f"{url}/have/{m.digest}?feed=1"):
                out["lines"].append(doc)
                landed = len(out["lines"])
                if landed < 3:  # the next chunk lands only once this answer came
                    node.store.put_chunk(payload[landed * size : (landed + 1) * size])
                    node.view.notify_have()
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/have/{m.digest}?feed=2") as r:
                    out["bad feed"] = r.status
    finally:
        await client.close()
        await node.stop()
    return out


def test_a_have_feed_answers_each_chunk_on_one_open_response_and_ends_when_quiet(
    tmp_path: Path,
) -> None:
    """News reaches a follower one latency after the chunk lands: each later answer comes
    on the same response (a long poll per answer left it blind for a round trip after each
    one), only the news, with the log's place; a quiet feed ends by itself."""
    out = asyncio.run(_have_feed(tmp_path))
    lines = out["lines"]
    log = lines[0]["log"]
    assert lines == [
        {"have": [0], "from": 0, "log": log},
        {"have": [1], "from": 1, "log": log},
        {"have": [2], "from": 2, "log": log},
    ]
    assert out["bad feed"] == 400


def _trusting_rollout(data_dir: Path, policy: SwarmPolicy, **http: float) -> Node:
    """A rollout that trusts ``policy``'s key (so it admits manifests signed by it)."""
    cfg = NodeConfig(
        role="rollout", data_dir=data_dir, trust=("x",), directory=PeerLimits(poll_interval_s=60)
    )
    return Node(replace(cfg, http=replace(cfg.http, **http)), policy, Store.open(data_dir))


async def _feed_before_manifest(tmp_path: Path) -> dict[str, Any]:
    """A follower opens a have feed on a rollout that has not learned the manifest yet (it
    heard of the version first); the rollout then learns it, pushed inline. A feed on a
    digest nobody announces is answered 404 once ``have_wait_s`` passes."""
    key = SigningKey.generate()
    policy = SwarmPolicy("t", (key.public,))
    node = _trusting_rollout(tmp_path, policy, have_wait_s=3.0)
    url = await node.start()
    payload = random.Random(2).randbytes(40 * 1024)
    m = snapshot_manifest(payload, swarm=policy.swarm_id)
    trainer = "http://127.0.0.1:9"
    node.learner.on_pushed(trainer, m.digest, 0, payload[: 16 * 1024])  # before its manifest
    client, out = DataClient(None), {}
    try:
        async with asyncio.timeout(30):
            feed = client.get_feed(f"{url}/have/{m.digest}?feed=1")
            first = asyncio.ensure_future(anext(feed))
            out["held"] = await _held(node.transport.server.router, 1)
            out["early"] = first.done()
            await node.learner.learn(trainer, [m.digest], {m.digest: sign(m, [key])})
            # woken by the manifest, not by the hold running out
            out["first"] = await asyncio.wait_for(first, 2.5)
            await feed.aclose()
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/have/{HEX}?feed=1") as r:
                    out["unknown"] = r.status
    finally:
        await client.close()
        await node.stop()
    return out


def test_a_have_feed_asked_before_the_manifest_came_waits_for_it(tmp_path: Path) -> None:
    """News spreads hop by hop: a follower that heard of a version first asks a peer that has
    not learned it yet. Answered 404 at once, it backed off and asked again up to 0.6 s
    later; held, it gets the answer as soon as the peer learns the manifest."""
    out = asyncio.run(_feed_before_manifest(tmp_path))
    assert out["held"] and not out["early"]
    assert out["first"]["have"] == [0]
    assert out["first"]["held_ms"] >= 0  # the asker takes the hold from the round trip
    assert out["unknown"] == 404


async def _early_feeds(tmp_path: Path) -> dict[str, Any]:
    """Rollout B hears a digest from rollout A (the digest alone, as a relay sends it): it
    asks A's have-map while it fetches the manifest from A, and a download takes that feed.
    Then a digest A cannot serve: the early feeds for it close once the manifest fails."""
    key = SigningKey.generate()
    policy = SwarmPolicy("t", (key.public,))
    a, b = (_trusting_rollout(tmp_path / name, policy) for name in ("a", "b"))
    payload = random.Random(3).randbytes(40 * 1024)
    m = snapshot_manifest(payload, swarm=policy.swarm_id)
    a.store.put_manifest(m, sign(m, [key]))
    a.store.put_chunk(payload[16 * 1024 : 32 * 1024])
    out: dict[str, Any] = {}
    try:
        url_a, _ = await a.start(), await b.start()
        b.add_peer(url_a)
        async with asyncio.timeout(30):
            b.learner.on_announce(url_a, [m.digest])
            await asyncio.sleep(0)  # one turn: the learning task runs to its manifest fetch
            out["open while fetching"] = b.learner.early.open_digests()
            await b.learner.settled()
            out["manifest"] = b.store.has_manifest(m.digest)
            feed = b.learner.early.take(m.digest, url_a)
            out["taken"] = feed is not None and await anext(feed)
            out["again"] = b.learner.early.take(m.digest, url_a)
            if feed is not None:
                await feed.aclose()
            b.learner.on_announce(url_a, [HEX])  # nobody has it: a 404 from A
            await asyncio.sleep(0)
            out["bogus open"] = b.learner.early.open_digests()
            await b.learner.settled()
            out["bogus after"] = b.learner.early.open_digests()
    finally:
        await a.stop()
        await b.stop()
    return out


def test_a_rollout_asks_have_maps_while_it_fetches_a_relayed_manifest(tmp_path: Path) -> None:
    """A relayed announcement names digests only: fetching the manifest is a round trip, and
    the download's have-map questions were a second one after it. Both need only the digest,
    so they go out together; a digest whose manifest does not come closes its feeds."""
    out = asyncio.run(_early_feeds(tmp_path))
    assert out["manifest"]
    assert len(out["open while fetching"]) == 1  # before the manifest was here
    assert out["taken"][0] == [1]  # A's have-map: chunk 1
    assert out["taken"][2] is not None and out["taken"][2] >= 0  # a round trip, timed
    assert out["again"] is None  # taken once
    assert out["bogus open"] == [HEX] and out["bogus after"] == []


async def _forwarding(tmp_path: Path) -> dict[str, Any]:
    """Rollout A holds a payload; rollout B follows A's have-map (a feed, its own URL in the
    peer header), a third party claims to follow it under another host's URL. A forwards a
    chunk (as its download does with one from a seed): it goes to B alone, over a framed
    ``POST /announce``, and B stores it verified; two more forwarded while that push is on its
    way wait for it and ride one POST together. Then B is gone: the push fails, and B is not
    tried again for that payload."""
    key = SigningKey.generate()
    policy = SwarmPolicy("t", (key.public,))
    a, b = (_trusting_rollout(tmp_path / name, policy) for name in ("a", "b"))
    payload = random.Random(4).randbytes(64 * 1024)
    m = snapshot_manifest(payload, swarm=policy.swarm_id)
    for node in (a, b):
        node.store.put_manifest(m, sign(m, [key]))
    for i in range(3):
        a.store.put_chunk(payload[i * 16 * 1024 : (i + 1) * 16 * 1024])
    out: dict[str, Any] = {}
    try:
        url_a, url_b = await a.start(), await b.start()
        async with asyncio.timeout(30):
            assert b.client is not None
            b.client.self_url = url_b  # as reachability names it (no peers to ask here)
            feed = b.client.get_feed(f"{url_a}/have/{m.digest}?feed=1")
            out["b saw"] = (await anext(feed))["have"]
            await feed.aclose()
            out["unnamed"] = a.learner.forwarder.targets(m.digest, "http://127.0.0.1:9")
            assert a.client is not None
            a.client.self_url = url_a
            async with aiohttp.ClientSession() as s:  # a URL whose host is not the asker's
                headers = {PEER: "http://10.9.9.9:4000"}
                async with s.get(f"{url_a}/have/{m.digest}", headers=headers) as r:
                    out["claim"] = r.status
            out["following"] = a.view.following(m.digest)
            forwarder = a.learner.forwarder
            out["targets"] = forwarder.targets(m.digest, "http://127.0.0.1:9")
            out["not to its source"] = forwarder.targets(m.digest, url_b)
            for i in range(3):  # back to back: 1 and 2 wait for the push of 0
                piece = payload[i * 16 * 1024 : (i + 1) * 16 * 1024]
                forwarder.forward(m.digest, i, piece, "http://127.0.0.1:9")
            await asyncio.gather(*forwarder._tasks)
            out["sent"] = (forwarder.sent, forwarder.status()["posts"])
            out["b has"] = b.store.have_indices(m)
            out["answer to b"] = await b.client.get_json(f"{url_a}/have/{m.digest}")
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url_a}/have/{m.digest}") as r:
                    out["answer to others"] = await r.json()
            later = time.monotonic() + 2 * a.cfg.http.have_wait_s + 1
            with pytest.MonkeyPatch.context() as patch:  # B stopped asking that long ago
                patch.setattr("p2p_sync.runtime.dataview.time.monotonic", lambda: later)
                out["after B stopped asking"] = a.view.following(m.digest)
            await b.stop()
            forwarder.forward(m.digest, 3, payload[48 * 1024 :], "http://x:1")
            await asyncio.gather(*forwarder._tasks)
            out["after failure"] = (forwarder.sent, forwarder.targets(m.digest, "http://x:1"))
            out["still said pushed"] = a.view.pushing_to(m.digest, url_b)
    finally:
        await a.stop()
        await b.stop()
    out["url b"] = url_b
    return out


def test_a_chunk_from_a_seed_is_forwarded_to_the_peers_following_our_have_map(
    tmp_path: Path,
) -> None:
    out = asyncio.run(_forwarding(tmp_path))
    assert out["unnamed"] == []  # A names no URL of its own yet: a push would be dropped
    assert out["b saw"] == [0, 1, 2] and out["claim"] == 200
    assert out["following"] == [out["url b"]]  # the claimed URL of another host is not kept
    assert out["targets"] == [out["url b"]] and out["not to its source"] == []
    assert out["sent"] == (3, 2) and out["b has"] == [0, 1, 2]  # verified, stored; two POSTs
    # the answers to B say those chunks come by push (B does not request them); to others not
    assert out["answer to b"]["pushed"] == [0, 1, 2] and "pushed" not in out["answer to others"]
    assert out["after B stopped asking"] == []  # done with it, or gone: no longer followed
    assert out["after failure"] == (3, [])  # B gone: the push failed, B not tried again
    assert out["still said pushed"] == {0, 1, 2}  # the ones that arrived; not the failed one


@pytest.mark.parametrize(
    ("answer", "took", "rtt"),
    [
        ({"have": []}, 0.05, 0.05),  # answered at once
        ({"have": [], "held_ms": 30}, 0.05, 0.02),  # held 30 ms for the manifest
        ({"have": [], "held_ms": 80}, 0.05, None),  # held longer than the whole wait: a lie
        ({"have": [], "held_ms": -1}, 0.05, None),
        ({"have": [], "held_ms": "9"}, 0.05, None),
        ({"have": [], "held_ms": True}, 0.05, None),
    ],
)
def test_an_early_feed_times_its_round_trip_less_the_hold(
    answer: dict[str, Any], took: float, rtt: float | None
) -> None:
    got = _round_trip(answer, took)
    assert got == pytest.approx(rtt) if rtt is not None else got is None


async def _hostile_feeds() -> dict[str, Any]:
    """A peer's have feed: good lines, then a line that is no JSON; one line without end
    that grows past the JSON limit; an answer without a newline (a server that answers
    whole, as a long poll)."""
    limit = HttpLimits().max_json_bytes

    async def feed(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        kind = request.match_info["kind"]
        if kind == "whole":
            return aiohttp.web.json_response({"have": [4]})
        response = aiohttp.web.StreamResponse()
        await response.prepare(request)
        if kind == "garbage":
            await response.write(b'{"have": [1]}\n{"have": [2]}\nnot json\n{"have": [3]}\n')
        else:  # endless: a line that never ends
            for _ in range(limit // 4096 + 2):
                await response.write(b" " * 4096)
        await response.write_eof()
        return response

    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get("/have/{kind}", feed)])
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    client, out = DataClient(None), {}
    try:
        for kind in ("garbage", "endless", "whole"):
            got: list[Any] = []
            try:
                async with asyncio.timeout(30):
                    async for doc in client.get_feed(f"{url}/have/{kind}"):
                        got.append(doc)
            except PeerError as e:
                got.append(str(e))
            out[kind] = got
    finally:
        await client.close()
        await runner.cleanup()
    return out


def test_a_hostile_have_feed_is_a_peer_error_after_its_good_lines() -> None:
    out = asyncio.run(_hostile_feeds())
    assert out["garbage"][:2] == [{"have": [1]}, {"have": [2]}]
    assert len(out["garbage"]) == 3 and "not JSON" in out["garbage"][2]
    assert len(out["endless"]) == 1 and "feed line over" in out["endless"][0]
    assert out["whole"] == [{"have": [4]}]
