"""Push trees (``push_tree = true`` in a scenario): a model of a dissemination the node does not
run yet, measured here to decide whether to build it (docs/decisions: push trees).

Pull costs every relay generation a have-map message, a request and the uploader's queue (about
three one-way latencies and a queue wait: ~0.1 s a hop at 20 ms). With push, SplitStream-style:
the chunks are cut into ``k`` stripes (chunk ``i`` is in stripe ``i % k``); each stripe has its
own tree whose interior nodes are a ``1/k`` share of the rollouts, disjoint across stripes, so
every rollout forwards one stripe and receives the others, and uploads about one payload. The
trainer streams each stripe to that stripe's root; the root to the stripe's other interior
nodes; each of those to ``~k`` leaves. ``k = sqrt(N)`` makes it two hops below the root, each
parent's children sharing its uplink equally.

Every node still runs the pull scheduler: a child gets :class:`p2p_sync.protocol.swarm.PeerPushes`
for its parent's stripe, waits for those chunks instead of requesting them, and pulls whatever a
parent fails to push (:mod:`p2p_sync.protocol.pushes`). An interior node whose root is gone (left,
banned) asks the stripe's next interior node, and the first of those asks the trainer (the stripe
has no other source); a leaf whose parent is gone pulls that stripe from the mesh (re-parenting
leaves overloads the remaining parents). The trainer shows nothing to pull for ``reseed_after_s``:
then its super-seeder serves what the trees lost (a root that crashed silently with chunks it had
not forwarded yet).

What is global here and would not be in a node: the layout (one random permutation; a node
would derive its stripe from its id and the version, and find parents by peer exchange), and
the trainer's list of roots.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

TRAINER = 0


@dataclass
class TreeLayout:
    """Stripes and parents of one version's push trees over rollouts ``1..N``."""

    k: int
    interior: dict[int, list[int]] = field(default_factory=dict)  # stripe -> nodes, root first
    parent: dict[tuple[int, int], int] = field(default_factory=dict)  # (node, stripe) -> parent

    @classmethod
    def build(cls, rollouts: list[int], rng: random.Random) -> TreeLayout:
        order = list(rollouts)
        rng.shuffle(order)
        tree = cls(max(1, round(math.sqrt(len(order)))))
        for s in range(tree.k):
            interior = order[s :: tree.k]
            tree.interior[s] = interior
            tree.parent[(interior[0], s)] = TRAINER
            for q in interior[1:]:
                tree.parent[(q, s)] = interior[0]
            fathers = interior[1:] or interior[:1]
            leaves = [q for q in order if (q, s) not in tree.parent]
            for j, q in enumerate(leaves):
                tree.parent[(q, s)] = fathers[j % len(fathers)]
        return tree

    def stripe(self, index: int) -> int:
        return index % self.k

    def chunks(self, s: int, n_chunks: int) -> range:
        return range(s, n_chunks, self.k)

    def replace(self, node: int, s: int, usable: Callable[[int], bool]) -> int | None:
        """The next parent of interior ``node`` in stripe ``s`` after its parent stopped: the
        first usable interior node before it, or the trainer if there is none (it is then the
        stripe's root). ``None`` for a leaf: it pulls the stripe instead."""
        interior = self.interior[s]
        if node not in interior:
            return None
        before = interior[: interior.index(node)]
        heir = next((q for q in before if usable(q)), None)
        if heir is None:  # the new root: a stopped node that comes back joins under it
            self.parent.update({(q, s): node for q in before})
        new = TRAINER if heir is None else heir
        self.parent[(node, s)] = new
        return new
