"""channel-translate's own record beside the SDK's outbox: the documents taken and each chunk's answer.

One SQLite file per plugin (``<state dir>/<plugin id>.translate.sqlite3``), WAL with ``synchronous=FULL``
like the outbox, so an answer recorded survives ``kill -9`` and a power cut. Documents are keyed by their
content's SHA-256 and the name they were dropped under; chunks by the content's digest, the target
language and their index, so the same content dropped again (under any name) finds its answers here and
runs no turn. Rows of documents finished more than KEEP_SECS ago are pruned at start.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: How long a finished document's answers are kept to recognise the same file dropped again.
KEEP_SECS = 180 * 86400

NEW, SUBMITTED, ANSWERED, FAILED = "new", "submitted", "answered", "failed"
WORKING, DONE = "working", "done"


def conversation_id_for(digest: str, lang: str) -> str:
    """One conversation per document and target language: the engine sees the earlier chunks."""
    return f"doc:{digest[:24]}:{lang}"


def message_id_for(digest: str, lang: str, index: int, prompt: str, attempt: int = 1) -> str:
    """A chunk's idempotency key: the document, the language, the chunk, what it asks (and the attempt,
    after a failed turn), so a restart or a second drop of the same file never runs a chunk twice."""
    base = f"{digest[:16]}.{lang}.{index:04d}.{hashlib.sha256(prompt.encode()).hexdigest()[:10]}"
    return base if attempt == 1 else f"{base}.try{attempt}"


@dataclass
class ChunkRow:
    digest: str
    lang: str
    index: int
    total: int
    conversation_id: str
    message_id: str
    attempt: int
    prompt: str
    source: dict
    state: str
    answer: str | None
    reason: str | None


@dataclass
class DocumentRow:
    digest: str
    name: str
    form: str
    langs: list[str]
    trailing_newline: bool
    state: str
    reason: str | None


_CHUNK_COLUMNS = ("digest, lang, idx, total, conversation_id, message_id, attempt, prompt, source, state, answer, "
                  "reason")


def _chunk(row) -> ChunkRow:
    return ChunkRow(row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], json.loads(row[8]), row[9],
                    row[10], row[11])


def _document(row) -> DocumentRow:
    return DocumentRow(row[0], row[1], row[2], json.loads(row[3]), bool(row[4]), row[5], row[6])


class TranslateState:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS document (
                digest TEXT NOT NULL, name TEXT NOT NULL, form TEXT NOT NULL, langs TEXT NOT NULL,
                trailing_newline INTEGER NOT NULL, state TEXT NOT NULL, reason TEXT, at REAL NOT NULL,
                PRIMARY KEY (digest, name));
            CREATE TABLE IF NOT EXISTS chunk (
                digest TEXT NOT NULL, lang TEXT NOT NULL, idx INTEGER NOT NULL, total INTEGER NOT NULL,
                conversation_id TEXT NOT NULL, message_id TEXT NOT NULL, attempt INTEGER NOT NULL,
                prompt TEXT NOT NULL, source TEXT NOT NULL, state TEXT NOT NULL, answer TEXT, reason TEXT,
                PRIMARY KEY (digest, lang, idx));
            CREATE INDEX IF NOT EXISTS chunk_message ON chunk (conversation_id, message_id);
        """)
        self._prune()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self):
        return _Transaction(self._db)

    def _prune(self) -> None:
        with self._lock, self._tx():
            self._db.execute("DELETE FROM document WHERE state != ? AND at < ?", (WORKING, time.time() - KEEP_SECS))
            self._db.execute("DELETE FROM chunk WHERE digest NOT IN (SELECT digest FROM document)")

    # ------------------------------------------------------------------ documents

    def take(self, *, digest: str, name: str, form: str, trailing_newline: bool,
             chunks: dict[str, list[tuple[str, dict]]]) -> None:
        """Record a dropped file (again): its document row working, and the chunks of each language that
        has none yet ((prompt, source) each, in order). A language already recorded keeps its chunks: the
        plan made at the first drop stands, so no chunk is ever asked twice in two shapes. Chunks a failed
        run gave up on are tried again (a new attempt)."""
        with self._lock, self._tx():
            self._db.execute(
                "INSERT INTO document VALUES (?, ?, ?, ?, ?, ?, NULL, ?) ON CONFLICT (digest, name) DO UPDATE "
                "SET state = excluded.state, langs = excluded.langs, reason = NULL, at = excluded.at",
                (digest, name, form, json.dumps(sorted(chunks)), int(trailing_newline), WORKING, time.time()))
            for lang, parts in chunks.items():
                if self._db.execute("SELECT 1 FROM chunk WHERE digest = ? AND lang = ? LIMIT 1",
                                    (digest, lang)).fetchone():
                    continue
                conversation = conversation_id_for(digest, lang)
                for index, (prompt, source) in enumerate(parts):
                    self._db.execute(
                        "INSERT INTO chunk VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?, ?, NULL, NULL)",
                        (digest, lang, index, len(parts), conversation,
                         message_id_for(digest, lang, index, prompt), prompt, json.dumps(source), NEW))
            for row in self._db.execute(f"SELECT {_CHUNK_COLUMNS} FROM chunk WHERE digest = ? AND state = ?",
                                        (digest, FAILED)).fetchall():
                c = _chunk(row)
                self._db.execute(
                    "UPDATE chunk SET state = ?, attempt = ?, message_id = ?, reason = NULL "
                    "WHERE digest = ? AND lang = ? AND idx = ?",
                    (NEW, c.attempt + 1, message_id_for(digest, c.lang, c.index, c.prompt, c.attempt + 1),
                     digest, c.lang, c.index))

    def document(self, digest: str, name: str) -> DocumentRow | None:
        with self._lock:
            row = self._db.execute("SELECT digest, name, form, langs, trailing_newline, state, reason FROM document "
                                   "WHERE digest = ? AND name = ?", (digest, name)).fetchone()
        return _document(row) if row else None

    def working(self) -> list[DocumentRow]:
        with self._lock:
            rows = self._db.execute("SELECT digest, name, form, langs, trailing_newline, state, reason FROM document "
                                    "WHERE state = ? ORDER BY at", (WORKING,)).fetchall()
        return [_document(r) for r in rows]

    def settle(self, digest: str, name: str, state: str, reason: str | None = None) -> None:
        with self._lock:
            self._db.execute("UPDATE document SET state = ?, reason = ?, at = ? WHERE digest = ? AND name = ?",
                             (state, reason, time.time(), digest, name))

    def counts(self) -> dict:
        with self._lock:
            docs = dict(self._db.execute("SELECT state, count(*) FROM document GROUP BY state").fetchall())
            chunks = dict(self._db.execute("SELECT state, count(*) FROM chunk GROUP BY state").fetchall())
        return {"documents": docs, "chunks": chunks}

    # ------------------------------------------------------------------ chunks

    def chunks(self, digest: str, lang: str) -> list[ChunkRow]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_CHUNK_COLUMNS} FROM chunk WHERE digest = ? AND lang = ? "
                                    "ORDER BY idx", (digest, lang)).fetchall()
        return [_chunk(r) for r in rows]

    def chunk_of(self, conversation_id: str, message_id: str | None) -> ChunkRow | None:
        """The chunk whose current attempt is this message; None for any other message."""
        if not message_id:
            return None
        with self._lock:
            row = self._db.execute(f"SELECT {_CHUNK_COLUMNS} FROM chunk WHERE conversation_id = ? AND message_id = ?",
                                   (conversation_id, message_id)).fetchone()
        return _chunk(row) if row else None

    def submitted(self, c: ChunkRow) -> None:
        with self._lock:
            self._db.execute("UPDATE chunk SET state = ? WHERE digest = ? AND lang = ? AND idx = ? AND "
                             "message_id = ? AND state = ?", (SUBMITTED, c.digest, c.lang, c.index, c.message_id, NEW))

    def answered(self, c: ChunkRow, answer: str) -> bool:
        """Record the answer to the chunk's current attempt; False when it already had one (a redelivery)."""
        with self._lock:
            cur = self._db.execute("UPDATE chunk SET state = ?, answer = ? WHERE digest = ? AND lang = ? AND idx = ? "
                                   "AND message_id = ? AND state IN (?, ?)",
                                   (ANSWERED, answer, c.digest, c.lang, c.index, c.message_id, NEW, SUBMITTED))
            return cur.rowcount == 1

    def turn_failed(self, c: ChunkRow, reason: str, *, max_attempts: int) -> bool:
        """The chunk's turn ended without a translation: a new attempt (a new message id), or, past
        ``max_attempts``, the chunk failed. Returns True when it failed for good."""
        with self._lock:
            if c.attempt < max_attempts:
                self._db.execute("UPDATE chunk SET state = ?, attempt = ?, message_id = ?, reason = ? "
                                 "WHERE digest = ? AND lang = ? AND idx = ? AND message_id = ?",
                                 (NEW, c.attempt + 1, message_id_for(c.digest, c.lang, c.index, c.prompt,
                                                                     c.attempt + 1),
                                  reason, c.digest, c.lang, c.index, c.message_id))
                return False
            self._db.execute("UPDATE chunk SET state = ?, reason = ? WHERE digest = ? AND lang = ? AND idx = ? "
                             "AND message_id = ?", (FAILED, reason, c.digest, c.lang, c.index, c.message_id))
            return True


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, *_):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
