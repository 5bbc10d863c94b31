"""What the WeCom worker keeps across a crash, beside its outbox: the media ids of a delivery's uploaded
files, and the options of each question card it sent.

* **Uploads.** A file of a delivery is uploaded (``media/upload``) and then sent (``message/send``) as its
  own part. Its media id is recorded the moment WeCom answers the upload, so a delivery resumed after
  ``kill -9`` sends the *same* media id again, and WeCom's duplicate check (the same content to the same
  user within 30 minutes) does not show it twice; a second upload would give a new media id, which the
  check would not recognise. A media id lasts 3 days: an older one is uploaded again.
* **Cards.** A question card's ``task_id`` and its options, recorded before the card is sent: a press
  (the ``template_card_event`` callback carries the button's key, the option's value) is turned back into
  the option's label, also by a worker restarted since.

A SQLite file of the worker's own, written with synchronous=FULL; rows are kept 30 days (a question waits
far less; a media id is useless after 3): older ones are deleted at start and, for a worker that runs for
weeks, at a write once a day has passed since the last time.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time

KEEP_SECS = 30 * 86400
#: How often (at most) a write also deletes the rows past KEEP_SECS.
PRUNE_EVERY_SECS = 86400
#: WeCom keeps a temporary media file 3 days; one this close to its end is uploaded again.
MEDIA_TTL_SECS = 3 * 86400
MEDIA_MARGIN_SECS = 3600


class WeComState:
    def __init__(self, path: str, *, clock=time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS uploads (delivery_id TEXT, part INTEGER, media_type TEXT, "
                         "media_id TEXT, created_at REAL, PRIMARY KEY (delivery_id, part))")
        self._db.execute("CREATE TABLE IF NOT EXISTS cards (task_id TEXT PRIMARY KEY, delivery_id TEXT, "
                         "options TEXT, at REAL)")
        self._pruned_at = 0.0
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        """Delete the rows past KEEP_SECS (the lock held)."""
        now = self._clock()
        self._db.execute("DELETE FROM uploads WHERE created_at < ?", (now - KEEP_SECS,))
        self._db.execute("DELETE FROM cards WHERE at < ?", (now - KEEP_SECS,))
        self._pruned_at = now

    def _prune_if_due(self) -> None:
        if self._clock() - self._pruned_at >= PRUNE_EVERY_SECS:
            self._prune()

    # ------------------------------------------------------------------ uploads

    def upload_of(self, delivery_id: str, part: int) -> tuple[str, str] | None:
        """(media type, media id) of a file of the delivery uploaded before, while WeCom still keeps it."""
        with self._lock:
            row = self._db.execute("SELECT media_type, media_id, created_at FROM uploads WHERE delivery_id = ? "
                                   "AND part = ?", (delivery_id, part)).fetchone()
        if row is None or self._clock() >= row[2] + MEDIA_TTL_SECS - MEDIA_MARGIN_SECS:
            return None
        return row[0], row[1]

    def record_upload(self, delivery_id: str, part: int, media_type: str, media_id: str,
                      created_at: float | None = None) -> None:
        when = created_at if created_at and created_at <= self._clock() else self._clock()
        with self._lock:
            self._prune_if_due()
            self._db.execute("INSERT OR REPLACE INTO uploads VALUES (?, ?, ?, ?, ?)",
                             (delivery_id, part, media_type, media_id, when))

    # ------------------------------------------------------------------ cards

    def record_card(self, task_id: str, delivery_id: str, options: list[dict]) -> None:
        with self._lock:
            self._prune_if_due()
            self._db.execute("INSERT OR REPLACE INTO cards VALUES (?, ?, ?, ?)",
                             (task_id, delivery_id, json.dumps(options, ensure_ascii=False), self._clock()))

    def card(self, task_id: str) -> list[dict] | None:
        """The options of the card sent with this task id, or None when this worker sent no such card."""
        with self._lock:
            row = self._db.execute("SELECT options FROM cards WHERE task_id = ?", (task_id,)).fetchone()
        if row is None:
            return None
        try:
            options = json.loads(row[0])
        except ValueError:
            return None
        return options if isinstance(options, list) else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
