"""channel-email's own small record beside the SDK's outbox (SQLite, one file per plugin)."""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path


class MailState:
    """The worker's own small record beside its outbox: the IMAP cursor, threads, and what it sent."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS cursor (mailbox TEXT PRIMARY KEY, uidvalidity INTEGER, last_uid INTEGER);
            CREATE TABLE IF NOT EXISTS thread (message_id TEXT PRIMARY KEY, conversation_id TEXT NOT NULL);
            CREATE TABLE IF NOT EXISTS conversation (
                conversation_id TEXT PRIMARY KEY, address TEXT NOT NULL, subject TEXT NOT NULL,
                last_message_id TEXT, refs TEXT NOT NULL DEFAULT '[]');
            CREATE TABLE IF NOT EXISTS sent (delivery_id TEXT PRIMARY KEY, message_id TEXT, at REAL);
        """)

    def close(self):
        with self._lock:
            self._db.close()

    def cursor(self, mailbox: str) -> tuple[int | None, int | None]:
        with self._lock:
            row = self._db.execute("SELECT uidvalidity, last_uid FROM cursor WHERE mailbox = ?", (mailbox,)).fetchone()
        return (row[0], row[1]) if row else (None, None)

    def set_cursor(self, mailbox: str, uidvalidity: int, last_uid: int) -> None:
        with self._lock:
            self._db.execute("INSERT INTO cursor VALUES (?, ?, ?) ON CONFLICT(mailbox) DO UPDATE SET "
                             "uidvalidity = excluded.uidvalidity, last_uid = excluded.last_uid",
                             (mailbox, uidvalidity, last_uid))

    def known_threads(self, ids: list[str]) -> dict[str, str]:
        if not ids:
            return {}
        with self._lock:
            rows = self._db.execute(f"SELECT message_id, conversation_id FROM thread WHERE message_id IN "
                                    f"({','.join('?' * len(ids))})", ids).fetchall()
        return dict(rows)

    def remember(self, conversation_id: str, message_id: str, *, address: str | None, subject: str | None,
                 refs: list[str]) -> None:
        """Map ``message_id`` to its thread; an inbound one also becomes the message an answer replies to."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR IGNORE INTO thread VALUES (?, ?)", (message_id, conversation_id))
                if address is not None:
                    self._db.execute(
                        "INSERT INTO conversation VALUES (?, ?, ?, ?, ?) ON CONFLICT(conversation_id) DO UPDATE SET "
                        "address = excluded.address, last_message_id = excluded.last_message_id, "
                        "refs = excluded.refs, subject = CASE WHEN conversation.subject = '' "
                        "THEN excluded.subject ELSE conversation.subject END",
                        (conversation_id, address, subject or "", message_id, json.dumps(refs)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def conversation(self, conversation_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT address, subject, last_message_id, refs FROM conversation "
                                   "WHERE conversation_id = ?", (conversation_id,)).fetchone()
        if row is None:
            return None
        return {"address": row[0], "subject": row[1], "last_message_id": row[2], "refs": json.loads(row[3])}

    def references_of(self, message_id: str) -> list[str] | None:
        """The References an answer to ``message_id`` carries, when that message was the thread's latest."""
        with self._lock:
            row = self._db.execute("SELECT refs FROM conversation WHERE last_message_id = ?", (message_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def mark_sent(self, delivery_id: str, message_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO sent VALUES (?, ?, ?)", (delivery_id, message_id, time.time()))

    def was_sent(self, delivery_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM sent WHERE delivery_id = ?", (delivery_id,)).fetchone() is not None
