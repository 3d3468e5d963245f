"""Manifest verification: one table row per attack, each with its own exception."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from p2p_sync.errors import (
    EndlessDataAttackError,
    ForgedSignatureError,
    FreezeAttackError,
    MalformedManifestError,
    MissingSignatureError,
    RollbackAttackError,
    UntrustedSignerError,
    WrongSwarmError,
)
from p2p_sync.trust.chunks import manifest_for
from p2p_sync.trust.keys import SigningKey
from p2p_sync.trust.manifest import (
    PATCH,
    SNAPSHOT,
    Manifest,
    ManifestLimits,
    SwarmPolicy,
    canonical,
    sign,
    verify,
)

NOW = 1_800_000_000
TRAINER, OTHER, THIRD = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
POLICY = SwarmPolicy("swarm-a", (TRAINER.public,))
PAYLOAD = bytes(range(256)) * 1000  # 256,000 bytes


def make(version: int = 5, swarm: str | None = None, **kw) -> Manifest:
    fields = dict(kind=PATCH, base_version=version - 1, base_state="ab" * 16)
    fields.update(kw)
    return manifest_for(
        PAYLOAD,
        swarm=swarm or POLICY.swarm_id,
        version=version,
        target_state="cd" * 16,
        layout="ef" * 16,
        now=NOW,
        chunk_size=64 * 1024,
        **fields,
    )


def tamper(data: bytes, edit: Callable[[dict], None]) -> bytes:
    doc = json.loads(data)
    edit(doc)
    return json.dumps(doc).encode()


def _set(field: str, value) -> Callable[[dict], None]:
    return lambda doc: doc["signed"].__setitem__(field, value)


GOOD = sign(make(), [TRAINER])

# (name, manifest bytes, kwargs for verify, expected error, message fragment)
ATTACKS = [
    ("unsigned", sign(make(), []), {}, MissingSignatureError, "no signature"),
    (
        "forged signature",
        tamper(GOOD, lambda d: d["signatures"][0].__setitem__("sig", "00" * 64)),
        {},
        ForgedSignatureError,
        "does not verify",
    ),
    ("tampered content", tamper(GOOD, _set("version", 6)), {}, ForgedSignatureError, "verify"),
    ("untrusted signer", sign(make(), [OTHER]), {}, UntrustedSignerError, "untrusted"),
    (
        "wrong swarm",
        sign(make(swarm=SwarmPolicy("swarm-b", (TRAINER.public,)).swarm_id), [TRAINER]),
        {},
        WrongSwarmError,
        "swarm",
    ),
    ("rollback", GOOD, {"accepted_version": 7}, RollbackAttackError, "not newer"),
    ("replay", GOOD, {"accepted_version": 5}, RollbackAttackError, "not newer"),
    ("freeze (expired)", GOOD, {"now": NOW + 8 * 86400}, FreezeAttackError, "expired"),
    (
        "endless data (payload)",
        GOOD,
        {"limits": ManifestLimits(max_payload_size=1000)},
        EndlessDataAttackError,
        "exceeds",
    ),
    (
        "endless data (manifest size)",
        GOOD,
        {"limits": ManifestLimits(max_manifest_bytes=100)},
        EndlessDataAttackError,
        "manifest is",
    ),
    ("unknown field", tamper(GOOD, _set("extra", 1)), {}, MalformedManifestError, "unknown"),
    (
        "missing field",
        tamper(GOOD, lambda d: d["signed"].pop("chunks")),
        {},
        MalformedManifestError,
        "missing",
    ),
    ("wrong type", tamper(GOOD, _set("version", "5")), {}, MalformedManifestError, "type"),
    ("bool as int", tamper(GOOD, _set("version", True)), {}, MalformedManifestError, "type"),
    ("not json", b"\xff{", {}, MalformedManifestError, "not JSON"),
    (
        "chunk count",
        tamper(GOOD, _set("chunks", ["aa" * 32])),
        {},
        MalformedManifestError,
        "chunk hashes for",
    ),
    (
        "snapshot with base",
        sign(make(kind=SNAPSHOT, base_version=None), [TRAINER]),
        {},
        MalformedManifestError,
        "snapshot",
    ),
    (
        "patch without base",
        sign(make(base_version=None), [TRAINER]),
        {},
        MalformedManifestError,
        "base",
    ),
]


@pytest.mark.parametrize(
    ("name", "data", "kwargs", "error", "message"), ATTACKS, ids=[a[0] for a in ATTACKS]
)
def test_attack_is_refused_with_its_own_error(name, data, kwargs, error, message) -> None:
    args = {"now": NOW + 10, "accepted_version": 4, **kwargs}
    with pytest.raises(error, match=message):
        verify(data, POLICY, **args)


def test_a_good_manifest_verifies_and_round_trips() -> None:
    m = verify(GOOD, POLICY, now=NOW + 10, accepted_version=4)
    assert m == make() and m.digest == make().digest
    assert m.chunk_length(0) == 65536 and m.chunk_length(3) == 256_000 - 3 * 65536


def test_threshold_counts_distinct_keys_once() -> None:
    policy = SwarmPolicy("swarm-t", (TRAINER.public, OTHER.public, THIRD.public), threshold=2)
    m = make(swarm=policy.swarm_id)
    twice = sign(m, [TRAINER, TRAINER])  # the same key twice is still one signer
    with pytest.raises(MissingSignatureError, match="threshold 2"):
        verify(twice, policy, now=NOW, accepted_version=None)
    assert verify(sign(m, [TRAINER, THIRD]), policy, now=NOW, accepted_version=None) == m


def test_threshold_policy_rejects_impossible_thresholds() -> None:
    with pytest.raises(ValueError, match="distinct keys"):
        SwarmPolicy("s", (TRAINER.public, TRAINER.public), threshold=2)


def test_swarm_id_depends_on_name_keys_and_threshold() -> None:
    ids = {
        SwarmPolicy("a", (TRAINER.public,)).swarm_id,
        SwarmPolicy("b", (TRAINER.public,)).swarm_id,
        SwarmPolicy("a", (OTHER.public,)).swarm_id,
        SwarmPolicy("a", (TRAINER.public, OTHER.public), 1).swarm_id,
        SwarmPolicy("a", (TRAINER.public, OTHER.public), 2).swarm_id,
    }
    assert len(ids) == 5
    assert (
        SwarmPolicy("a", (OTHER.public, TRAINER.public)).swarm_id
        == SwarmPolicy("a", (TRAINER.public, OTHER.public)).swarm_id
    )


def test_canonical_encoding_is_the_documented_one() -> None:
    assert canonical({"b": 1, "a": [1, "é"]}) == b'{"a":[1,"\\u00e9"],"b":1}'
