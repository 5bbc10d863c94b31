"""An access token a platform issues for a while (Tencent's, DingTalk's: 7,200 s), kept until shortly before it
expires and fetched again at once when a call says it is stale, by one thread at a time."""
from __future__ import annotations

import threading
import time
from typing import Callable

#: Fetch a new token this long before the one in hand expires.
REFRESH_MARGIN_SECS = 300.0


class TokenCache:
    """An access token, kept until ``margin`` seconds before it expires (at the latest half-way through its
    life), fetched again when a call says it is stale. ``fetch(stale)`` returns ``(token, expires_in)``;
    ``stale`` is the token the platform refused (None for a fetch at expiry), for a platform whose normal
    fetch may give that same token back. Thread-safe: one fetch at a time."""

    def __init__(self, fetch: Callable[[str | None], tuple[str, float]], *, clock: Callable[[], float] = time.monotonic,
                 margin: float = REFRESH_MARGIN_SECS):
        self._fetch, self._clock, self.margin = fetch, clock, margin
        self._lock = threading.Lock()
        self._token: str | None = None
        self._refresh_at = 0.0

    def get(self, *, fresh: bool = False, stale: str | None = None) -> str:
        """The token; with ``fresh`` (the platform said ``stale`` is no longer valid) a new one, unless another
        thread already replaced ``stale``."""
        with self._lock:
            if fresh and (stale is None or stale == self._token):
                self._token = None
                self._keep(*self._fetch(stale))
            elif self._token is None or self._clock() >= self._refresh_at:
                self._keep(*self._fetch(None))
            return self._token

    def _keep(self, token: str, expires_in: float) -> None:
        self._token = token
        self._refresh_at = self._clock() + max(expires_in / 2, expires_in - self.margin)
