"""The transport's gossip gate (``p2p_sync.transport.gossip``), sans-I/O: news the node learned
over HTTP before its gossip copy came is still forwarded once, old news is not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from p2p_sync.transport.gossip import GossipValidator
from p2p_sync.trust import announce
from p2p_sync.trust.announce import Decision
from tests.trust.test_p2p_announce import NOW_MS, POLICY, message

FORWARDER = "12D3KooWforwarder"


class Gate:
    """A validator whose node "knows" the digests in ``stored``; scheduled calls run at once."""

    def __init__(self, seen_digests: int = 4096) -> None:
        self.stored: set[str] = set()
        self.accepted: list[Decision] = []
        self.known_news: list[Decision] = []
        self.validator = GossipValidator(
            self._judge,
            lambda d, url, at: self.accepted.append(d),
            self.stored.__contains__,
            lambda d, at: self.known_news.append(d),
            lambda fn, *args: fn(*args),
            seen_digests=seen_digests,
        )

    def _judge(self, data: bytes, known: Callable[[str], bool]) -> Decision:
        return announce.judge(data, POLICY, NOW_MS, known)

    def forwards(self, data: bytes) -> bool:
        return self.validator.validate(data, FORWARDER, None).forward


def digest_of(data: bytes) -> str:
    decision: Any = announce.judge(data, POLICY, NOW_MS, lambda d: False)
    return decision.announcement.digests[0]


def test_news_already_stored_is_not_forwarded() -> None:
    gate, data = Gate(), message(3)
    gate.stored.add(digest_of(data))
    assert not gate.forwards(data)
    assert gate.accepted == [] and len(gate.known_news) == 1
    assert gate.validator.counts["ignore"] == 1


def test_news_learned_over_http_first_is_forwarded_once() -> None:
    gate, data = Gate(), message(3)
    digest = digest_of(data)
    gate.stored.add(digest)  # an HTTP push stored the manifest before gossip came
    gate.validator.learned_elsewhere([digest])
    assert gate.forwards(data)  # its first gossip copy goes on to the mesh behind us
    assert [d.announcement.digests for d in gate.accepted if d.announcement] == [(digest,)]
    assert not gate.forwards(data)  # a second copy (or a replay) is old news
    assert gate.validator.counts["accept"] == 1 and gate.validator.counts["ignore"] == 1


def test_a_note_after_gossip_does_not_revive_the_news() -> None:
    gate, data = Gate(), message(4)
    assert gate.forwards(data)
    gate.stored.add(digest_of(data))
    gate.validator.learned_elsewhere([digest_of(data)])  # learned over HTTP as well, later
    assert not gate.forwards(data)


def test_notes_are_bounded_oldest_forgotten_first() -> None:
    gate = Gate(seen_digests=2)
    first, *rest = [message(v) for v in (5, 6, 7)]
    digests = [digest_of(d) for d in (first, *rest)]
    gate.stored.update(digests)
    gate.validator.learned_elsewhere(digests)  # three notes, room for two
    assert not gate.forwards(first)  # forgotten: stored, so old news
    assert all(gate.forwards(d) for d in rest)


def test_forged_news_is_rejected_whatever_was_noted() -> None:
    gate, data = Gate(), message(3)
    gate.validator.learned_elsewhere([digest_of(data)])
    forged = data.replace(b'"version":3', b'"version":8')
    assert forged != data and not gate.forwards(forged)
    assert gate.validator.counts["reject"] == 1 and gate.accepted == []
