"""The signatures a webhook took, each tied to what it first came with (a digest: of the body, or of the
message's identity): for a platform whose signature does not cover the body (WeChat's plaintext mode signs a
timestamp and nonce; DingTalk's robot signs only the timestamp), so a captured signature carries nothing
else while it is still fresh.

``SeenLog.first_use(key, digest)`` says whether ``key`` (the signature) is new, or was seen with this very
digest (the platform calling again): another digest under it is a forgery (``use`` tells the three apart).
What was seen is kept for ``keep_secs`` (at least as long as the platform's freshness window) in an
append-only file of the worker's own, one line a signature (``<at> <key> <digest hex>``), flushed and synced before the request is answered,
read back at start and compacted when the dead lines outnumber the live ones, so a restart forgets none of it.
"""
from __future__ import annotations

import hmac
import os
import threading
from typing import Callable

#: What ``SeenLog.use`` found: the key is new, came before with this digest, or came before with another.
NEW, AGAIN, OTHER = "new", "again", "other"


class SeenLog:
    """The signatures seen, each with its body's digest and when. No path: kept in memory only (a test's
    server). Thread-safe."""

    def __init__(self, path: str | None, keep_secs: float, clock: Callable[[], float]):
        self.path, self.keep_secs, self._clock = path, keep_secs, clock
        self.entries: dict[str, tuple[float, bytes]] = {}
        self._lines = 0
        self._file = None
        self._lock = threading.Lock()
        if path is None:
            return
        try:
            with open(path, "r", encoding="ascii") as f:
                for line in f:
                    at, key, digest = (line.split() + ["", "", ""])[:3]
                    try:
                        self.entries[key] = (float(at), bytes.fromhex(digest))
                    except ValueError:
                        continue  # a line torn by a crash mid-write: its request was never answered
                    self._lines += 1
        except FileNotFoundError:
            pass
        self.prune()
        self._compact()

    def first_use(self, key: str, digest: bytes) -> bool:
        """Whether ``key`` is new (then it is recorded with ``digest``, on disk before this returns) or was
        seen with this very ``digest``; False when it came before with another."""
        return self.use(key, digest) != OTHER

    def use(self, key: str, digest: bytes) -> str:
        """``NEW`` (``key`` recorded with ``digest``, on disk before this returns), ``AGAIN`` (seen with this
        very digest) or ``OTHER`` (seen with another: a forgery)."""
        with self._lock:
            self.prune()
            seen = self.entries.get(key)
            if seen is not None:
                return AGAIN if hmac.compare_digest(seen[1], digest) else OTHER
            self.add(key, digest)
            return NEW

    def prune(self) -> None:
        """Forget what is older than ``keep_secs``. The entries are in the order they came (a key is added
        once), so the oldest are first: it stops at the first one still kept."""
        horizon = self._clock() - self.keep_secs
        while self.entries:
            key, (at, _) = next(iter(self.entries.items()))
            if at >= horizon:
                break
            del self.entries[key]
        if self.path is not None and self._lines > 2 * len(self.entries) + 1000:
            self._compact()

    def add(self, key: str, digest: bytes) -> None:
        if any(c.isspace() for c in key) or not key:
            raise ValueError("a seen key is one word")  # (a line is three words)
        at = self._clock()
        self.entries[key] = (at, digest)
        if self._file is not None:
            self._file.write(f"{at:.3f} {key} {digest.hex()}\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._lines += 1

    def _compact(self) -> None:
        if self._file is not None:
            self._file.close()
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            for key, (at, digest) in self.entries.items():
                f.write(f"{at:.3f} {key} {digest.hex()}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self.entries)
        self._file = open(self.path, "a", encoding="ascii")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
