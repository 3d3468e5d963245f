"""Token bucket for upload caps (volunteers on home links want to bound what they relay).

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
