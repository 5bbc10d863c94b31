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
* **Presses.** A press of a card, recorded (once per press: its inbound message's key) before it is queued for
  the host, with the ``ResponseCode`` its callback carries: once the host applied it as the answer, the card is
  updated (``update_template_card``) to show the chosen option. A press moves ``waiting`` → ``updating``
  (claimed by one conditional update, so one thread, once) → ``updated`` or ``failed``, or ``waiting`` →
  ``skipped`` when the host did not take it as the answer; a WeCom redelivery of the press is the same row.
  A press still ``updating`` when the worker starts (its call cut short by a kill or a stop) is logged and
  marked ``failed``: whether WeCom made the update is unknown, and it is not tried again.

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
#: A press's states (see the module docstring).
PRESS_WAITING, PRESS_UPDATING, PRESS_UPDATED, PRESS_FAILED, PRESS_SKIPPED = (
    "waiting", "updating", "updated", "failed", "skipped")


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
        self._db.execute("CREATE TABLE IF NOT EXISTS presses (message_key TEXT PRIMARY KEY, user TEXT, "
                         "response_code TEXT, label TEXT, state TEXT, at REAL)")
        # presses_waiting() reads the presses still waiting for the host's answer
        self._db.execute("CREATE INDEX IF NOT EXISTS presses_state ON presses (state, at)")
        self._pruned_at = 0.0
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        """Delete the rows past KEEP_SECS (the lock held)."""
        now = self._clock()
        self._db.execute("DELETE FROM uploads WHERE created_at < ?", (now - KEEP_SECS,))
        self._db.execute("DELETE FROM cards WHERE at < ?", (now - KEEP_SECS,))
        self._db.execute("DELETE FROM presses WHERE at < ?", (now - KEEP_SECS,))
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

    # ------------------------------------------------------------------ presses

    def record_press(self, message_key: str, user: str, response_code: str, label: str) -> bool:
        """A press to update its card for once the host answered it; False when it was recorded before."""
        with self._lock:
            self._prune_if_due()
            cursor = self._db.execute("INSERT OR IGNORE INTO presses VALUES (?, ?, ?, ?, ?, ?)",
                                      (message_key, user, response_code, label, PRESS_WAITING, self._clock()))
        return cursor.rowcount == 1

    def presses_waiting(self) -> list[tuple[str, str, str, str, float]]:
        """(message key, user, response code, label, when recorded) of each press waiting for the host."""
        with self._lock:
            return self._db.execute("SELECT message_key, user, response_code, label, at FROM presses WHERE state = ? "
                                    "ORDER BY at", (PRESS_WAITING,)).fetchall()

    def move_press(self, message_key: str, before: str, after: str) -> bool:
        """Move a press from ``before`` to ``after``; False when it was not in ``before`` (another thread won)."""
        with self._lock:
            cursor = self._db.execute("UPDATE presses SET state = ? WHERE message_key = ? AND state = ?",
                                      (after, message_key, before))
        return cursor.rowcount == 1

    def presses_updating_to_failed(self) -> list[str]:
        """The message key of each press left ``updating`` (its call cut short by a stop or a kill), each
        moved to ``failed`` in the same transaction: read at start, before any thread claims a press."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute("SELECT message_key FROM presses WHERE state = ? ORDER BY at",
                                        (PRESS_UPDATING,)).fetchall()
                self._db.execute("UPDATE presses SET state = ? WHERE state = ?", (PRESS_FAILED, PRESS_UPDATING))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return [row[0] for row in rows]

    def press_state(self, message_key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT state FROM presses WHERE message_key = ?", (message_key,)).fetchone()
        return None if row is None else row[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
