"""Token bucket for upload caps (volunteers on home links want to bound what they relay), and
a limit on log lines a peer can trigger over and over (:class:`RepeatedLine`).

Sans-I/O: ``reserve`` takes the current time and returns how long the caller must wait before
sending; the caller does the waiting (asyncio in the data plane, virtual time in a simulator).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """``rate`` bytes per second with bursts of up to ``burst`` bytes."""

    rate: float
    burst: float
    _tokens: float = field(init=False)
    _stamp: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst <= 0:
            raise ValueError("rate and burst must be positive")
        self._tokens = self.burst

    def reserve(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` (going into debt if needed); returns seconds to wait before sending."""
        if self._stamp is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= nbytes
        return max(0.0, -self._tokens / self.rate)


@dataclass
class RepeatedLine:
    """One log line per ``every_s`` for an event a peer can repeat at will (a refused
    connection, a failed accept): the first is logged at once, the others are counted and
    the next line due says how many it stands for. Sans-I/O like the bucket: time passed in."""

    every_s: float
    held: int = field(init=False, default=0)  # events since the last line logged
    _due: float = field(init=False, default=float("-inf"))

    def hit(self, now: float) -> int:
        """Count one event; returns how many events a line logged now stands for (this one
        and those held back since the last line), or 0: log nothing."""
        self.held += 1
        if now < self._due:
            return 0
        count, self.held, self._due = self.held, 0, now + self.every_s
        return count
