"""The sent-parts journal: which parts of each delivery the platform already took, for a worker whose platform
has no idempotency key it honours for long (Telegram: none; WhatsApp: none; LINE: its retry key lasts 24 h).

A worker records each part right after the platform accepted it, and a resend of the delivery after a crash
(or the hub's retry) skips the parts recorded. The one part in flight when the worker died is the window
left (a platform's own key, where there is one, closes it). A SQLite file of the worker's own, beside its
outbox; written with synchronous=FULL, so a part recorded survives a power cut; rows are kept 180 days.

A worker that uploads a part's file before sending it may also keep what the upload gave (``record_ref``: the
platform's media id, or why the file is not sent) under the part's number, so a delivery resumed after a crash
sends the same media id (or the same note) without uploading the file again.
"""
from __future__ import annotations

import sqlite3
import threading
import time

#: How long a journaled part is kept: past the hub's retries by far, and past the time an operator usually
#: takes to requeue a dead letter (which waits without limit: a requeue later than this may send again a part
#: the platform took before; docs/plugins.md says so). One row a part: the file stays small.
KEEP_SECS = 180 * 86400


class SentJournal:
    def __init__(self, path: str):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS sent (delivery_id TEXT, part INTEGER, message_id TEXT, "
                         "at REAL, PRIMARY KEY (delivery_id, part))")
        self._db.execute("CREATE INDEX IF NOT EXISTS sent_message ON sent (message_id)")
        self._db.execute("CREATE TABLE IF NOT EXISTS refs (delivery_id TEXT, part INTEGER, ref TEXT, at REAL, "
                         "PRIMARY KEY (delivery_id, part))")
        self._db.execute("DELETE FROM sent WHERE at < ?", (time.time() - KEEP_SECS,))
        self._db.execute("DELETE FROM refs WHERE at < ?", (time.time() - KEEP_SECS,))

    def done(self, delivery_id: str) -> dict[int, str]:
        """Each part of the delivery already taken, and the platform's message id for it."""
        with self._lock:
            return dict(self._db.execute("SELECT part, message_id FROM sent WHERE delivery_id = ?", (delivery_id,)))

    def delivery_of(self, message_id: str) -> tuple[str, int] | None:
        """The delivery and part a platform's message id was sent for, while the journal keeps it."""
        with self._lock:
            row = self._db.execute("SELECT delivery_id, part FROM sent WHERE message_id = ?", (message_id,)).fetchone()
        return (row[0], row[1]) if row else None

    def record(self, delivery_id: str, part: int, message_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sent VALUES (?, ?, ?, ?)",
                             (delivery_id, part, message_id, time.time()))

    def ref_of(self, delivery_id: str, part: int) -> str | None:
        """What ``record_ref`` kept for the part (its upload's media id...), or None."""
        with self._lock:
            row = self._db.execute("SELECT ref FROM refs WHERE delivery_id = ? AND part = ?",
                                   (delivery_id, part)).fetchone()
        return row[0] if row else None

    def record_ref(self, delivery_id: str, part: int, ref: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO refs VALUES (?, ?, ?, ?)", (delivery_id, part, ref, time.time()))

    def close(self) -> None:
        with self._lock:
            self._db.close()
