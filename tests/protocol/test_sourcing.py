"""The one sourcing rule the node and the simulator share (``p2p_sync.protocol.sourcing``)."""

from __future__ import annotations

from p2p_sync.protocol import sourcing


def test_the_order_is_trusted_then_behind_nat_then_by_rank() -> None:
    peers = ["c", "nat-b", "trainer", "a", "nat-a"]
    order = sourcing.follow_order(
        peers, lambda p: p == "trainer", lambda p: p.startswith("nat"), lambda p: p[-1]
    )
    assert order == ["trainer", "nat-a", "nat-b", "a", "c"]


def test_a_download_follows_the_first_few_and_every_owed_source_beyond() -> None:
    order = ["trainer", "nat-a", "nat-b", "a", "b", "c"]
    owes = lambda p: p.startswith("nat")  # noqa: E731
    assert sourcing.followed(order, 2, owes) == ["trainer", "nat-a", "nat-b"]
    assert sourcing.followed(order, 4, owes) == ["trainer", "nat-a", "nat-b", "a"]
    assert sourcing.followed(order, 2, lambda p: False) == ["trainer", "nat-a"]


def test_only_a_public_follower_owes_a_source_behind_nat() -> None:
    assert sourcing.owed(behind_nat=True, follower_public=True)
    assert not sourcing.owed(behind_nat=True, follower_public=False)
    assert not sourcing.owed(behind_nat=False, follower_public=True)
    assert sourcing.takes(1, 2, False) and sourcing.takes(2, 2, True)
    assert not sourcing.takes(2, 2, False)
