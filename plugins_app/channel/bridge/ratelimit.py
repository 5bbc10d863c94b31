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
        self._promised = float("-inf")  # when the token told to the latest refused caller comes

    def take(self) -> float:
        """0.0 when a token was taken; else the seconds until one is there for this caller (nothing is taken).

        Callers refused one after another are told tokens one after another (the first the next token, the second
        the one after it, ...), not all the same next one: told alike, every caller waiting came back at once, one
        got the token and the others were refused again, each token costing a refusal per caller waiting."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            if self._promised > now:
                self._promised -= 1.0 / self.rate  # (a caller told one has come for it, as far as can be told)
            return 0.0
        # (no further ahead than the bucket holds: a caller a little late then finds its token kept, not lost)
        first = now + (1.0 - self._tokens) / self.rate
        self._promised = min(max(first, self._promised + 1.0 / self.rate), first + (self.burst - 1) / self.rate)
        return self._promised - now
