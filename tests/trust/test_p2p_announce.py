"""Gossip announcements, sans-I/O: every way a message can be wrong gets REJECT (named after the
attack), nothing-new gets IGNORE, genuine news gets ACCEPT with its manifests verified."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from p2p_sync.transport.multiaddrs import default_listen, http_multiaddr, url_from_multiaddr
from p2p_sync.trust import announce
from p2p_sync.trust.announce import AnnounceLimits, Announcement, Verdict, judge
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import SwarmPolicy, canonical, sign

ROOT = Path(__file__).resolve().parents[2]
NOW_MS = 1_800_000_000_000
TRAINER = SigningKey.generate()
POLICY = SwarmPolicy("test", (TRAINER.public,))


def signed_manifest(version: int, key: SigningKey = TRAINER, swarm: str = POLICY.swarm_id):
    m = manifest_for(
        bytes([version]) * 40_000,
        swarm=swarm,
        version=version,
        kind="snapshot",
        target_state="ab" * 16,
        layout="cd" * 16,
        now=NOW_MS // 1000,
        lifetime_s=3600,
        chunk_size=16 * 1024,
    )
    return m, sign(m, [key])


def message(version: int = 3, key: SigningKey = TRAINER, inline: bool = True, **changes) -> bytes:
    m, raw = signed_manifest(version)
    a = Announcement(POLICY.swarm_id, version, (m.digest,), NOW_MS, ("http://127.0.0.1:1",))
    return announce.encode(dataclasses.replace(a, **changes), [key], [raw] if inline else [])


def nothing_known(digest: str) -> bool:
    return False


def test_genuine_announcement_is_accepted_with_its_inline_manifest() -> None:
    d = judge(message(), POLICY, NOW_MS + 5, nothing_known)
    assert d.verdict is Verdict.ACCEPT, d.reason
    assert d.announcement is not None and d.announcement.version == 3
    [(manifest, raw)] = d.manifests
    assert manifest.digest == d.announcement.digests[0] and raw.startswith(b"{")


def test_digest_only_announcement_is_accepted_without_manifests() -> None:
    d = judge(message(inline=False), POLICY, NOW_MS, nothing_known)
    assert d.verdict is Verdict.ACCEPT and d.manifests == ()


def test_already_known_news_is_ignored_not_rejected() -> None:
    d = judge(message(), POLICY, NOW_MS, lambda digest: True)
    assert d.verdict is Verdict.IGNORE and d.reason == "already known"


def _tamper(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["signed"]["version"] += 1  # after signing: the signature no longer covers it
    return canonical(doc)


def _smuggle(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["manifests"] = [signed_manifest(9)[1].decode()]  # valid, but not the announced digest
    return canonical(doc)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (_tamper(message()), "ForgedSignatureError"),
        (message(key=SigningKey.generate()), "UntrustedSignerError"),
        (message(swarm="ee" * 32), "WrongSwarmError"),
        (message(issued_ms=NOW_MS - 601_000), "ReplayedAnnouncementError"),
        (message(issued_ms=NOW_MS + 301_000), "ReplayedAnnouncementError"),
        (_smuggle(message()), "SmuggledManifestError"),
        (b"not json", "MalformedAnnouncementError"),
        (b'{"signed": {}, "signatures": [], "manifests": []}', "MalformedAnnouncementError"),
        (message(digests=()), "MalformedAnnouncementError"),
        (message(sources=("ftp://x:1",)), "MalformedAnnouncementError"),
        (b" " * (256 * 1024 + 1), "OversizedAnnouncementError"),
    ],
)
def test_bad_announcements_are_rejected_naming_the_attack(data: bytes, error: str) -> None:
    d = judge(data, POLICY, NOW_MS, nothing_known)
    assert d.verdict is Verdict.REJECT
    assert d.error is not None and d.error.__name__ == error, d.reason


def test_an_inline_manifest_signed_by_a_stranger_is_rejected() -> None:
    stranger = SigningKey.generate()
    m, raw = signed_manifest(3, key=stranger)
    a = Announcement(POLICY.swarm_id, 3, (m.digest,), NOW_MS)
    d = judge(announce.encode(a, [TRAINER], [raw]), POLICY, NOW_MS, nothing_known)
    assert d.verdict is Verdict.REJECT and d.error.__name__ == "UntrustedSignerError"


def test_inline_manifests_that_do_not_fit_are_left_out() -> None:
    m, raw = signed_manifest(3)
    a = Announcement(POLICY.swarm_id, 3, (m.digest,), NOW_MS)
    data = announce.encode(a, [TRAINER], [raw], AnnounceLimits(max_message_bytes=len(raw)))
    assert json.loads(data)["manifests"] == []
    assert judge(data, POLICY, NOW_MS, nothing_known).verdict is Verdict.ACCEPT


def test_topic_is_per_swarm() -> None:
    assert announce.topic(POLICY.swarm_id) == f"p2psync/{POLICY.swarm_id}/announce"


@pytest.mark.parametrize(
    ("url", "addr"),
    [
        ("http://127.0.0.1:8080", "/ip4/127.0.0.1/tcp/8080/http"),
        ("http://[::1]:9", "/ip6/::1/tcp/9/http"),
        ("http://node.example:80", "/dns4/node.example/tcp/80/http"),
    ],
)
def test_data_plane_url_round_trips_through_a_multiaddr(url: str, addr: str) -> None:
    assert http_multiaddr(url) == addr
    assert url_from_multiaddr(addr) == url
    assert url_from_multiaddr(addr + "/p2p/12D3KooWx") == url  # as it appears in a record


def test_other_addresses_are_not_data_plane_urls() -> None:
    assert url_from_multiaddr("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWx") is None
    assert url_from_multiaddr("/ip4/127.0.0.1/udp/4001/quic-v1") is None
    assert default_listen("127.0.0.1") == "/ip4/127.0.0.1/tcp/0"
