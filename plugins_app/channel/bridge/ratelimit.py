"""``TokenBucket``: how often a plugin may call ``inbound.submit`` (``BridgeServer``'s submit rate); no Django."""
from __future__ import annotations

import time
from typing import Callable


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` kept: a call takes one, or is told how long until one is there.

    Starts full, so a worker replaying a backlog after a restart gets ``burst`` at once, then ``rate`` a second.
    Not thread-safe: a bridge's bucket is used on its event loop only.
    """

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate must be above 0 (tokens a second), not {rate!r}")
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError(f"burst must be an integer of at least 1, not {burst!r}")
        self.rate = float(rate)
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> float:
        """0.0 when a token was taken; else the seconds until one will be there (and nothing is taken)."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate
