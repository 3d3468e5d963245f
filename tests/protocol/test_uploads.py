"""Upload slots: the sans-I/O line of one uploader (a Hypothesis state machine against a plain
model), and the data plane that waits on it (real routers, requests from two peers)."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import AsyncExitStack
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2p_sync.protocol.uploads import Admission, UploadSlots
from p2p_sync.transport.dataplane import DataRouter
from p2p_sync.transport.limits import HttpLimits
from p2p_sync.transport.messages import Request

REQUESTERS = st.sampled_from("abcd")


class SlotsMachine(RuleBasedStateMachine):
    """Requests arrive, uploads end, waiting requests give up, in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.slots: UploadSlots[int] = UploadSlots(3, 4)
        self.slots.STALE_SLACK = 0  # its heap drops stale keys as often as it can
        self.serving: list[str] = []  # one entry per upload in progress
        self.waiting: list[tuple[str, int, int]] = []  # (requester, handle, rank), in order
        self.served_at: dict[str, int] = {}
        self.grants = 0
        self.handles = 0

    def _granted(self, requester: str) -> None:
        self.serving.append(requester)
        self.grants += 1
        self.served_at[requester] = self.grants

    @rule(requester=REQUESTERS, rank=st.integers(0, 2))
    def arrive(self, requester: str, rank: int) -> None:
        self.handles += 1
        got = self.slots.request(requester, self.handles, rank)
        if len(self.serving) < 3:
            assert got is Admission.SERVE
            self._granted(requester)
        elif len(self.waiting) < 4:
            assert got is Admission.QUEUED
            self.waiting.append((requester, self.handles, rank))
        else:
            assert got is Admission.BUSY

    @precondition(lambda self: self.serving)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        requester = data.draw(st.sampled_from(self.serving))
        self.serving.remove(requester)
        started = self.slots.finished(requester)
        self._forget_quiet_requesters()
        if not self.waiting:
            assert started == []
            return
        assert len(started) == 1
        who, handle = started[0]

        def best(r: str) -> tuple[int, int]:  # its freshest request, then its oldest
            return min((rank, h) for q, h, rank in self.waiting if q == r)

        def key(r: str) -> tuple[int, int, int, int]:
            return (self.serving.count(r), best(r)[0], self.served_at.get(r, -1), best(r)[1])

        # the fairest pick: fewest uploads in progress, the freshest chunk, served longest ago
        assert key(who) == min(key(r) for r, _, _ in self.waiting)
        rank = best(who)[0]
        assert (rank, handle) == best(who)
        self.waiting.remove((who, handle, rank))
        self._granted(who)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def give_up(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.waiting))
        assert self.slots.withdraw(entry[1])
        assert not self.slots.withdraw(entry[1])
        self.waiting.remove(entry)
        self._forget_quiet_requesters()

    @rule()
    def stop(self) -> None:
        """The uploader stops: the waiting requests come back oldest first, and it starts over."""
        assert self.slots.clear() == [(r, h) for r, h, _ in self.waiting]
        self.serving.clear()
        self.waiting.clear()
        self.served_at.clear()

    def _forget_quiet_requesters(self) -> None:
        """History is kept only of requesters with uploads or requests here (as the slots do:
        bounded memory)."""
        here = set(self.serving) | {r for r, _, _ in self.waiting}
        self.served_at = {r: g for r, g in self.served_at.items() if r in here}

    @invariant()
    def counts_agree(self) -> None:
        assert self.slots.busy == len(self.serving) <= 3
        assert self.slots.queued == len(self.waiting) <= 4
        assert not self.waiting or self.slots.busy == 3  # work-conserving


SlotsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_upload_slots_state_machine = SlotsMachine.TestCase


def test_a_deep_requester_does_not_take_every_slot() -> None:
    slots: UploadSlots[str] = UploadSlots(2, 16)
    assert [slots.request("a", f"a{i}") for i in range(2)] == [Admission.SERVE] * 2
    for i in range(2, 6):
        assert slots.request("a", f"a{i}") is Admission.QUEUED
    assert slots.request("b", "b0") is Admission.QUEUED  # behind four of a's
    assert slots.finished("a") == [("b", "b0")]
    assert slots.finished("a") == [("a", "a2")]
    assert slots.finished("b") == [("a", "a3")]  # alone now: a gets every slot


def test_the_freshest_chunk_goes_first() -> None:
    """A chunk uploaded here fewer times is rarer in the swarm: its request goes first,
    within a requester and across requesters with as many uploads in progress."""
    slots: UploadSlots[str] = UploadSlots(1, 16)
    assert slots.request("a", "a-old", 5) is Admission.SERVE
    assert slots.request("a", "a-older", 3) is Admission.QUEUED
    assert slots.request("b", "b-common", 4) is Admission.QUEUED
    assert slots.request("a", "a-fresh", 0) is Admission.QUEUED
    assert slots.finished("a") == [("a", "a-fresh")]
    assert slots.finished("a") == [("a", "a-older")]  # b has none here either: rank 3 < 4
    assert slots.finished("a") == [("b", "b-common")]


def test_bad_use_is_refused() -> None:
    with pytest.raises(ValueError):
        UploadSlots(0, 4)
    slots: UploadSlots[str] = UploadSlots(1, 1)
    with pytest.raises(ValueError, match="no upload"):
        slots.finished("nobody")
    assert slots.request("a", "x") is Admission.SERVE
    assert slots.clear() == []
    assert slots.busy == 0


class _Chunks:
    """The part of a node's data view that serves chunks (a dict of them)."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        self.chunks, self.uploaded = chunks, 0
        self.contacts: list[tuple[str, bool]] = []  # (requester, has uploads here) in order

    def chunk(self, sha256: str, requester: str | None = None) -> bytes | None:
        return self.chunks.get(sha256)

    def count_upload(self, nbytes: int) -> None:
        self.uploaded += nbytes

    def upload_contact(self, requester: str, pending: bool) -> None:
        self.contacts.append((requester, pending))

    def requester(self, url: str, remote: str | None, upload: bool) -> None:
        pass


async def _serve_in_turn(limits: HttpLimits) -> dict[str, Any]:
    data = b"x" * 1000
    sha = hashlib.sha256(data).hexdigest()
    view = _Chunks({sha: data})
    router = DataRouter(view, limits)  # type: ignore[arg-type]
    order: list[str] = []

    def ask(peer: str) -> Request:
        return Request("GET", f"/chunk/{sha}", peer=f"http://{peer}:1", remote="10.0.0.1")

    async def fetch(name: str, peer: str) -> int:
        async with router.serve(ask(peer)) as reply:
            if reply.status == 200:
                order.append(name)
            return reply.status

    async with AsyncExitStack() as held:  # a1 holds the only slot while the others line up
        first = await held.enter_async_context(router.serve(ask("a")))
        tasks = {}
        for k, (name, peer) in enumerate((("a2", "a"), ("a3", "a"), ("b1", "b"), ("a4", "a"))):
            tasks[name] = asyncio.ensure_future(fetch(name, peer))
            await asyncio.sleep(0)  # one loop turn: the task runs up to its wait in the line
            assert router._slots.queued == k + 1
        busy = await fetch("c1", "c")  # the line (4) is full: refused at once
    statuses = {name: await task for name, task in tasks.items()}
    return {
        "first": first.status,
        "busy": busy,
        "statuses": statuses,
        "order": order,
        "contacts": view.contacts,
    }


def test_the_data_plane_hands_a_freed_slot_to_the_requester_served_least() -> None:
    out = asyncio.run(
        asyncio.wait_for(_serve_in_turn(HttpLimits(max_concurrent_uploads=1, upload_queue=4)), 30)
    )
    assert out["first"] == 200 and set(out["statuses"].values()) == {200}
    assert out["busy"] == 503
    assert out["order"] == ["b1", "a2", "a3", "a4"]  # first come, first served: a2 a3 b1 a4
    # the node hears when a requester has uploads here and when it has none left (a seed
    # takes back what it handed to one that stopped asking)
    said: dict[str, list[bool]] = {}
    for requester, pending in out["contacts"]:
        said.setdefault(requester, []).append(pending)
    assert said["http://a:1"][0] is True and said["http://a:1"][-1] is False
    assert said["http://b:1"] == [True, False]  # queued, then served
    assert said["http://c:1"] == [False]  # refused: nothing of its waits here


async def _fresh_first() -> list[str]:
    old, new = b"o" * 1000, b"n" * 1000
    shas = {name: hashlib.sha256(data).hexdigest() for name, data in (("old", old), ("new", new))}
    view = _Chunks({shas["old"]: old, shas["new"]: new})
    limits = HttpLimits(max_concurrent_uploads=1, upload_queue=4)
    router = DataRouter(view, limits)  # type: ignore[arg-type]
    order: list[str] = []

    def ask(peer: str, chunk: str) -> Request:
        return Request("GET", f"/chunk/{shas[chunk]}", peer=f"http://{peer}:1", remote="10.0.0.1")

    async def fetch(peer: str, chunk: str) -> None:
        async with router.serve(ask(peer, chunk)) as reply:
            assert reply.status == 200
            order.append(f"{peer}:{chunk}")

    async with AsyncExitStack() as held:  # a's upload of "old" holds the only slot
        await held.enter_async_context(router.serve(ask("a", "old")))
        tasks = []
        for peer, chunk in (("b", "old"), ("c", "new")):
            tasks.append(asyncio.ensure_future(fetch(peer, chunk)))
            await asyncio.sleep(0)
        assert router._slots.queued == 2
    await asyncio.gather(*tasks)
    return order


def test_the_data_plane_serves_the_chunk_uploaded_fewest_times_first() -> None:
    """b asked first, for a chunk already uploaded once; c's chunk was never uploaded here."""
    assert asyncio.run(asyncio.wait_for(_fresh_first(), 30)) == ["c:new", "b:old"]
