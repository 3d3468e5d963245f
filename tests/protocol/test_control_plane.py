"""The control plane with N real nodes in one process (``tests/nodebase.py``): how nodes learn
versions and each other, whom they ban, what gossip they believe, and what a flood of fake
peers does. Real stores, gates, directories, drivers and routers; only the wire is in memory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import zstandard

from p2p_sync.errors import PeerError
from p2p_sync.protocol.peers import PeerLimits, Source
from p2p_sync.runtime.dataview import SeedingView
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.timeline import STEPS
from p2p_sync.transport.announcement import Pushed, pack_manifests
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.memory import MemoryClient
from p2p_sync.transport.messages import Reply, Request
from p2p_sync.trust import announce
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SNAPSHOT, Manifest, SwarmPolicy, sign
from p2p_sync.weights.statehash import state_hash
from tests.helpers import bit_equal
from tests.nodebase import MemorySwarm


def _run(coro) -> dict:
    return asyncio.run(asyncio.wait_for(coro, 120))


# ---------------------------------------------------------------- learning


async def _learn(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        trainer = await swarm.start_trainer()
        rollouts = [await swarm.start_rollout(f"r{i}") for i in range(4)]
        for v, tensors in enumerate(versions):
            await swarm.publish(tensors)
            await swarm.converge(v)
        return {
            "trainer": trainer.url,
            "weights": [swarm.weights(r) for r in rollouts],
            "known": [set(r.peers) for r in rollouts],
            "urls": [r.url for r in rollouts],
            "uploaded": [r.metrics.bytes_uploaded for r in rollouts],
            "trainer uploaded": trainer.metrics.bytes_uploaded,
            "requests": dict(swarm.network.requests),
        }


async def _timelines(tmp_path: Path, versions: list) -> list[dict]:
    async with MemorySwarm(tmp_path) as swarm:
        await swarm.start_trainer()
        rollouts = [await swarm.start_rollout(f"r{i}") for i in range(3)]
        await swarm.publish(versions[0])
        await swarm.converge(0)
        return [r.status()["last_update"] for r in rollouts]


def test_a_rollout_reports_when_each_step_of_a_version_happened(
    tmp_path: Path, tiny_versions: list
) -> None:
    """/status shows, for the last version handed off, when it was heard of, learned, first
    offered, first fetched, fetched, applied and handed off: in that order, all of them."""
    before = time.time()
    for update in _run_list(_timelines(tmp_path, tiny_versions[:1])):
        steps = update["timeline"]
        assert list(steps) == list(STEPS)
        times = list(steps.values())
        assert before <= times[0] and times == sorted(times), steps
        assert steps["handed_off"] == update["at"]


def _run_list(coro) -> list:
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_rollouts_that_know_only_the_trainer_learn_every_version_and_each_other(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_learn(tmp_path, tiny_versions[:3]))
    for weights in out["weights"]:
        assert bit_equal(weights, tiny_versions[2])
    for me, known in zip(out["urls"], out["known"]):
        others = set(out["urls"]) - {me}
        assert out["trainer"] in known
        assert known & others, f"{me} learned no other rollout from the trainer's /peers list"
    chunk_requests = out["requests"].get("chunk", 0) + out["requests"].get("chunks", 0)
    assert out["requests"]["announce"] > 0 and chunk_requests > 0
    assert sum(out["uploaded"]) > 0, "no rollout relayed a chunk: the swarm is a star"


# ---------------------------------------------------------------- bans


def _manifest(
    swarm: str, key: SigningKey, version: int, layout: str = "00" * 16
) -> tuple[Manifest, bytes, bytes]:
    """A snapshot manifest for ``swarm`` signed by ``key``, with its payload."""
    payload = b"not the swarm's weights " * 100
    m = manifest_for(
        payload,
        swarm=swarm,
        version=version,
        kind=SNAPSHOT,
        target_state="00" * 16,
        layout=layout,
        now=int(time.time()),
        chunk_size=16 * 1024,
    )
    return m, sign(m, [key]), payload


async def _ban(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        _, [rollout] = await swarm.at_v0(versions[0], "r0")
        forger = SigningKey.generate()  # a key the swarm does not trust
        evil = await swarm.node("evil", policy=SwarmPolicy("memory", (forger.public,)))
        m, data, payload = _manifest(swarm.policy.swarm_id, forger, 5)
        evil.store.put_payload(m, payload)
        evil.store.put_manifest(m, data)
        evil.add_peer(rollout.url or "", Source.GIVEN)
        await evil.learner.announce([m.digest])  # POST /announce: "fetch this from me"
        await rollout.learner.settled()  # the rollout fetched the manifest and judged it
        banned = set(rollout.peering.banned)
        await swarm.publish(versions[1])  # honest news still arrives
        await swarm.converge(1)
        return {
            "banned": banned,
            "evil": evil.url,
            "has forged": rollout.store.has_manifest(m.digest),
            "weights": swarm.weights(rollout),
            "usable": rollout.peering.usable(),
        }


def test_a_peer_offering_a_forged_manifest_is_banned_and_honest_versions_still_arrive(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_ban(tmp_path, tiny_versions[:2]))
    assert out["evil"] in out["banned"] and out["evil"] not in out["usable"]
    assert not out["has forged"]
    assert bit_equal(out["weights"], tiny_versions[1])


class Corrupting:
    """A real node's data plane whose chunk replies carry flipped bytes (the right length):
    the node claims and serves what it holds, and every chunk it serves fails its hash."""

    def __init__(self, router: DataRouter) -> None:
        self.router, self.served = router, 0

    @asynccontextmanager
    async def serve(self, req: Request) -> AsyncIterator[Reply]:
        async with self.router.serve(req) as reply:
            if reply.upload and reply.body:
                self.served += 1
                flipped = (np.frombuffer(reply.body, np.uint8) ^ 0xFF).tobytes()
                reply = replace(reply, body=flipped)
            yield reply

    def sent(self, reply: Reply) -> None:
        self.router.sent(reply)

    def close(self) -> None:
        self.router.close()


async def _corrupt(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        trainer = await swarm.start_trainer()
        for tensors in versions:
            await swarm.publish(tensors)
        evil = await swarm.node("evil")  # holds every genuine artifact, fetched from nobody
        for m in trainer.store.manifests():
            evil.store.put_payload(m, bytes(trainer.store.payload(m) or b""))
            evil.store.put_manifest(m, trainer.store.manifest_bytes(m.digest) or b"")
        assert evil.url is not None and trainer.url is not None
        tampered = Corrupting(swarm.network.routers[evil.url])
        swarm.network.routers[evil.url] = tampered  # type: ignore[assignment]
        rollouts = [
            await swarm.start_rollout(f"r{i}", peers=(evil.url, trainer.url)) for i in range(3)
        ]
        await swarm.converge(len(versions) - 1)
        return {
            "evil": evil.url,
            "banned": [set(r.peering.banned) for r in rollouts],
            "states": [r.status()["state_hash"] for r in rollouts],
            "served": tampered.served,
        }


def test_a_peer_serving_corrupt_chunks_is_banned_and_honest_rollouts_converge(
    tmp_path: Path, tiny_versions: list
) -> None:
    """Three honest rollouts that know the trainer and a peer holding every artifact whose
    chunks all fail their hashes: whoever got a bad chunk from it bans it (and nobody
    else), and all reach the head."""
    out = _run(_corrupt(tmp_path, tiny_versions[:4]))
    assert out["served"] > 0  # it was asked for chunks
    assert any(out["evil"] in banned for banned in out["banned"])
    assert all(banned <= {out["evil"]} for banned in out["banned"])  # no honest peer banned
    assert all(s == state_hash(tiny_versions[3]).hex() for s in out["states"])


# ---------------------------------------------------------------- gossip


def _stale_announcement(swarm: MemorySwarm, version: int) -> tuple[bytes, str]:
    """A genuine (trainer-signed) announcement of a genuine manifest for an old version, for
    the tensors the swarm holds (so only the version floor can refuse it)."""
    assert swarm.trainer is not None
    layout = swarm.trainer.store.manifests()[0].layout
    m, data, _ = _manifest(swarm.policy.swarm_id, swarm.key, version, layout)
    a = announce.Announcement(
        swarm.policy.swarm_id, version, (m.digest,), int(time.time() * 1000), ()
    )
    return announce.encode(a, [swarm.key], [data]), m.digest


async def _gossip(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path, gossip=True) as swarm:
        await swarm.start_trainer()
        # no --peers and no polls: news can only come by gossip
        quiet = PeerLimits(poll_interval_s=60)
        rollouts = [await swarm.start_rollout(f"r{i}", directory=quiet, peers=()) for i in range(3)]
        for v in (0, 1):
            await swarm.publish(versions[v])
            await swarm.converge(v)
        attacker = await swarm.node("attacker")
        stale, stale_digest = _stale_announcement(swarm, 0)
        await attacker.p2p.publish(stale)  # genuine but below every rollout's floor
        forged = announce.encode(
            announce.Announcement(
                swarm.policy.swarm_id, 9, ("ab" * 32,), int(time.time() * 1000), ()
            ),
            [SigningKey.generate()],
        )
        for _ in range(5):  # blacklisted after max_rejects (3): the rest are not even judged
            await attacker.p2p.publish(forged)
        await swarm.publish(versions[2])
        await swarm.converge(2)
        return {
            "stale stored": [r.store.has_manifest(stale_digest) for r in rollouts],
            "versions": [r.accepted_version for r in rollouts],
            "status": [r.p2p.status() for r in rollouts],
            "attacker": attacker.url,
            "blacklists": [r.p2p.blacklist for r in rollouts],
            "weights": [swarm.weights(r) for r in rollouts],
            "latency": [r.learner.announce_latency_ms for r in rollouts],
            # less the posts that forwarded chunks (node.forwarding): no news in them
            "announce posts": swarm.network.requests["announce"]
            - sum(n.learner.forwarder.posts for n in [*rollouts, attacker]),
            "forwarded": sum(r.learner.forwarder.sent for r in rollouts),
        }


def test_gossip_alone_carries_versions_above_the_floor_and_blacklists_forgers(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_gossip(tmp_path, tiny_versions[:3]))
    # every rollout was reachable by gossip: HTTP pushes only carry the trainer's offers to
    # the nodes that asked it for a have-map before (v1 and v2: at most the 3 rollouts and
    # the attacker's node, whose early feeds asked while it fetched the manifests)
    assert out["announce posts"] <= 2 * 4
    assert out["forwarded"] > 0  # the chunks the trainer handed out went on by push too
    for weights in out["weights"]:
        assert bit_equal(weights, tiny_versions[2])
    assert not any(out["stale stored"]), "a stale announcement's manifest got past the floor"
    assert out["versions"] == [2, 2, 2]
    for status, blacklist, latency in zip(out["status"], out["blacklists"], out["latency"]):
        assert status["rejected"] == 3  # forged: judged until the third, then cut off
        assert out["attacker"] in blacklist
        assert status["accepted"] >= 3  # v0, v1, v2 from the trainer (and the stale one)
        assert set(latency) >= {1, 2}


async def _missed(swarm: MemorySwarm, versions: list) -> tuple[Node, Node, list[str]]:
    """A trainer and a gossiping rollout that got v0 and missed v1's news (gossip and push);
    v1's digests."""
    quiet = PeerLimits(poll_interval_s=60)
    trainer, [rollout] = await swarm.at_v0(versions[0], "r0", directory=quiet, peers=())
    swarm.network.cut(rollout.url)
    digests = [m.digest for m in await swarm.publish(versions[1])]
    swarm.network.restore(rollout.url)
    return trainer, rollout, digests


async def _http_first(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path, gossip=True) as swarm:
        trainer, rollout, digests = await _missed(swarm, versions)
        learned = await rollout.learner.learn(trainer.url, digests)  # over HTTP, first
        a = announce.Announcement(
            swarm.policy.swarm_id, 1, tuple(digests), int(time.time() * 1000), ()
        )
        inline = [trainer.store.manifest_bytes(d) or b"" for d in digests]
        copy = announce.encode(a, [swarm.key], inline)  # then the gossip copy comes
        gate = rollout.p2p.gate
        return {
            "learned": [m.digest for m in learned],
            "digests": digests,
            "forwards": [gate.validate(copy, "mesh-peer", None).forward for _ in range(2)],
        }


def test_news_learned_over_http_first_still_goes_on_by_gossip(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_http_first(tmp_path, tiny_versions[:2]))
    assert out["learned"] == out["digests"]
    # the first gossip copy is forwarded to the mesh behind this node (judged "already
    # known", it would have stopped here); a second one is old news
    assert out["forwards"] == [True, False]


async def _pushed_to_mesh(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path, gossip=True) as swarm:
        trainer, rollout, digests = await _missed(swarm, versions)
        stored = []
        inline = {d: trainer.store.manifest_bytes(d) or b"" for d in digests}
        for pushed in (Pushed(gossiped=True), Pushed(manifests=inline, gossiped=True)):
            rollout.learner.on_announce(trainer.url, digests, pushed)
            await rollout.learner.settled()
            stored.append([rollout.store.has_manifest(d) for d in digests])
        return {"mesh": rollout.p2p.status()["mesh_peers"], "stored": stored}


def test_a_node_on_the_mesh_takes_pushed_manifests_and_leaves_the_rest_to_gossip(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_pushed_to_mesh(tmp_path, tiny_versions[:2]))
    assert out["mesh"] >= 1
    no_manifests, with_manifests = out["stored"]
    assert not any(no_manifests)  # no round trip to the sender: gossip brings them inline
    assert all(with_manifests)  # here already: taken at once (its gossip copy still goes on)


# ---------------------------------------------------------------- peer-table flood


async def _flood(tmp_path: Path, versions: list) -> dict:
    limits = PeerLimits(poll_interval_s=0.2, max_peers=16, max_unproven=8)
    async with MemorySwarm(tmp_path) as swarm:
        trainer = await swarm.start_trainer()
        rollouts = [await swarm.start_rollout(f"r{i}", directory=limits) for i in range(3)]
        await swarm.publish(versions[0])
        await swarm.converge(0)
        target = rollouts[0]
        proven = {u for u, e in target.peers.items() if e.trusted}
        for i in range(500):  # fake URLs, named in announcements and in the peer header
            fake = f"http://fake-{i}.mem:{1000 + i}"
            client = MemoryClient(swarm.network, fake)
            await client.announce(target.url or "", [])
        size_after_flood = len(target.peers)
        await swarm.publish(versions[1])
        await swarm.converge(1)
        return {
            "trainer": trainer.url,
            "proven": proven,
            "known": set(target.peers),
            "size": size_after_flood,
            "weights": swarm.weights(target),
            "hash": state_hash(swarm.weights(target) or {}),
        }


def test_a_flood_of_fake_peers_cannot_push_out_known_good_ones(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_flood(tmp_path, tiny_versions[:2]))
    assert out["trainer"] in out["proven"]
    assert out["proven"] <= out["known"], "a flood displaced peers that had served verified bytes"
    assert out["size"] <= 16
    assert bit_equal(out["weights"], tiny_versions[1])
    assert out["hash"] == state_hash(tiny_versions[1])


# ---------------------------------------------------------------- offers pushed with news


async def _pushed(tmp_path: Path, versions: list, asked: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        trainer, [rollout] = await swarm.at_v0(versions[0], "r0")  # a follower of the trainer
        followers, before = trainer.view.followers(), dict(swarm.network.requests)
        asked.clear()
        digests = {m.digest for m in await swarm.publish(versions[1])}
        await swarm.converge(1)
        return {
            "followers": followers,
            "rollout": rollout.url,
            "manifest GETs": swarm.network.requests["manifest"] - before.get("manifest", 0),
            "questions": [(peer, known) for view, peer, d, known in asked if d in digests],
            "trainer": trainer.view,
            "asked": [view for view, *_ in asked],
            "weights": swarm.weights(rollout),
        }


def test_the_trainer_pushes_a_follower_its_chunks_and_the_manifest_with_the_news(
    tmp_path: Path, tiny_versions: list, monkeypatch
) -> None:
    """A round trip less before the trainer's uplink starts: the follower neither fetches the
    manifest nor asks the trainer's have-map before requesting the chunks it was handed."""
    from p2p_sync.transport.dataplane import DataRouter

    asked: list = []
    have = DataRouter._have

    async def spy(self: DataRouter, req, digest: str):
        asked.append((self.node, req.peer, digest, req.query.get("known")))
        return await have(self, req, digest)

    monkeypatch.setattr(DataRouter, "_have", spy)
    out = _run(_pushed(tmp_path, tiny_versions[:2], asked))
    assert bit_equal(out["weights"], tiny_versions[1])
    assert out["rollout"] in out["followers"]
    assert out["manifest GETs"] == 0  # inline, judged by the rollout's trust gate
    to_trainer = [q for view, q in zip(out["asked"], out["questions"]) if view is out["trainer"]]
    assert to_trainer and all(known is not None for _, known in to_trainer), to_trainer


async def _pushed_chunks(tmp_path: Path, versions: list, served: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        trainer, [rollout] = await swarm.at_v0(versions[0], "r0")  # a follower of the trainer
        pushed: list = []
        put = rollout.learner.pushed.put
        rollout.learner.pushed.put = lambda *a: (pushed.append(a[:3]), put(*a))  # type: ignore
        served.clear()
        uploaded = trainer.metrics.bytes_uploaded
        manifests = await swarm.publish(versions[1])
        await swarm.converge(1)
        patch = next(m for m in manifests if m.kind == "patch")
        return {
            "pushed": pushed,
            "patch": patch,
            "asked of the trainer": [sha for view, sha in served if view is trainer.view],
            "trainer uploaded": trainer.metrics.bytes_uploaded - uploaded,
            "rollout has": set(rollout.store.have_indices(patch)),
            "weights": swarm.weights(rollout),
        }


def test_the_trainer_sends_a_follower_its_first_chunks_behind_the_news_and_they_are_not_asked(
    tmp_path: Path, tiny_versions: list, monkeypatch
) -> None:
    """The chunks ride behind the announcement's JSON in one framed body: the follower takes
    them (verified) without requesting them, so no round trip precedes the trainer's first
    chunk bytes."""
    from p2p_sync.transport.dataplane import DataRouter

    served: list = []
    serve = DataRouter._serve_chunks

    async def spy(self: DataRouter, shas: list[str], req):
        served.extend((self.node, sha) for sha in shas)
        return await serve(self, shas, req)

    monkeypatch.setattr(DataRouter, "_serve_chunks", spy)
    # as measured in a running swarm: a round trip's worth of uplink (tests/protocol/test_behind.py)
    monkeypatch.setattr(SeedingView, "behind_budget", lambda self: 1e9)
    out = _run(_pushed_chunks(tmp_path, tiny_versions[:2], served))
    assert bit_equal(out["weights"], tiny_versions[1])
    patch = out["patch"]
    pushed = {index for _, digest, index in out["pushed"] if digest == patch.digest}
    assert pushed and pushed <= out["rollout has"], out["pushed"]
    assert not {patch.chunks[i] for i in pushed} & set(out["asked of the trainer"])
    assert out["trainer uploaded"] >= sum(patch.chunk_length(i) for i in pushed)


def _bomb() -> bytes:
    """Packed manifests whose frame unpacks to 100 MB of JSON (one long string)."""
    return zstandard.ZstdCompressor(level=3).compress(b'"' + b"a" * 100_000_000 + b'"')


async def _pushed_forgery(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        _, [rollout] = await swarm.at_v0(versions[0], "r0")
        evil = await swarm.node("evil")
        m, data, _ = _manifest(swarm.policy.swarm_id, SigningKey.generate(), 5)
        url, gets = rollout.url or "", swarm.network.requests["manifest"]
        refused = []
        nothing: dict = {}
        for extra, packed in (
            ({"offers": {"ab" * 32: [0]}}, b""),  # a digest it did not announce
            ({"offers": {m.digest: [-1]}}, b""),
            ({"offers": {m.digest: "all"}}, b""),
            ({"manifests": {m.digest: 7}}, b""),
            ({"manifests": {"cd" * 32: "{}"}}, b""),
            (nothing, b"not a zstd frame"),
            (nothing, zstandard.ZstdCompressor().compress(b"not JSON")),
            (nothing, pack_manifests({m.digest: 7})),  # type: ignore[dict-item]
            (nothing, pack_manifests({"cd" * 32: "{}"})),  # a digest not announced
            (nothing, _bomb()),  # 3 KB that would unpack to 100 MB: a 413
        ):
            try:
                await evil.client.announce(url, [m.digest], extra, None, packed)
            except PeerError as exc:
                refused.append(str(exc))
        assert not rollout.peering.banned  # malformed: refused at the door, nothing judged
        inline = {"offers": {m.digest: [0]}, "manifests": {m.digest: data.decode()}}
        evil_url, evil.client.self_url = evil.client.self_url, swarm.trainer.url
        await evil.client.announce(url, [m.digest], inline)  # posing as the trainer
        await rollout.learner.settled()
        posed, _ = rollout.learner.take_offer(swarm.trainer.url or "", m.digest)
        framed = set(rollout.peering.banned)
        evil.client.self_url = evil_url
        packed = pack_manifests(inline["manifests"])
        offers = {"offers": inline["offers"]}
        await evil.client.announce(url, [m.digest], offers, None, packed)  # well formed, forged
        await rollout.learner.settled()
        return {
            "refused": refused,
            "banned": set(rollout.peering.banned),
            "evil": evil.url,
            "has forged": rollout.store.has_manifest(m.digest),
            "manifest GETs": swarm.network.requests["manifest"] - gets,
            "posed": posed,
            "framed": framed,
        }


def test_a_forged_manifest_pushed_inline_gets_its_pusher_banned_and_bad_fields_a_400(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_pushed_forgery(tmp_path, tiny_versions[:1]))
    *malformed, bomb = out["refused"]
    assert len(malformed) == 9 and all("400" in r for r in malformed), out["refused"]
    assert "413" in bomb
    # posing as the trainer: its offer and manifest are dropped (kept only from the host the
    # sender names), so nobody is framed, and the manifest is asked of the trainer itself
    assert out["posed"] is None and out["framed"] == set()
    assert out["evil"] in out["banned"] and not out["has forged"]
    assert out["manifest GETs"] == 1  # the posed one; the inline one was judged as pushed


async def _gone_follower(tmp_path: Path, versions: list) -> dict:
    async with MemorySwarm(tmp_path) as swarm:
        trainer, [stays, goes] = await swarm.at_v0(versions[0], "r0", "r1")
        followers = trainer.view.followers()
        swarm.network.cut(goes.url or "")  # it left without a word
        await swarm.publish(versions[1])
        await swarm.converge(1, nodes=[stays])
        seeder = trainer.view.seeder
        return {
            "followers before": followers,
            "followers after": trainer.view.followers(),
            "gone": goes.url,
            "held by gone": [
                k
                for k, (who, _) in seeder.owner.items()
                if who == goes.url and not seeder.served[k]
            ],
            "weights": swarm.weights(stays),
        }


def test_a_follower_the_push_cannot_reach_gives_its_chunks_back_at_once(
    tmp_path: Path, tiny_versions: list
) -> None:
    out = _run(_gone_follower(tmp_path, tiny_versions[:2]))
    assert out["gone"] in out["followers before"] and out["gone"] not in out["followers after"]
    assert out["held by gone"] == []  # not left waiting reseed_after_s for a peer that is gone
    assert bit_equal(out["weights"], tiny_versions[1])
