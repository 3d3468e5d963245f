"""How a manifest's have-map grew since a node last listed it.

A node lists its have-maps after every chunk that lands; a whole listing each time made a
version cost O(chunks^2) (``benchmarks/have_listing.py``). So the store keeps, per manifest,
the slots gained by chunks arriving, in order, and a count of every other kind of change (a
pack dropped, a slot rotted, a manifest or a whole payload added): a listing asked from a mark
of the same count is the arrivals since it; any other is the whole map.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class HaveMark:
    """Where a have-map listing stood (``Store.held_since``): the store's count of changes
    other than arrivals, and how many arrivals it had then; ``whole``: that answer was the
    whole map."""

    epoch: int
    at: int
    whole: bool


class HaveNews:
    """Arrivals per manifest since the last change of any other kind, and that change's
    count."""

    def __init__(self) -> None:
        self.arrived: dict[str, list[int]] = {}
        self.epoch = 0

    def changed(self) -> None:
        """Some have-map changed otherwise than by a chunk arriving: the next listings are
        whole."""
        self.epoch += 1
        self.arrived.clear()

    def arrive(self, mdigest: str, index: int) -> None:
        self.arrived.setdefault(mdigest, []).append(index)

    def since(
        self, mdigest: str, mark: HaveMark | None, whole: Callable[[], list[int]]
    ) -> tuple[HaveMark, list[int]]:
        """The arrivals since ``mark`` when it is of the current count, else ``whole()``."""
        arrived = self.arrived.get(mdigest, [])
        if mark is not None and mark.epoch == self.epoch and mark.at <= len(arrived):
            return HaveMark(self.epoch, len(arrived), False), arrived[mark.at :]
        return HaveMark(self.epoch, len(arrived), True), whole()
