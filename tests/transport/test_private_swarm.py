"""A private swarm of real nodes on loopback: a trainer and two member rollouts (one relaying
to the other) converge bit-exact over mutual TLS, and again with libp2p on and only the
trainer's libp2p address known, while a rollout that trusts the same trainer but holds no
admission is refused every version (and, over libp2p, cut off); a private config missing its
files is a one-line error before anything starts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from node.cli import main
from p2p_sync.errors import ConfigError
from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.protocol.versions import PublishPolicy
from p2p_sync.runtime.config import NodeConfig, check
from p2p_sync.runtime.node import Node
from p2p_sync.runtime.rollout import Follower
from p2p_sync.runtime.trainer import Publisher, TrainerNode
from p2p_sync.store import Store
from p2p_sync.transport.identity import IDENTITY_FILE
from p2p_sync.transport.tls import identity_key
from p2p_sync.trust import admissions
from p2p_sync.trust.keys import SigningKey, write_keypair
from p2p_sync.trust.manifest import SwarmPolicy
from p2p_sync.trust.membership import MembershipLimits
from tests.helpers import bit_equal, rollout_config, trainer_config
from tests.privateswarm import Swarm, raw_public

DEADLINE_S = 60.0
PUBLISH = PublishPolicy(anchor_every=100, catchup_spans=(), chunk_size=16 * 1024)


def _member(swarm: Swarm, data_dir: Path) -> dict[str, Any]:
    """The private settings of a node whose data dir holds an admitted identity."""
    key = identity_key(data_dir / IDENTITY_FILE)  # created as the node would create it
    admission = admissions.admit(swarm.admin, swarm.ca, raw_public(key), swarm.now, 1.0)
    files = data_dir.parent / f"{data_dir.name}-membership"
    files.mkdir()
    (files / "ca.pem").write_bytes(swarm.ca)
    (files / "admission.pem").write_bytes(admission)
    (files / "crl.pem").write_bytes(swarm.crl)
    return {
        "private": True,
        "swarm_ca": files / "ca.pem",
        "admission": files / "admission.pem",
        "revocations": files / "crl.pem",
    }


async def _shut(followers: list, publisher: Publisher, nodes: list[Node], trainer: Node) -> None:
    """Stop the followers, the publisher, the rollouts and the trainer, in that order."""
    for _, stop, task in followers:
        stop.set()
        await task
    await publisher.aclose()
    for node in nodes:
        await node.stop()
    await trainer.stop()


async def _follow(node: Node) -> tuple[Follower, asyncio.Event, asyncio.Task[None]]:
    follower, stop = Follower(node), asyncio.Event()
    return follower, stop, asyncio.create_task(follower.run(stop))


async def _private_sync(
    tmp_path: Path, versions: list[dict[str, torch.Tensor]], revoke_r2_at: int | None = None
) -> dict:
    """``revoke_r2_at``: before that version the admin revokes r2, writing the new list into
    the trainer's file alone; the trainer's announcement carries it to r1."""
    key = SigningKey.generate()
    write_keypair(key, tmp_path / "k")
    policy = SwarmPolicy("private", (key.public,))
    swarm = Swarm(swarm_id=policy.swarm_id, admin=key.private)
    tcfg = trainer_config(tmp_path, directory=PeerLimits(poll_interval_s=0.2), p2p=False)
    tcfg = NodeConfig(**{**tcfg.__dict__, **_member(swarm, tcfg.data_dir)})
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    url = await trainer.start()
    trainer.transport.tls.refresh_s = 0.0  # type: ignore[union-attr]  # reads its file at once
    nodes: list[Node] = []
    for name, peers in (("r1", (url,)), ("r2", None), ("stranger", (url,))):
        data_dir = tmp_path / name
        extra = {} if name == "stranger" else _member(swarm, data_dir)
        cfg = rollout_config(tmp_path, key, url, data_dir=data_dir, p2p=False, **extra)
        if peers is None:  # r2 knows only r1: what it gets, r1 relays
            cfg = NodeConfig(**{**cfg.__dict__, "peers": (nodes[0].url,)})
        node = Node(cfg, policy, Store.open(data_dir))
        await node.start()
        nodes.append(node)
    followers = [await _follow(n) for n in nodes]
    publisher = Publisher(trainer, key, PUBLISH)
    out: dict[str, Any] = {}
    waited = followers[:2]
    try:
        for v, weights in enumerate(versions):
            if v == revoke_r2_at:
                r2 = nodes[1].cfg.admission.read_bytes()  # type: ignore[union-attr]
                crl = admissions.revoke(swarm.admin, swarm.ca, swarm.crl, r2, swarm.now)
                tcfg.revocations.write_bytes(crl)  # type: ignore[union-attr]
                out["crl"], waited = crl, followers[:1]
            await publisher.publish(weights)
            async with asyncio.timeout(DEADLINE_S):
                while any(f.state.version != v for f, _, _ in waited):
                    await asyncio.sleep(0.02)
        out["r1_crl"] = nodes[0].cfg.revocations.read_bytes()  # type: ignore[union-attr]
        out["versions"] = [f.state.version for f, _, _ in followers[:2]]
        out["members"] = [f.weights for f, _, _ in followers[:2]]
        out["stranger"] = (followers[2][0].state.version, nodes[2].store.manifests())
        out["relayed"] = nodes[0].status()["bytes_uploaded"]
        r1 = nodes[0].cfg
        as_member = ["--admission", str(r1.admission), "--swarm-ca", str(r1.swarm_ca)]
        as_member += ["--revocations", str(r1.revocations), "--data-dir", str(r1.data_dir)]
        out["status"] = [
            await asyncio.to_thread(main, ["status", url, "--json", *extra])
            for extra in (as_member, [])
        ]
    finally:
        await _shut(followers, publisher, nodes, trainer)
    return out


def test_private_members_converge_bit_exact_and_a_non_member_gets_nothing(
    tmp_path: Path, tiny_versions: list, capsys: pytest.CaptureFixture[str]
) -> None:
    versions = tiny_versions[:3]
    out = asyncio.run(_private_sync(tmp_path, versions))
    shown = capsys.readouterr()
    assert out["status"] == [0, 1]  # p2psync status as a member; as anyone, in clear text
    assert '"version": 2' in shown.out and "no status" in shown.err
    assert all(bit_equal(w, versions[-1]) for w in out["members"])
    version, manifests = out["stranger"]
    assert version in (None, -1) and list(manifests) == []
    assert out["relayed"] > 0  # r2 took its chunks from r1, over TLS


@pytest.mark.parametrize("missing", ["swarm_ca", "admission", "revocations"])
def test_a_private_config_missing_a_file_is_a_one_line_error(missing: str) -> None:
    files = {"swarm_ca": Path("ca"), "admission": Path("a"), "revocations": Path("r")}
    cfg = NodeConfig(role="rollout", trust=("x",), private=True, **{**files, missing: None})
    with pytest.raises(ConfigError, match=f"config: private: .*needs {missing}"):
        check(cfg)
    with pytest.raises(ConfigError, match="private is not set"):
        check(NodeConfig(role="rollout", trust=("x",), **files))


def test_a_private_config_file_reads_its_paths_and_membership_limits(tmp_path: Path) -> None:
    from p2p_sync.runtime import configfile

    toml = tmp_path / "rollout.toml"
    toml.write_text(
        'role = "rollout"\ntrust = ["ed25519:' + "00" * 32 + '"]\nprivate = true\n'
        'swarm_ca = "ca.pem"\nadmission = "me.pem"\nrevocations = "crl.pem"\n'
        "[membership]\nmax_admission_days = 7\nclock_skew_s = 60\n"
    )
    cfg = configfile.load(toml, {})
    assert cfg.private and cfg.admission == Path("me.pem") and cfg.swarm_ca == Path("ca.pem")
    assert (cfg.membership.max_admission_days, cfg.membership.clock_skew_s) == (7, 60)
    toml.write_text(toml.read_text().replace("max_admission_days = 7", "max_admission_days = 0"))
    with pytest.raises(ConfigError, match="membership.max_admission_days"):
        configfile.load(toml, {})


def test_a_revocation_rides_the_announcements_and_the_revoked_member_is_cut_off(
    tmp_path: Path, tiny_versions: list
) -> None:
    """r2 fetches only from r1. The admin revokes r2 into the trainer's list file alone: the
    next version's announcement carries the list to r1, which adopts it (its own file
    rewritten) and refuses r2 from then on, while it converges itself."""
    versions = tiny_versions[:3]
    out = asyncio.run(_private_sync(tmp_path, versions, revoke_r2_at=2))
    assert out["r1_crl"] == out["crl"]
    assert out["versions"] == [2, 1]
    assert bit_equal(out["members"][0], versions[-1])


async def _private_libp2p_sync(tmp_path: Path, versions: list[dict[str, torch.Tensor]]) -> dict:
    """A private trainer and two members that know only its libp2p address (no --peers;
    on loopback the trainer names no URL in its record before a dial-back, so the members
    ask it as ``p2p://<peer id>``: libp2p streams, then its LAN shortcut over TLS), and a
    non-member that bootstraps from the same address."""
    key = SigningKey.generate()
    write_keypair(key, tmp_path / "k")
    policy = SwarmPolicy("private", (key.public,))
    swarm = Swarm(swarm_id=policy.swarm_id, admin=key.private)
    tcfg = trainer_config(tmp_path, directory=PeerLimits(poll_interval_s=0.2))
    quick = MembershipLimits(admission_timeout_s=1.0)  # the non-member is cut off sooner
    tcfg = NodeConfig(**{**tcfg.__dict__, **_member(swarm, tcfg.data_dir), "membership": quick})
    trainer = TrainerNode(tcfg, policy, Store.open(tcfg.data_dir))
    url = await trainer.start()
    assert trainer.multiaddr is not None
    nodes: list[Node] = []
    for name in ("r1", "r2", "stranger"):
        data_dir = tmp_path / name
        extra = {} if name == "stranger" else _member(swarm, data_dir)
        cfg = rollout_config(tmp_path, key, url, data_dir=data_dir, **extra)
        cfg = NodeConfig(**{**cfg.__dict__, "peers": (), "bootstrap": (trainer.multiaddr,)})
        node = Node(cfg, policy, Store.open(data_dir))
        await node.start()
        nodes.append(node)
    followers = [await _follow(n) for n in nodes]
    publisher = Publisher(trainer, key, PUBLISH)
    try:
        for v, weights in enumerate(versions):
            await publisher.publish(weights)
            async with asyncio.timeout(DEADLINE_S):
                while any(f.state.version != v for f, _, _ in followers[:2]):
                    await asyncio.sleep(0.02)
        async with asyncio.timeout(DEADLINE_S):  # cut off admission_timeout_s after it came
            while not trainer.status()["p2p"]["membership"]["refused_by"]:
                await asyncio.sleep(0.1)
        return {
            "members": [f.weights for f, _, _ in followers[:2]],
            "stranger": (followers[2][0].state.version, nodes[2].store.manifests()),
            "p2p": [n.status()["p2p"] for n in (trainer, *nodes)],
        }
    finally:
        await _shut(followers, publisher, nodes, trainer)


def test_private_members_converge_over_libp2p_and_a_non_member_is_refused(
    tmp_path: Path, tiny_versions: list
) -> None:
    versions = tiny_versions[:3]
    out = asyncio.run(_private_libp2p_sync(tmp_path, versions))
    assert all(bit_equal(w, versions[-1]) for w in out["members"])
    version, manifests = out["stranger"]
    assert version in (None, -1) and list(manifests) == []
    trainer, r1, r2, stranger = out["p2p"]
    assert trainer["membership"]["refused_by"].get("NotAMemberError", 0) >= 1
    assert trainer["membership"]["members"] == 2  # r1 and r2, admitted over libp2p
    assert trainer["streams_answered"] >= 1  # members asked it over libp2p streams
    assert r1["http_peers"] == r2["http_peers"] == 0  # so: no URL known, no --peers
    assert stranger["membership"] is None and stranger["accepted"] == 0
