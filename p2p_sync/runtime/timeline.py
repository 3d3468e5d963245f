"""When each step of a version happened at this node (wall clock, first time only).

Why: a version that takes 3 s to reach the last rollout is the sum of an announcement's hops,
a manifest fetch, the first have-map answers, the chunk transfers and the apply; which of them
grows with latency, or with the number of peers, is what the emulated tier reports
(``simulations.emulated``) and what a user tuning a swarm asks first. ``/status`` shows the
steps of the last version handed off (``last_update.timeline``).

Steps, in the order they happen at a rollout: ``heard`` (first announcement naming the
manifest, HTTP or gossip), ``learned`` (the manifest verified and stored), ``first_have`` (the
first have-map answer offering a chunk of it, or the first chunk pushed unasked: forwarded
by a peer, ``p2p_sync.runtime.forwarding``), ``first_chunk`` (first chunk verified),
``fetched`` (every chunk verified), ``applied`` (weights updated and checked), ``handed_off``
(exported, when asked, and reported).
"""

from __future__ import annotations

import time

from p2p_sync.bounded import trim

STEPS = ("heard", "learned", "first_have", "first_chunk", "fetched", "applied", "handed_off")


class Timeline:
    """Step times per manifest digest, for the last ``keep`` manifests (bounded memory)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._steps: dict[str, dict[str, float]] = {}

    def note(self, digest: str, step: str, at: float | None = None) -> None:
        """``step`` happened for ``digest`` now (or ``at``); later calls for it are ignored."""
        if step not in STEPS:
            raise ValueError(f"unknown step {step!r}")
        steps = self._steps.setdefault(digest, {})
        steps.setdefault(step, time.time() if at is None else at)
        trim(self._steps, self.keep)

    def of(self, digest: str) -> dict[str, float]:
        """The steps noted for ``digest``, in the order they happen."""
        steps = self._steps.get(digest, {})
        return {s: steps[s] for s in STEPS if s in steps}
