"""The one trusted gate: every path a manifest can arrive by (HTTP push or poll, inline gossip,
a peer's index, the store at restart) is judged by the same rules (table-driven, as
python-tuf's ngclient tests)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_sync.errors import (
    EndlessDataAttackError,
    ForgedSignatureError,
    FreezeAttackError,
    LayoutSwapAttackError,
    ManifestError,
    RollbackAttackError,
    SubstitutedManifestError,
    UntrustedSignerError,
    WrongSwarmError,
)
from p2p_sync.protocol.peers import PeerLimits
from p2p_sync.runtime.config import NodeConfig
from p2p_sync.runtime.node import Node
from p2p_sync.store import Store
from p2p_sync.trust import announce
from p2p_sync.trust.announce import Announcement, Verdict
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import (
    PATCH,
    SNAPSHOT,
    ManifestLimits,
    SwarmPolicy,
    canonical,
    parse,
    sign,
)
from p2p_sync.trust.trusted import TrustedSet, TrustLimits

NOW = 1_800_000_000
TRAINER, STRANGER = SigningKey.generate(), SigningKey.generate()
POLICY = SwarmPolicy("gate", (TRAINER.public,))
OTHER_SWARM = SwarmPolicy("elsewhere", (TRAINER.public,))
LAYOUT = "cd" * 16


def signed(
    version: int = 5,
    key: SigningKey = TRAINER,
    swarm: str = POLICY.swarm_id,
    layout: str = LAYOUT,
    size: int = 40_000,
    kind: str = SNAPSHOT,
    state: str = "ab" * 16,
) -> bytes:
    patch = {"base_version": version - 1, "base_state": "99" * 16} if kind == PATCH else {}
    m = manifest_for(
        bytes([version % 256]) * size,
        swarm=swarm,
        version=version,
        kind=kind,
        target_state=state,
        layout=layout,
        now=NOW,
        lifetime_s=3600,
        chunk_size=16 * 1024,
        **patch,
    )
    return sign(m, [key])


def _forge(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["signed"]["version"] += 1
    return canonical(doc)


def gate(accepted: int | None = 4, **kw) -> TrustedSet:
    return TrustedSet(POLICY, lambda: accepted, **kw)


# (name, manifest bytes, gate kwargs, error refused on every path)
AUTHENTICITY = [
    ("forged", _forge(signed()), {}, ForgedSignatureError),
    ("impostor", signed(key=STRANGER), {}, UntrustedSignerError),
    ("other swarm", signed(swarm=OTHER_SWARM.swarm_id), {}, WrongSwarmError),
    (
        "endless data",
        signed(),
        {"limits": TrustLimits(ManifestLimits(max_payload_size=1000))},
        EndlessDataAttackError,
    ),
]


def _judge(g: TrustedSet, raw: bytes, now: int = NOW) -> announce.Decision:
    m = json.loads(raw)["signed"]
    digest = manifest_digest(raw)
    a = Announcement(POLICY.swarm_id, m["version"], (digest,), now * 1000)  # a fresh message
    return g.judge(announce.encode(a, [TRAINER], [raw]), now * 1000, lambda d: False)


def manifest_digest(raw: bytes) -> str:
    return parse(raw)[0].digest


@pytest.mark.parametrize(
    ("name", "data", "kw", "error"), AUTHENTICITY, ids=[a[0] for a in AUTHENTICITY]
)
def test_every_path_refuses_an_inauthentic_manifest(name, data, kw, error) -> None:
    g = gate(**kw)
    with pytest.raises(error):
        g.admit(data, NOW + 10)  # HTTP push and poll
    with pytest.raises(error):
        g.admit_stored(data)  # the store at restart
    if error is not EndlessDataAttackError:  # the gossip envelope has its own size bound
        decision = _judge(g, data)
        assert decision.verdict is Verdict.REJECT and decision.error is error, decision.reason


def test_news_must_be_newer_than_accepted_on_every_path() -> None:
    g, old, new = gate(accepted=5), signed(5), signed(6)
    with pytest.raises(RollbackAttackError, match="not newer"):
        g.admit(old, NOW + 10)
    assert g.admit(new, NOW + 10).version == 6
    decision = _judge(g, old)  # genuine: forwarded (no penalty for an honest relay) ...
    assert decision.verdict is Verdict.ACCEPT
    assert g.fresh_inline(decision) == []  # ... but not news to keep
    assert [m.version for m, _ in g.fresh_inline(_judge(g, new))] == [6]
    index = [{"digest": "aa" * 32, "version": 5}, {"digest": "bb" * 32, "version": 6}]
    assert g.wanted(index, lambda d: False) == ["bb" * 32]


def test_news_for_other_tensors_is_declined_but_its_relay_not_blamed() -> None:
    g, swapped = gate(layout=lambda: LAYOUT), signed(6, layout="ef" * 16)
    with pytest.raises(LayoutSwapAttackError, match="layout"):
        g.admit(swapped, NOW)
    assert g.admit(signed(6), NOW).layout == LAYOUT
    decision = _judge(g, swapped)  # signed by the trainer: forwarded, not penalized ...
    assert decision.verdict is Verdict.ACCEPT and g.fresh_inline(decision) == []  # ... not kept
    assert g.admit_stored(swapped).version == 6  # accepted earlier: not judged again
    assert gate(layout=lambda: None).admit(swapped, NOW).version == 6  # a newcomer takes any


def test_the_floor_follows_the_accepted_state() -> None:
    accepted: list[int | None] = [None]
    g = TrustedSet(POLICY, lambda: accepted[0])
    assert g.admit(signed(3), NOW).version == 3  # a newcomer takes any version
    accepted[0] = 3
    with pytest.raises(RollbackAttackError):
        g.admit(signed(3), NOW)


S5, S4, OTHER = "ab" * 16, "a4" * 16, "ee" * 16
RECORDED = {5: S5, 4: S4}  # what the node's checkpoint and log say it accepted


def test_an_anchor_of_an_accepted_state_is_kept_as_a_record() -> None:
    """The trainer builds anchors behind its head: a rollout that applied v5 through its patch
    keeps v5's anchor when it comes (its store evicts behind the newest anchor it knows), on
    every path; the same version to another state, a patch, or other tensors it declines."""
    g = gate(accepted=5, layout=lambda: LAYOUT, recorded=RECORDED.get)
    record, older = signed(5, state=S5), signed(4, state=S4)
    assert g.admit(record, NOW).target_state == S5
    assert g.admit(older, NOW).version == 4  # a late anchor of an older state it records
    assert [m.version for m, _ in g.fresh_inline(_judge(g, record))] == [5]
    assert g.newer([parse(record)[0], parse(older)[0]], 5) == []  # never planned from
    for stale in (signed(5, state=OTHER), signed(5, kind=PATCH, state=S5), signed(3)):
        with pytest.raises(RollbackAttackError, match="not newer"):
            g.admit(stale, NOW)
        assert g.fresh_inline(_judge(g, stale)) == []
    with pytest.raises(LayoutSwapAttackError):
        g.admit(signed(5, state=S5, layout="ef" * 16), NOW)
    index = [
        {"digest": "aa" * 32, "version": 5, "kind": SNAPSHOT},
        {"digest": "bb" * 32, "version": 5, "kind": PATCH},
        {"digest": "cc" * 32, "version": 3, "kind": SNAPSHOT},  # not recorded any more
        {"digest": "dd" * 32, "version": 4, "kind": SNAPSHOT},  # older records: announced only
    ]
    assert g.wanted(index, lambda d: False) == ["aa" * 32]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    accepted=st.none() | st.integers(0, 4),
    recorded=st.dictionaries(st.integers(0, 4), st.sampled_from([S5, OTHER]), max_size=4),
    version=st.integers(1, 6),
    kind=st.sampled_from([SNAPSHOT, PATCH]),
    state=st.sampled_from([S5, OTHER]),
    layout=st.sampled_from([LAYOUT, "ef" * 16]),
)
def test_the_gate_never_keeps_a_manifest_that_moves_the_weights_back(
    accepted, recorded, version, kind, state, layout
) -> None:
    """Whatever the node accepted, a manifest kept is either newer (and may be planned from)
    or a snapshot of exactly a state it records (and never planned from); every path (push,
    gossip, index) gives the same answer."""
    recorded = {v: h for v, h in recorded.items() if accepted is not None and v <= accepted}
    g = gate(accepted=accepted, layout=lambda: LAYOUT, recorded=recorded.get)
    data = signed(version, kind=kind, state=state, layout=layout, size=1000)
    m = parse(data)[0]
    try:
        g.admit(data, NOW)
        kept = True
    except (RollbackAttackError, LayoutSwapAttackError):
        kept = False
    assert [x.digest for x, _ in g.fresh_inline(_judge(g, data))] == ([m.digest] if kept else [])
    if kept:
        assert layout == LAYOUT
        polled = accepted is None or version >= accepted  # older records: announced only
        assert g.wanted(
            [{"digest": m.digest, "version": version, "kind": kind}], lambda d: False
        ) == ([m.digest] if polled else [])
        if accepted is not None and version <= accepted:
            assert kind == SNAPSHOT and recorded.get(version) == state
            assert g.newer([m], accepted) == []
    else:
        assert (
            layout != LAYOUT
            or (accepted is not None and version <= accepted and recorded.get(version) != state)
            or (accepted is not None and version <= accepted and kind == PATCH)
        )


def test_expired_news_is_refused_but_a_stored_manifest_stays() -> None:
    g, data = gate(accepted=None), signed()
    with pytest.raises(FreezeAttackError):
        g.admit(data, NOW + 86400)
    decision = _judge(g, data, now=NOW + 86400)  # a fresh announcement carrying it: same gate
    assert decision.verdict is Verdict.REJECT and decision.error is FreezeAttackError
    assert g.admit_stored(data).version == 5  # accepted earlier: the log depends on it


def test_a_manifest_served_under_another_digest_is_a_substitution() -> None:
    with pytest.raises(SubstitutedManifestError, match="under digest"):
        gate().admit(signed(6), NOW, digest="00" * 32)
    with pytest.raises(SubstitutedManifestError):  # even a stale one: the peer swapped it
        gate(accepted=9).admit(signed(6), NOW, digest="00" * 32)


def test_index_entries_are_bounded_and_typed() -> None:
    g = gate(accepted=None, limits=TrustLimits(max_index_entries=3))
    index = [{"digest": f"{i:064x}", "version": i} for i in range(10)]
    assert len(g.wanted(index, lambda d: False)) == 3
    junk = ["x", {"digest": 1, "version": 1}, {"digest": "a" * 64, "version": True}, None]
    assert g.wanted(junk, lambda d: False) == [] and g.wanted({"not": "a list"}, bool) == []
    assert g.wanted(index[:2], lambda d: d == index[0]["digest"]) == [index[1]["digest"]]


def test_node_drops_stored_manifests_the_gate_refuses_at_restart(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    planted = parse(signed(2, key=STRANGER, size=20_000))[0]
    for data in (signed(1), signed(2, key=STRANGER, size=20_000)):  # genuine, and planted
        store.put_manifest(parse(data)[0], data)
    store.put_payload(planted, bytes([2]) * 20_000)
    cfg = NodeConfig(role="rollout", data_dir=tmp_path, trust=("x",))
    node = Node(cfg, POLICY, Store.open(tmp_path))
    assert [m.version for m in node.store.manifests()] == [1]
    assert any("trust gate" in d for d in node.store.dropped)
    assert node.store.get_chunk(planted.chunks[0]) is None  # nothing it names is served
    assert not node.store.pack_path(planted.digest).exists()
    assert [m.version for m in Store.open(tmp_path).manifests()] == [1]  # gone from disk too


def test_every_refusal_is_a_manifest_error() -> None:
    for _, data, kw, _error in AUTHENTICITY:
        with pytest.raises(ManifestError):
            gate(**kw).admit(data, NOW)


async def _learn_from(tmp_path: Path) -> tuple[list[int], list[int], set[str]]:
    def node(name: str) -> Node:
        cfg = NodeConfig(
            role="rollout",
            data_dir=tmp_path / name,
            trust=("x",),
            p2p=False,
            directory=PeerLimits(poll_interval_s=60),
        )
        return Node(cfg, POLICY, Store.open(cfg.data_dir))

    seed, rollout = node("seed"), node("rollout")
    held, swapped, good = signed(1), signed(2, layout="ef" * 16), signed(3)
    for data in (swapped, good):
        seed.store.put_manifest(parse(data)[0], data)
    m1 = parse(held)[0]
    rollout.store.put_manifest(m1, held)
    rollout.store.record(1, m1.target_state, m1.digest)  # the weights it holds: v1, LAYOUT
    url = await seed.start()
    await rollout.start()
    try:
        first = await rollout.learner.learn(url, [parse(swapped)[0].digest])
        second = await rollout.learner.learn(url, [parse(good)[0].digest])
    finally:
        await rollout.stop()
        await seed.stop()
    return [m.version for m in first], [m.version for m in second], rollout.peering.directory.banned


def test_a_node_declines_news_for_other_tensors_and_keeps_the_relay(tmp_path: Path) -> None:
    first, second, banned = asyncio.run(_learn_from(tmp_path))
    assert first == [] and second == [3] and banned == set()


def test_gossip_stores_only_inline_manifests_that_are_news(tmp_path: Path) -> None:
    """The node's gossip path goes through the gate: a genuine but stale inline manifest is
    judged ACCEPT (forwarded) and not kept; a newer one is kept."""
    cfg = NodeConfig(role="rollout", data_dir=tmp_path, trust=("x",), p2p=False)
    node = Node(cfg, POLICY, Store.open(tmp_path))
    held = signed(5)
    node.store.put_manifest(parse(held)[0], held)
    node.store.record(5, parse(held)[0].target_state, parse(held)[0].digest)
    stale, new = signed(4), signed(6)

    async def hear(raw: bytes) -> bool:
        m = parse(raw)[0]
        a = Announcement(POLICY.swarm_id, m.version, (m.digest,), int(time.time() * 1000))
        decision = node.learner.judge(announce.encode(a, [TRAINER], [raw]), lambda d: False)
        assert decision.verdict is Verdict.ACCEPT, decision.reason
        node.learner.on_gossip(decision, None, a.issued_ms)
        await node.stop()  # settles the relay task it may have spawned
        return node.store.has_manifest(m.digest)

    assert asyncio.run(hear(stale)) is False
    assert asyncio.run(hear(new)) is True


def test_a_late_anchor_of_the_head_lets_the_store_evict_behind_it(tmp_path: Path) -> None:
    """A rollout at v2 through patches hears v2's anchor by gossip after applying v2: it keeps
    the anchor, so v0's anchor is no longer protected (before, the join anchor stayed the
    newest one known and the store kept everything from it on)."""
    cfg = NodeConfig(role="rollout", data_dir=tmp_path, trust=("x",), p2p=False)
    node = Node(cfg, POLICY, Store.open(tmp_path))
    join = signed(0, state=OTHER)
    steps = [signed(v, kind=PATCH, state=f"{v:02x}" * 16) for v in (1, 2)]
    for raw in (join, *steps):
        node.store.put_manifest(parse(raw)[0], raw)
    for v, raw in zip((1, 2), steps):
        node.store.record(v, parse(raw)[0].target_state, parse(raw)[0].digest)
    assert parse(join)[0].digest in node.store.protected()
    anchor = signed(2, state="02" * 16)
    m = parse(anchor)[0]
    a = Announcement(POLICY.swarm_id, 2, (m.digest,), int(time.time() * 1000))

    async def hear() -> None:
        data = announce.encode(a, [TRAINER], [anchor])
        node.learner.on_gossip(node.learner.judge(data, lambda d: False), None, a.issued_ms)
        await node.stop()  # settles the relay task it spawned

    asyncio.run(hear())
    assert node.store.has_manifest(m.digest)
    assert parse(join)[0].digest not in node.store.protected()
    assert m.digest in node.store.protected()
