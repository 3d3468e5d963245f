"""libp2p discovery and gossip with real node processes on loopback: a swarm that knows only one
bootstrap address converges, announcements reach everyone fast, forged and replayed
announcements die at the first honest hop, a restarted node keeps its peer id, and a node
without libp2p still works from --peers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from node.cli import main
from p2p_sync.transport.p2p import P2PHost, P2PSettings
from p2p_sync.trust.announce import Announcement, Decision, Verdict, topic
from p2p_sync.trust.manifest import canonical
from p2p_sync.weights.statehash import state_hash
from p2p_sync.weights.workloads import Workload
from simulations.localswarm import Proc, Swarm, wait_for
from tests.helpers import bit_equal

ANNOUNCE_DEADLINE_MS = 2000


@pytest.fixture(scope="module")
def versions() -> list[dict[str, torch.Tensor]]:
    return list(Workload("tiny", lr=3e-4, seed=7).versions(6))


@pytest.fixture()
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    yield s
    s.stop()


def p2p(proc: Proc) -> dict:
    return (proc.status() or {}).get("p2p") or {}


def latencies(proc: Proc) -> dict[int, int]:
    return {int(v): ms for v, ms in (proc.status() or {}).get("announce_latency_ms", {}).items()}


class Eavesdropper:
    """A libp2p leaf (no DHT; linked to the bootstrap only) that records what it hears and can
    publish anything: the attacker."""

    def __init__(self, root: Path, bootstrap: str, swarm_id: str) -> None:
        self.heard: list[bytes] = []
        settings = P2PSettings(
            "/ip4/127.0.0.1/tcp/0",
            root / "evil.key",
            topic(swarm_id),
            bootstrap=(bootstrap,),
            dht=False,
        )
        self.host = P2PHost(settings, self.judge, lambda *a: None, lambda url: None)

    def judge(self, data: bytes, known: Callable[[str], bool]) -> Decision:
        self.heard.append(data)
        digest = hashlib.sha256(data).hexdigest()
        return Decision(Verdict.ACCEPT, Announcement("00" * 32, 0, (digest,), 0))


def _forge(genuine: bytes, bump: int) -> bytes:
    doc = json.loads(genuine)
    doc["signed"]["version"] += bump  # the trainer's signature no longer covers the content
    doc["manifests"] = []
    return canonical(doc)


async def _attack(
    swarm: Swarm, boot: Proc, weights: dict[str, torch.Tensor], version: int, honest: list[Proc]
) -> Eavesdropper:
    """Join as a leaf, capture the trainer's next announcement (``weights`` as ``version``),
    then replay it and forge three."""
    swarm_id = (boot.status() or {})["swarm"]
    evil = Eavesdropper(swarm.root, boot.multiaddr() or "", swarm_id)
    await evil.host.start()
    try:
        await _until(lambda: evil.host.status()["connected"] == 1, 20, "the attacker to join")
        swarm.publish(weights)
        await _until(lambda: bool(evil.heard), 30, "the attacker to overhear an announcement")
        await asyncio.to_thread(swarm.wait_version, honest, version)
        assert evil.host.status()["connected"] == 1  # a leaf: only the bootstrap hears it
        await evil.host.publish(evil.heard[0])  # a replay: same signed bytes, new gossip message
        for bump in (1, 2, 3):
            await evil.host.publish(_forge(evil.heard[0], bump))
        await _until(lambda: p2p(boot)["blacklisted"] >= 1, 20, "the attacker to be blacklisted")
    finally:
        await evil.host.stop()
    return evil


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.serial  # a timing bound: run alone
def test_swarm_from_one_bootstrap_address(swarm: Swarm, versions, tmp_path: Path) -> None:
    boot = swarm.start_bootstrap()
    assert boot.popen.stdout is not None
    printed = boot.popen.stdout.readline().split()[-1]  # "p2psync libp2p /ip4/.../p2p/<id>"
    addr = boot.multiaddr()
    assert addr is not None and printed == addr and "/p2p/12D3KooW" in addr
    gossip_only = tmp_path / "gossip-only.toml"  # no pull polling: news can only come by gossip
    gossip_only.write_text("[directory]\npoll_interval_s = 120.0\n")
    join = ("--bootstrap", addr, "--config", str(gossip_only))
    trainer = swarm.start_trainer(extra=("--bootstrap", addr))
    rollouts = swarm.start_rollouts([f"r{i}" for i in range(6)], [], extra=join)
    wait_for(
        lambda: all(trainer.url in (r.status() or {}).get("peers", []) for r in rollouts),
        60,
        "every rollout to learn the trainer's URL from its signed record",
    )
    # news counts as gossip-borne only once a node is in the topic's mesh (heartbeat: 1 s);
    # before that a rollout may hear of v0 through an HTTP push or its head query instead
    wait_for(
        lambda: all(p2p(p).get("mesh_peers", 0) >= 1 for p in [trainer, *rollouts]),
        60,
        "every node to join the announcement topic's gossip mesh",
    )

    for v in range(4):
        swarm.publish(versions[v])
        swarm.wait_version(rollouts, v, timeout=90)
    # a rollout may have the version by the trainer's HTTP push before the gossip copy lands;
    # its gossip latency is kept when that copy comes
    wait_for(
        lambda: all(set(latencies(r)) == set(range(4)) for r in rollouts),
        30,
        "every rollout to hear every version by gossip",
    )
    seen = {r.name: latencies(r) for r in rollouts}
    print(f"announcement latency (ms) per rollout and version: {seen}")
    for name, by_version in seen.items():
        assert set(by_version) == set(range(4)), (name, by_version)  # every one came by gossip
        assert max(by_version.values()) < ANNOUNCE_DEADLINE_MS, (name, by_version)
    for r in rollouts:
        assert r.export is not None
        assert bit_equal(load_file(r.export / "model.safetensors"), versions[3])
    assert all(p2p(r)["connected"] <= 16 for r in rollouts)  # a bounded set of connections

    honest = [trainer, *rollouts]
    before = {p.name: (p2p(p)["rejected"], p2p(p)["ignored"]) for p in honest}
    boot_before = p2p(boot)
    asyncio.run(_attack(swarm, boot, versions[4], 4, rollouts))
    boot_after = p2p(boot)
    assert boot_after["ignored"] >= boot_before["ignored"] + 1  # the replay: already known
    assert boot_after["rejected"] >= boot_before["rejected"] + 3  # the forgeries
    after = {p.name: (p2p(p)["rejected"], p2p(p)["ignored"]) for p in honest}
    assert after == before  # dropped at the bootstrap: never forwarded to anyone
    target = state_hash(versions[4]).hex()
    assert all((r.status() or {})["state_hash"] == target for r in rollouts)

    r0 = rollouts[0]
    peer_id = p2p(r0)["peer_id"]
    swarm.kill(r0)
    r0b = swarm.start_rollout("r0", [], data_dir=r0.data_dir, extra=join)
    assert p2p(r0b)["peer_id"] == peer_id  # same identity key, same peer id
    try:
        wait_for(lambda: p2p(r0b)["connected"] >= 2, 30, "the restarted node to rejoin")
    except AssertionError as exc:  # say what it saw: CI keeps no node logs
        log = (swarm.root / "r0.log").read_text().splitlines()[-3:]
        raise AssertionError(f"{exc}: {p2p(r0b)}, the bootstrap's {p2p(boot)}, {log}") from None
    swarm.publish(versions[5])
    swarm.wait_version([r0b, *rollouts[1:]], 5, timeout=90)
    assert all(ms < ANNOUNCE_DEADLINE_MS for ms in latencies(r0b).values())


def test_nodes_without_libp2p_work_from_peers(swarm: Swarm, versions) -> None:
    trainer = swarm.start_trainer(extra=("--no-p2p",))
    plain = swarm.start_rollout("plain", [trainer.url], extra=("--no-p2p",))
    with socket.socket() as taken:  # libp2p cannot bind here: that node falls back to HTTP
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fallback = swarm.start_rollout(
            "fallback", [trainer.url], extra=("--p2p-listen", f"/ip4/127.0.0.1/tcp/{port}")
        )
        for v in range(2):
            swarm.publish(versions[v])
            swarm.wait_version([plain, fallback], v)
    for proc in (trainer, plain, fallback):
        status = proc.status() or {}
        assert status["p2p"] is None and status["multiaddr"] is None
    assert bit_equal(load_file(fallback.export / "model.safetensors"), versions[1])


TRUST = ("--trust", "ed25519:" + "00" * 32)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--role", "rollout", *TRUST, "--bootstrap", "/ip4/1.2.3.4/tcp/1"],
            "config: bootstrap: '/ip4/1.2.3.4/tcp/1' is not a multiaddr ending in /p2p/<peer-id>",
        ),
        (["--role", "bootstrap"], "config: trust: a bootstrap needs --trust"),
        (["--role", "bootstrap", *TRUST, "--no-p2p"], "config: p2p:"),
        (
            ["--role", "rollout", *TRUST, "--p2p-listen", "127.0.0.1:5"],
            "config: p2p_listen: '127.0.0.1:5' is not a multiaddr",
        ),
    ],
)
def test_bad_p2p_flags_get_a_one_line_error(argv, message, capsys, tmp_path: Path) -> None:
    code = main(["node", "--data-dir", str(tmp_path / "d"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("p2psync: error: ") and message in err
    assert err.count("\n") == 1
